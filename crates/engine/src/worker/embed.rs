//! Embedding requests: a prompt prefilled like any other, batched with
//! the step's other rows, whose rows ask the runner for final hidden
//! states instead of logits (`BatchRow::hidden`). Mean pooling sums every
//! position's state chunk by chunk (its prompt skips the prefix cache:
//! cached tokens have no states); last-token pooling keeps the last
//! position's (a prefix-cache hit recomputes at least the last token, so
//! it reads the cache like any prompt). When the prompt's last chunk has
//! run, the pooled vector is L2-normalised and sent as one `Embedding`
//! event, and the request ends (its blocks are donated as usual).

use std::ops::Range;

use mlxcel_model::pooling::Pooling;

use super::{Sequence, Worker};
use crate::api::GenerationEvent;
use crate::error::StepError;
use crate::runner::StepOutput;
use crate::scheduler::{PlannedRow, StepPlan};

impl Sequence {
    /// The positions of a planned row whose final hidden states come back:
    /// every one for mean pooling, the prompt's last for last-token
    /// pooling, none for a request that is not an embedding.
    pub(super) fn hidden_wanted(&self, row: &PlannedRow) -> Range<usize> {
        match self.job.embedding {
            None => 0..0,
            Some(Pooling::Mean) => 0..row.real,
            Some(Pooling::LastToken) if row.sample => row.real - 1..row.real,
            Some(Pooling::LastToken) => 0..0,
        }
    }
}

impl Worker<'_> {
    /// Folds each embedding row's hidden states into its sequence's pooled
    /// vector (a sum for mean pooling, the last state for last-token).
    pub(super) fn pool_hidden(&mut self, plan: &StepPlan, output: &StepOutput) {
        for (r, out) in plan.rows.iter().zip(&output.rows) {
            let s = &mut self.running[r.seq];
            let Some(pooling) = s.job.embedding else {
                continue;
            };
            let positions = s.hidden_wanted(r).len();
            let Some(width) = out.hidden.len().checked_div(positions) else {
                continue;
            };
            for state in out.hidden.chunks_exact(width.max(1)) {
                match pooling {
                    Pooling::LastToken => s.pooled = state.to_vec(),
                    Pooling::Mean if s.pooled.is_empty() => s.pooled = state.to_vec(),
                    Pooling::Mean => {
                        for (p, x) in s.pooled.iter_mut().zip(state) {
                            *p += x;
                        }
                    }
                }
            }
        }
    }

    /// Ends embedding sequence `seq`, its prompt computed: its pooled
    /// vector (a mean divided by the prompt's length), L2-normalised, goes
    /// out as the request's one `Embedding` event.
    pub(super) fn emit_embedding(&mut self, seq: usize) {
        let s = &mut self.running[seq];
        let mut vector = std::mem::take(&mut s.pooled);
        if vector.is_empty() {
            self.fail(
                seq,
                &StepError::Internal("no hidden state for an embedding"),
            );
            return;
        }
        if s.job.embedding == Some(Pooling::Mean) {
            let n = s.job.prompt.len() as f32;
            vector.iter_mut().for_each(|x| *x /= n);
        }
        normalize(&mut vector);
        let _ = s.job.events.send(GenerationEvent::Embedding {
            vector,
            usage: s.usage,
        });
        self.done.push(s.id);
    }
}

/// Scales `v` to unit L2 norm (a zero vector stays zero).
pub(crate) fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|x| f64::from(*x) * f64::from(*x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        v.iter_mut()
            .for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::normalize;

    #[test]
    fn vectors_are_scaled_to_unit_length() {
        let mut v = [3.0, 4.0];
        normalize(&mut v);
        assert_eq!(v, [0.6, 0.8]);
        let mut zero = [0.0f32; 3];
        normalize(&mut zero);
        assert_eq!(zero, [0.0; 3]);
    }
}
