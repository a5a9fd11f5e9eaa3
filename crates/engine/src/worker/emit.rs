//! Sampling and streaming: each sampling row's next token becomes a delta
//! (or the choice's end) on its stream.
//!
//! Per choice and position: logit bias and penalties
//! ([`crate::logits`]), the grammar mask ([`mlxcel_text::constraint`]), the
//! log-probabilities, the sampler; then the token's text goes through the
//! detokenizer and the output filter ([`mlxcel_text::output`]: stop strings,
//! tool calls) before it is sent.

use std::borrow::Cow;
use std::time::Instant;

use mlxcel_text::output::OutputPiece;

use super::{Emitted, NextToken, Worker};

/// A sampled token not streamed yet ([`Worker::pick`]).
#[derive(Debug, Clone)]
pub(super) struct Picked {
    pub(super) token: u32,
    /// Its log-probability and the top alternatives (requests with
    /// `logprobs`, tokens sampled on the host).
    pub(super) logprobs: Option<SampledLogprobs>,
    /// It ends the choice as an end-of-generation token.
    pub(super) is_eos: bool,
    /// The grammar is complete after it.
    pub(super) grammar_done: bool,
}
use crate::api::{FinishReason, GenerationEvent, SampledLogprobs};
use crate::error::StepError;
use crate::logits::log_probs;
use crate::runner::{RowOutput, StepOutput};
use crate::scheduler::StepPlan;

impl RowOutput {
    /// A sampling row's next token: its last device token, or its last
    /// host logits row.
    fn next_token(&self) -> Option<NextToken<'_>> {
        match self.tokens.last() {
            Some(&t) => Some(NextToken::Sampled(t)),
            None => self
                .logits_row(self.logits_rows().checked_sub(1)?)
                .map(NextToken::Logits),
        }
    }
}

impl Worker<'_> {
    /// Streams each sampling row's next token (sampled on the device, or
    /// sampled here from its logits row); forks the other choices of a
    /// request whose prompt was just computed; finishes and removes
    /// sequences that are done or whose client left.
    pub(super) fn sample_and_emit(&mut self, plan: &StepPlan, output: &StepOutput) {
        for (r, out) in plan.rows.iter().zip(&output.rows) {
            if !r.sample {
                continue;
            }
            let seq = r.seq;
            if self.done.contains(&self.running[seq].id) {
                continue;
            }
            if r.draft > 0 {
                self.emit_verified(seq);
                continue;
            }
            if self.running[seq].job.embedding.is_some() {
                self.emit_embedding(seq);
                continue;
            }
            let Some(next) = out.next_token() else {
                self.fail(seq, &StepError::Internal("no sample for a sampling row"));
                continue;
            };
            let mut choices = vec![seq];
            if !self.running[seq].forks.is_empty() {
                match self.fork_choices(seq) {
                    Ok(forked) => choices.extend(forked),
                    Err(e) => {
                        self.fail(seq, &e);
                        continue;
                    }
                }
            }
            for seq in choices {
                self.emit_and_record(seq, next);
            }
        }
    }

    /// [`Worker::emit`], then the sequence's end is recorded.
    pub(super) fn emit_and_record(&mut self, seq: usize, next: NextToken<'_>) {
        match self.emit(seq, next) {
            Ok(Emitted::Continue) => {}
            Ok(Emitted::Finished | Emitted::Cancelled) => self.done.push(self.running[seq].id),
            Err(e) => self.fail(seq, &e),
        }
    }

    /// Samples sequence `seq`'s next token and streams it ([`Worker::pick`]
    /// then [`Worker::emit_picked`]).
    pub(super) fn emit(&mut self, seq: usize, next: NextToken<'_>) -> Result<Emitted, StepError> {
        let picked = self.pick(seq, next)?;
        self.emit_picked(seq, picked)
    }

    /// Sequence `seq`'s next token: taken as sampled on the device, or
    /// sampled here from its logits row after its logit processors and
    /// grammar mask, with its log-probabilities when the request wants
    /// them. The token is recorded in the processors (penalties) and the
    /// grammar, so the next pick sees it; it is not streamed yet.
    ///
    /// # Errors
    /// The grammar failing to mask or to accept the token.
    pub(super) fn pick(&mut self, seq: usize, next: NextToken<'_>) -> Result<Picked, StepError> {
        let text = self.text;
        let s = &mut self.running[seq];
        let _enter = s.span.enter();
        let (token, logprobs) = match next {
            // Only rows with nothing to do on the host are sampled there
            // (`Sequence::samples_on_device`).
            NextToken::Sampled(token) => (token, None),
            NextToken::Logits(logits) => {
                let logits: Cow<'_, [f32]> = if s.processor.is_noop() && s.constraint.is_none() {
                    Cow::Borrowed(logits)
                } else {
                    let mut owned = logits.to_vec();
                    s.processor.apply(&mut owned);
                    if let Some(c) = &mut s.constraint {
                        c.mask_logits(&mut owned)?;
                    }
                    Cow::Owned(owned)
                };
                let token = s.sampler.sample(&logits);
                let logprobs = s.job.request.logprobs.map(|k| {
                    let (logprob, top) = log_probs(&logits, token, k);
                    SampledLogprobs {
                        token: text.token_logprob(token, logprob),
                        top: top
                            .into_iter()
                            .map(|(id, lp)| text.token_logprob(id, lp))
                            .collect(),
                    }
                });
                (token, logprobs)
            }
        };
        s.processor.record(token);
        let grammar_done = match &mut s.constraint {
            Some(c) => {
                c.accept(token)?;
                c.is_finished()
            }
            None => false,
        };
        let is_eos = !s.job.request.ignore_eos
            && (text.eos.contains(&token) || s.job.stop_ids.contains(&token));
        Ok(Picked {
            token,
            logprobs,
            is_eos,
            grammar_done,
        })
    }

    /// Streams a picked token of sequence `seq`: its text through the
    /// detokenizer and the output filter (stop strings, tool calls), and
    /// the choice's end when the token ends it (EOS, the grammar's end,
    /// `max_tokens`, a stop string).
    ///
    /// # Errors
    /// The detokenizer failing on the token.
    pub(super) fn emit_picked(&mut self, seq: usize, picked: Picked) -> Result<Emitted, StepError> {
        let Picked {
            token,
            logprobs,
            is_eos,
            grammar_done,
        } = picked;
        let text = self.text;
        let s = &mut self.running[seq];
        let _enter = s.span.enter();
        s.tokens.push(token);
        s.usage.completion_tokens += 1;
        let now = Instant::now();
        if s.first_token_at.is_none() {
            s.first_token_at = Some(now);
            s.timings.time_to_first_token_s = (now - s.job.submitted).as_secs_f64();
        }
        let mut finish = if is_eos || grammar_done {
            Some(FinishReason::Stop)
        } else if s.usage.completion_tokens >= s.job.request.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        // The EOS token is not text; on the last token, whatever the
        // detokenizer held back goes out with it.
        let tokenizer = &text.tokenizer;
        let mut piece = if is_eos {
            String::new()
        } else if s.filter.reads_marker(tokenizer, token) {
            // A tool-call marker the filter reads: the text before it goes
            // first (a run of byte tokens is not held past it).
            s.detok.push_marker(tokenizer, token)?
        } else {
            s.detok.push(tokenizer, token)?
        };
        if finish.is_some() {
            piece.push_str(&s.detok.flush(tokenizer)?);
        }
        let mut out = s.filter.push(&piece);
        // A harmony reply's markers are special tokens: its filter reads
        // them apart from the text (the detokenizer skips them).
        if !is_eos && !out.stopped {
            out.extend(s.filter.push_special_token(tokenizer, token));
        }
        if out.stopped {
            finish = Some(FinishReason::Stop);
        } else if finish.is_some() {
            out.extend(s.filter.finish());
        }
        let index = s.index;
        let text = out.text();
        let reasoning = out.reasoning();
        let send_delta = !is_eos || !text.is_empty() || !reasoning.is_empty();
        let delta = GenerationEvent::Delta {
            index,
            token,
            text,
            reasoning,
            logprobs: if is_eos { None } else { logprobs },
        };
        let mut sent = !send_delta || s.job.events.send(delta).is_ok();
        for piece in out.pieces {
            let event = match piece {
                OutputPiece::Text(_) | OutputPiece::Reasoning(_) => continue,
                OutputPiece::CallStart { id, name } => {
                    GenerationEvent::ToolCallStart { index, id, name }
                }
                OutputPiece::CallArguments(arguments) => {
                    GenerationEvent::ToolCallArguments { index, arguments }
                }
            };
            sent &= s.job.events.send(event).is_ok();
        }
        if !sent {
            tracing::info!("client went away; request cancelled");
            return Ok(Emitted::Cancelled);
        }
        let Some(mut reason) = finish else {
            return Ok(Emitted::Continue);
        };
        if reason == FinishReason::Stop && s.filter.tool_calls() > 0 {
            reason = FinishReason::ToolCalls;
        }
        if let Some(t0) = s.first_token_at {
            s.timings.decode_s = t0.elapsed().as_secs_f64();
        }
        tracing::info!(
            choice = index,
            completion_tokens = s.usage.completion_tokens,
            ?reason,
            ttft_s = s.timings.time_to_first_token_s,
            "choice finished"
        );
        let stop_sequence = if reason == FinishReason::Stop {
            s.filter.stop_sequence().map(str::to_owned)
        } else {
            None
        };
        let _ = s.job.events.send(GenerationEvent::Finished {
            index,
            reason,
            usage: s.usage,
            timings: s.timings,
            stop_sequence,
        });
        Ok(Emitted::Finished)
    }
}
