//! Sampling and streaming: each sampling row's next token becomes a delta
//! (or the request's end) on its stream.

use std::time::Instant;

use super::{Emitted, Worker};
use crate::api::{FinishReason, GenerationEvent};
use crate::scheduler::StepPlan;

impl Worker<'_> {
    /// Samples each sampling row's next token and streams it; finishes and
    /// removes sequences that are done or whose client left.
    pub(super) fn sample_and_emit(&mut self, plan: &StepPlan, logits: &[f32]) {
        let sampling: Vec<usize> = plan
            .rows
            .iter()
            .filter(|r| r.sample)
            .map(|r| r.seq)
            .collect();
        if sampling.is_empty() {
            return;
        }
        let vocab = logits.len() / sampling.len();
        for (i, &seq) in sampling.iter().enumerate() {
            if self.done.contains(&self.running[seq].id) {
                continue;
            }
            let row = &logits[i * vocab..(i + 1) * vocab];
            match self.emit(seq, row) {
                Ok(Emitted::Continue) => {}
                Ok(Emitted::Finished | Emitted::Cancelled) => self.done.push(self.running[seq].id),
                Err(message) => self.fail(seq, &message),
            }
        }
    }

    fn emit(&mut self, seq: usize, logits: &[f32]) -> Result<Emitted, String> {
        let eos = &self.text.eos;
        let tokenizer = &self.text.tokenizer;
        let s = &mut self.running[seq];
        let _enter = s.span.enter();
        let token = s.sampler.sample(logits);
        s.tokens.push(token);
        s.usage.completion_tokens += 1;
        let now = Instant::now();
        if s.first_token_at.is_none() {
            s.first_token_at = Some(now);
            s.timings.time_to_first_token_s = (now - s.job.submitted).as_secs_f64();
        }
        let is_eos = !s.job.request.ignore_eos && eos.contains(&token);
        let finish = if is_eos {
            Some(FinishReason::Stop)
        } else if s.usage.completion_tokens >= s.job.request.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        // The EOS token is not text; on the last token, whatever the
        // detokenizer held back goes out with it.
        let mut delta = if is_eos {
            String::new()
        } else {
            s.detok.push(tokenizer, token).map_err(|e| e.to_string())?
        };
        if finish.is_some() {
            delta.push_str(&s.detok.flush(tokenizer).map_err(|e| e.to_string())?);
        }
        let event = GenerationEvent::Delta { token, text: delta };
        if (!is_eos || matches!(&event, GenerationEvent::Delta { text, .. } if !text.is_empty()))
            && s.job.events.send(event).is_err()
        {
            tracing::info!("client went away; request cancelled");
            return Ok(Emitted::Cancelled);
        }
        let Some(reason) = finish else {
            return Ok(Emitted::Continue);
        };
        if let Some(t0) = s.first_token_at {
            s.timings.decode_s = t0.elapsed().as_secs_f64();
        }
        tracing::info!(
            completion_tokens = s.usage.completion_tokens,
            ?reason,
            ttft_s = s.timings.time_to_first_token_s,
            "request finished"
        );
        let _ = s.job.events.send(GenerationEvent::Finished {
            reason,
            usage: s.usage,
            timings: s.timings,
        });
        Ok(Emitted::Finished)
    }
}
