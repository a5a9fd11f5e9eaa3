//! Reading the events of a request's choices, for both endpoints and both
//! ways of answering.
//!
//! A request is one [`EventStream`] per prompt, each carrying `n` choices
//! interleaved and tagged with their index. [`Choices`] merges them (choice
//! `i` of prompt `p` becomes choice `p * n + i`) and turns events into
//! [`Piece`]s: text with the logprobs of the tokens that completed it, tool
//! calls (a start, then argument fragments) numbered within their choice,
//! and one finish per choice. Dropping
//! it drops every stream, which cancels whatever still runs.

use std::future::poll_fn;
use std::task::Poll;

use mlxcel_engine_api::{
    EventStream, FailureKind, FinishReason, GenerationEvent, SampledLogprobs, TokenLogprob,
    ToolCall, Usage,
};

use crate::error::ApiError;

/// One step of a choice's output, ready to be shaped into a response.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// New text of choice `index`, with the logprobs of every token since
    /// the choice's previous piece. `reasoning` (reasoning models) comes
    /// before `text`; either may be empty, not both.
    Text {
        index: usize,
        text: String,
        reasoning: String,
        logprobs: Vec<SampledLogprobs>,
    },
    /// Choice `index` begins its `position`-th tool call (from 0).
    ToolCallStart {
        index: usize,
        position: usize,
        id: String,
        name: String,
        logprobs: Vec<SampledLogprobs>,
    },
    /// More arguments of choice `index`'s `position`-th tool call (JSON
    /// text as generated; a call's arguments are the concatenation).
    ToolCallArguments {
        index: usize,
        position: usize,
        arguments: String,
        logprobs: Vec<SampledLogprobs>,
    },
    /// The log-probabilities of prompt `prompt`'s tokens (shared by its
    /// choices): its first token, then every later one given those before.
    PromptLogprobs {
        prompt: usize,
        first: TokenLogprob,
        logprobs: Vec<SampledLogprobs>,
    },
    /// Choice `index` ended; `logprobs` are those not yet attached to a
    /// piece.
    Finish {
        index: usize,
        reason: FinishReason,
        logprobs: Vec<SampledLogprobs>,
        /// The stop string that ended the choice, if one did.
        stop_sequence: Option<String>,
    },
}

/// The merged events of a request's choices.
pub struct Choices {
    streams: Vec<Option<EventStream>>,
    /// Choices per prompt.
    n: usize,
    /// Stream polled first next time, so that none starves the others.
    next_stream: usize,
    /// Per choice: logprobs of tokens whose text has not been sent yet.
    pending: Vec<Vec<SampledLogprobs>>,
    /// Per choice: tool calls seen.
    tool_calls: Vec<usize>,
    finished: Vec<bool>,
    unfinished: usize,
    /// Tool calls kept per choice (1 with `parallel_tool_calls: false`).
    max_tool_calls: usize,
    /// Per prompt: prompt and cached tokens, from its first finished choice.
    prompt_usage: Vec<Option<Usage>>,
    completion_tokens: usize,
}

impl Choices {
    /// The choices of `streams` (one per prompt, in order), `n` per prompt.
    pub fn new(streams: Vec<EventStream>, n: usize, parallel_tool_calls: bool) -> Self {
        let total = streams.len() * n;
        Self {
            prompt_usage: vec![None; streams.len()],
            streams: streams.into_iter().map(Some).collect(),
            n,
            next_stream: 0,
            pending: vec![Vec::new(); total],
            tool_calls: vec![0; total],
            finished: vec![false; total],
            unfinished: total,
            max_tool_calls: if parallel_tool_calls { usize::MAX } else { 1 },
            completion_tokens: 0,
        }
    }

    /// How many choices the answer has.
    pub fn total(&self) -> usize {
        self.finished.len()
    }

    /// The request's token accounting so far: each prompt counted once,
    /// completion tokens summed over every choice.
    pub fn usage(&self) -> Usage {
        let mut usage = Usage {
            completion_tokens: self.completion_tokens,
            ..Usage::default()
        };
        for prompt in self.prompt_usage.iter().flatten() {
            usage.prompt_tokens += prompt.prompt_tokens;
            usage.cached_tokens += prompt.cached_tokens;
        }
        usage
    }

    /// The next piece; `Ok(None)` once every choice has finished.
    pub async fn next(&mut self) -> Result<Option<Piece>, ApiError> {
        while self.unfinished > 0 {
            let Some(event) = self.recv().await else {
                return Err(ApiError::GenerationFailed {
                    kind: FailureKind::Internal,
                    message: "the engine ended the request without finishing it".to_owned(),
                });
            };
            if let Some(piece) = self.piece(event)? {
                return Ok(Some(piece));
            }
        }
        Ok(None)
    }

    /// Turns one event (its index already global) into a piece, if it
    /// makes one.
    fn piece(&mut self, event: GenerationEvent) -> Result<Option<Piece>, ApiError> {
        let index = match &event {
            GenerationEvent::Failed { kind, message } => {
                return Err(ApiError::GenerationFailed {
                    kind: *kind,
                    message: message.clone(),
                })
            }
            // Only embedding requests get one; no completion route
            // submits them.
            GenerationEvent::Embedding { .. } => return Ok(None),
            GenerationEvent::Delta { index, .. }
            | GenerationEvent::PromptLogprobs { index, .. }
            | GenerationEvent::ToolCallStart { index, .. }
            | GenerationEvent::ToolCallArguments { index, .. }
            | GenerationEvent::Finished { index, .. } => *index,
        };
        if self.finished.get(index).copied().unwrap_or(true) {
            tracing::warn!(index, "event for a finished or unknown choice; ignored");
            return Ok(None);
        }
        let piece = match event {
            GenerationEvent::Delta {
                text,
                reasoning,
                logprobs,
                ..
            } => {
                self.pending[index].extend(logprobs);
                if text.is_empty() && reasoning.is_empty() {
                    return Ok(None);
                }
                Piece::Text {
                    index,
                    text,
                    reasoning,
                    logprobs: std::mem::take(&mut self.pending[index]),
                }
            }
            GenerationEvent::PromptLogprobs {
                first, logprobs, ..
            } => Piece::PromptLogprobs {
                prompt: index / self.n,
                first,
                logprobs,
            },
            GenerationEvent::ToolCallStart { id, name, .. } => {
                let position = self.tool_calls[index];
                self.tool_calls[index] += 1;
                if position >= self.max_tool_calls {
                    return Ok(None);
                }
                Piece::ToolCallStart {
                    index,
                    position,
                    id,
                    name,
                    logprobs: std::mem::take(&mut self.pending[index]),
                }
            }
            GenerationEvent::ToolCallArguments { arguments, .. } => {
                let Some(position) = self.tool_calls[index].checked_sub(1) else {
                    tracing::warn!(index, "tool-call arguments before any call; ignored");
                    return Ok(None);
                };
                if position >= self.max_tool_calls {
                    return Ok(None);
                }
                Piece::ToolCallArguments {
                    index,
                    position,
                    arguments,
                    logprobs: std::mem::take(&mut self.pending[index]),
                }
            }
            GenerationEvent::Finished {
                reason,
                usage,
                stop_sequence,
                ..
            } => {
                self.finished[index] = true;
                self.unfinished -= 1;
                self.completion_tokens += usage.completion_tokens;
                self.prompt_usage[index / self.n].get_or_insert(usage);
                Piece::Finish {
                    index,
                    reason,
                    logprobs: std::mem::take(&mut self.pending[index]),
                    stop_sequence,
                }
            }
            GenerationEvent::Failed { .. } | GenerationEvent::Embedding { .. } => return Ok(None),
        };
        Ok(Some(piece))
    }

    /// The next event of any stream, its choice index made global; `None`
    /// when every stream has ended.
    async fn recv(&mut self) -> Option<GenerationEvent> {
        poll_fn(|cx| {
            let count = self.streams.len();
            let mut open = false;
            for k in (0..count).map(|k| (self.next_stream + k) % count) {
                let Some(stream) = &mut self.streams[k] else {
                    continue;
                };
                match stream.poll_recv(cx) {
                    Poll::Ready(Some(event)) => {
                        self.next_stream = (k + 1) % count;
                        return Poll::Ready(Some(globalize(event, k, self.n)));
                    }
                    Poll::Ready(None) => self.streams[k] = None,
                    Poll::Pending => open = true,
                }
            }
            if open {
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        })
        .await
    }
}

/// `event` of prompt `prompt` with its choice index made global; an index
/// of `n` or more (which would alias another prompt's choice) becomes
/// `usize::MAX`, which no choice has.
fn globalize(mut event: GenerationEvent, prompt: usize, n: usize) -> GenerationEvent {
    match &mut event {
        GenerationEvent::Delta { index, .. }
        | GenerationEvent::PromptLogprobs { index, .. }
        | GenerationEvent::ToolCallStart { index, .. }
        | GenerationEvent::ToolCallArguments { index, .. }
        | GenerationEvent::Finished { index, .. } => {
            *index = if *index < n {
                prompt * n + *index
            } else {
                usize::MAX
            };
        }
        GenerationEvent::Failed { .. } | GenerationEvent::Embedding { .. } => {}
    }
    event
}

/// Everything one choice produced, for a non-streamed answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChoiceOutput {
    /// The text, in order.
    pub text: String,
    /// The reasoning (reasoning models), in order; empty when none.
    pub reasoning: String,
    /// Logprobs of every generated token, in order.
    pub logprobs: Vec<SampledLogprobs>,
    /// Tool calls, in order (only the first without parallel tool calls).
    pub tool_calls: Vec<ToolCall>,
    /// The prompt's log-probabilities (requests with prompt logprobs):
    /// its first token, then every later one.
    pub prompt_logprobs: Option<(TokenLogprob, Vec<SampledLogprobs>)>,
    /// Why it ended.
    pub finish_reason: Option<FinishReason>,
    /// The stop string that ended it, if one did.
    pub stop_sequence: Option<String>,
}

/// Reads `choices` to the end. If the client goes away first, the future is
/// dropped with the streams, which cancels the request.
pub async fn collect(choices: &mut Choices) -> Result<Vec<ChoiceOutput>, ApiError> {
    let mut outputs = vec![ChoiceOutput::default(); choices.total()];
    while let Some(piece) = choices.next().await? {
        match piece {
            Piece::Text {
                index,
                text,
                reasoning,
                logprobs,
            } => {
                outputs[index].text.push_str(&text);
                outputs[index].reasoning.push_str(&reasoning);
                outputs[index].logprobs.extend(logprobs);
            }
            Piece::PromptLogprobs {
                prompt,
                first,
                logprobs,
            } => {
                let n = choices.n;
                for output in outputs.iter_mut().skip(prompt * n).take(n) {
                    output.prompt_logprobs = Some((first.clone(), logprobs.clone()));
                }
            }
            Piece::ToolCallStart {
                index,
                id,
                name,
                logprobs,
                ..
            } => {
                outputs[index].tool_calls.push(ToolCall {
                    id,
                    name,
                    arguments: String::new(),
                });
                outputs[index].logprobs.extend(logprobs);
            }
            Piece::ToolCallArguments {
                index,
                arguments,
                logprobs,
                ..
            } => {
                if let Some(call) = outputs[index].tool_calls.last_mut() {
                    call.arguments.push_str(&arguments);
                }
                outputs[index].logprobs.extend(logprobs);
            }
            Piece::Finish {
                index,
                reason,
                logprobs,
                stop_sequence,
            } => {
                outputs[index].finish_reason = Some(reason);
                outputs[index].stop_sequence = stop_sequence;
                outputs[index].logprobs.extend(logprobs);
            }
        }
    }
    Ok(outputs)
}
