//! Streamed answers: the pieces of a request's choices in, SSE events out
//! (`chat.completion.chunk` or `text_completion` chunks, then `[DONE]`).
//!
//! The stream owns the request's [`Choices`], and with them its event
//! streams; nothing else holds them. When the client goes away, axum drops
//! the response body, the stream and the receivers with it, and the engine
//! sees the request cancelled.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use mlxcel_engine_api::{FinishReason, SampledLogprobs, Usage};
use serde::Serialize;

use crate::choices::{Choices, Piece};
use crate::error::{ApiError, SERIALIZATION_FAILED_BODY};
use crate::openai::chat::{ChatLogprobs, ChunkChoice, ChunkDelta, ToolCallDelta};
use crate::openai::completion::{LegacyLogprobs, TextChoice};
use crate::openai::{Completion, CompletionMeta};

/// How one endpoint shapes pieces into SSE events.
pub trait ChunkFormat: Send + 'static {
    /// The events sent before the first piece.
    fn opening(&mut self) -> Vec<Event>;
    /// The events of `piece`, if it makes any.
    fn piece(&mut self, piece: Piece) -> Vec<Event>;
    /// The usage event after the last finish, if the client asked for one.
    fn usage(&self, usage: Usage) -> Option<Event>;
    /// The events after the last piece: by default the usage event, if
    /// any, then `data: [DONE]`.
    fn closing(&mut self, usage: Usage) -> Vec<Event> {
        let mut events: Vec<Event> = self.usage(usage).into_iter().collect();
        events.push(Event::default().data("[DONE]"));
        events
    }
    /// The last event of a failed stream: by default the OpenAI error body
    /// as data.
    fn failure(&mut self, error: ApiError) -> Event {
        error_event(error)
    }
}

/// The SSE response of `choices`, shaped by `format`.
pub fn stream_response<F: ChunkFormat>(
    choices: Choices,
    mut format: F,
    keep_alive: KeepAlive,
) -> Response {
    let state = SseState {
        queue: format.opening().into(),
        choices,
        format,
        ended: false,
    };
    Sse::new(into_stream(state))
        .keep_alive(keep_alive)
        .into_response()
}

fn into_stream<F: ChunkFormat>(
    state: SseState<F>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    stream::unfold(state, |mut state| async move {
        let event = state.next_event().await?;
        Some((Ok(event), state))
    })
}

struct SseState<F> {
    choices: Choices,
    format: F,
    /// Events ready to send, before anything else is read.
    queue: VecDeque<Event>,
    /// No more pieces: the queue is the rest of the stream.
    ended: bool,
}

impl<F: ChunkFormat> SseState<F> {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some(event);
            }
            if self.ended {
                return None;
            }
            match self.choices.next().await {
                Ok(Some(piece)) => self.queue.extend(self.format.piece(piece)),
                Ok(None) => {
                    self.ended = true;
                    let usage = self.choices.usage();
                    tracing::debug!(?usage, "stream finished");
                    self.queue.extend(self.format.closing(usage));
                }
                Err(error) => {
                    self.ended = true;
                    return Some(self.format.failure(error));
                }
            }
        }
    }
}

/// `chat.completion.chunk`s: a role chunk per choice, then content, tool
/// call and finishing chunks as they come.
///
/// When the request offered tools, a choice's role chunk waits for its
/// first piece: a choice that calls a tool opens with `content: null` and
/// the call, as OpenAI's streams do; one that answers in text opens with
/// `content: ""`, as without tools; one that reasons first opens with
/// `content: null` and its first `reasoning_content`.
pub struct ChatChunks {
    /// Id, time and model of every chunk.
    pub meta: CompletionMeta,
    /// Choices in the answer.
    pub choices: usize,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Per choice: its role chunk was sent. All `false` at first when the
    /// model may call tools (the opening then waits), else all `true`
    /// (`opening` sends every role chunk at once).
    pub opened: Vec<bool>,
}

impl ChatChunks {
    fn event(
        &self,
        index: usize,
        delta: ChunkDelta,
        logprobs: &[SampledLogprobs],
        finish_reason: Option<FinishReason>,
    ) -> Event {
        let choice = ChunkChoice {
            index,
            delta,
            logprobs: ChatLogprobs::non_empty(logprobs),
            finish_reason,
        };
        json_event(&Completion::chunk(
            &self.meta,
            vec![choice],
            self.include_usage,
        ))
    }

    /// The role chunk of choice `index`: `content: ""`, or `null` when it
    /// opens with a tool call (and then carries `call`).
    fn role_delta(call: Option<ToolCallDelta>) -> ChunkDelta {
        ChunkDelta {
            role: Some("assistant"),
            content: Some(if call.is_some() {
                None
            } else {
                Some(String::new())
            }),
            tool_calls: call.map(|c| vec![c]),
            reasoning_content: None,
        }
    }

    /// Marks choice `index` opened; true when it was not yet.
    fn open(&mut self, index: usize) -> bool {
        match self.opened.get_mut(index) {
            Some(opened) if !*opened => {
                *opened = true;
                true
            }
            _ => false,
        }
    }
}

impl ChunkFormat for ChatChunks {
    fn opening(&mut self) -> Vec<Event> {
        (0..self.choices)
            .filter(|&index| self.opened.get(index).copied().unwrap_or(true))
            .map(|index| self.event(index, Self::role_delta(None), &[], None))
            .collect()
    }

    fn piece(&mut self, piece: Piece) -> Vec<Event> {
        let (index, delta, logprobs, reason) = match piece {
            Piece::Text {
                index,
                text,
                reasoning,
                logprobs,
            } => {
                if text.is_empty() && self.open(index) {
                    // Reasoning opens a message whose content is not known
                    // yet (a tool call may follow): `content: null`.
                    let delta = ChunkDelta {
                        content: Some(None),
                        reasoning_content: Some(reasoning),
                        ..Self::role_delta(None)
                    };
                    return vec![self.event(index, delta, &logprobs, None)];
                }
                let delta = ChunkDelta {
                    content: (!text.is_empty()).then_some(Some(text)),
                    reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
                    ..ChunkDelta::default()
                };
                (index, delta, logprobs, None)
            }
            Piece::ToolCallStart {
                index,
                position,
                id,
                name,
                logprobs,
            } => {
                let call = ToolCallDelta::start(position, id, name);
                if self.open(index) {
                    // The call opens the message.
                    let delta = Self::role_delta(Some(call));
                    return vec![self.event(index, delta, &logprobs, None)];
                }
                let delta = ChunkDelta {
                    tool_calls: Some(vec![call]),
                    ..ChunkDelta::default()
                };
                (index, delta, logprobs, None)
            }
            Piece::ToolCallArguments {
                index,
                position,
                arguments,
                logprobs,
            } => {
                let delta = ChunkDelta {
                    tool_calls: Some(vec![ToolCallDelta::arguments(position, arguments)]),
                    ..ChunkDelta::default()
                };
                (index, delta, logprobs, None)
            }
            Piece::Finish {
                index,
                reason,
                logprobs,
                ..
            } => (index, ChunkDelta::default(), logprobs, Some(reason)),
            // Chat requests never ask for the prompt's logprobs.
            Piece::PromptLogprobs { .. } => return Vec::new(),
        };
        let mut events = Vec::with_capacity(2);
        if self.open(index) {
            events.push(self.event(index, Self::role_delta(None), &[], None));
        }
        events.push(self.event(index, delta, &logprobs, reason));
        events
    }

    fn usage(&self, usage: Usage) -> Option<Event> {
        self.include_usage
            .then(|| json_event(&Completion::<ChunkChoice>::usage_chunk(&self.meta, usage)))
    }
}

/// `text_completion` chunks: with `echo`, each choice's prompt first, then
/// text and finishing chunks as they come. With `echo` and `logprobs` the
/// prompt's chunk waits for the prompt's logprobs (sent once its prefill is
/// done) and carries them.
pub struct TextChunks {
    /// Id, time and model of every chunk.
    meta: CompletionMeta,
    include_usage: bool,
    /// Per prompt: its text when echoed, else empty.
    echoes: Vec<String>,
    /// Choices per prompt.
    n: usize,
    /// Per choice: characters of its text so far (for `text_offset`).
    offsets: Vec<usize>,
    /// The echo chunks wait for the prompt's logprobs.
    echo_logprobs: bool,
}

impl TextChunks {
    /// The chunks of an answer to `echoes.len()` prompts with `n` choices
    /// each; `echoes[p]` is prompt `p`'s text, or empty without `echo`;
    /// `logprobs`: the request asked for logprobs (with `echo`, the
    /// prompt's too).
    pub fn new(
        meta: CompletionMeta,
        echoes: Vec<String>,
        n: usize,
        include_usage: bool,
        logprobs: bool,
    ) -> Self {
        let offsets = (0..echoes.len() * n)
            .map(|index| echoes[index / n].chars().count())
            .collect();
        let echo_logprobs = logprobs && echoes.iter().any(|e| !e.is_empty());
        Self {
            meta,
            include_usage,
            echoes,
            n,
            offsets,
            echo_logprobs,
        }
    }

    fn event(&self, choice: TextChoice) -> Event {
        json_event(&Completion::chunk(
            &self.meta,
            vec![choice],
            self.include_usage,
        ))
    }

    fn logprobs(&mut self, index: usize, logprobs: &[SampledLogprobs]) -> Option<LegacyLogprobs> {
        (!logprobs.is_empty()).then(|| LegacyLogprobs::new(logprobs, &mut self.offsets[index]))
    }
}

impl ChunkFormat for TextChunks {
    fn opening(&mut self) -> Vec<Event> {
        if self.echo_logprobs {
            return Vec::new();
        }
        (0..self.offsets.len())
            .filter(|index| !self.echoes[index / self.n].is_empty())
            .map(|index| {
                self.event(TextChoice {
                    index,
                    text: self.echoes[index / self.n].clone(),
                    logprobs: None,
                    finish_reason: None,
                })
            })
            .collect()
    }

    fn piece(&mut self, piece: Piece) -> Vec<Event> {
        let choice = match piece {
            Piece::Text {
                index,
                text,
                logprobs,
                ..
            } => TextChoice {
                index,
                text,
                logprobs: self.logprobs(index, &logprobs),
                finish_reason: None,
            },
            Piece::Finish {
                index,
                reason,
                logprobs,
                ..
            } => TextChoice {
                index,
                text: String::new(),
                logprobs: self.logprobs(index, &logprobs),
                finish_reason: Some(reason),
            },
            Piece::PromptLogprobs {
                prompt,
                first,
                logprobs,
            } => {
                if !self.echo_logprobs {
                    return Vec::new();
                }
                let echo = self.echoes.get(prompt).cloned().unwrap_or_default();
                let entries = LegacyLogprobs::prompt(&first, &logprobs);
                return (prompt * self.n..(prompt + 1) * self.n)
                    .map(|index| {
                        self.event(TextChoice {
                            index,
                            text: echo.clone(),
                            logprobs: Some(entries.clone()),
                            finish_reason: None,
                        })
                    })
                    .collect();
            }
            Piece::ToolCallStart { index, .. } | Piece::ToolCallArguments { index, .. } => {
                // Completions carry no tools; an engine that parsed a call
                // anyway has nowhere to put it.
                tracing::warn!(index, "tool call on a text completion; dropped");
                return Vec::new();
            }
        };
        vec![self.event(choice)]
    }

    fn usage(&self, usage: Usage) -> Option<Event> {
        self.include_usage
            .then(|| json_event(&Completion::<TextChoice>::usage_chunk(&self.meta, usage)))
    }
}

/// The last event of a failed stream: the OpenAI error body as data.
fn error_event(error: ApiError) -> Event {
    tracing::error!(error = %error, "stream failed");
    json_event(&error.body())
}

pub(crate) fn json_event<T: Serialize>(value: &T) -> Event {
    Event::default().json_data(value).unwrap_or_else(|err| {
        // Serializing these plain structs cannot fail; if it ever does, the
        // client still gets an error body instead of a truncated stream.
        tracing::error!(error = %err, "could not serialize an SSE event");
        Event::default().data(SERIALIZATION_FAILED_BODY)
    })
}
