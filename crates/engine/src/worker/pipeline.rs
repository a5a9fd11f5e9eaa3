//! Pipelined decode: when every running sequence is a decode row sampled
//! on the device, step n+1 is built from step n's sampled tokens (still on
//! the device) and queued before step n's tokens are read, so building and
//! encoding one step overlaps the device running the other (mlx-lm's
//! `generate_step` does the same; see `docs/performance.md`). The runner
//! queues and reads ([`crate::runner::StepRunner::queue_decode`]); this file
//! decides when.

use mlxcel_model::profile::{self, ProfileMode};
use mlxcel_model::RowInput;

use super::{NextToken, Worker};
use crate::error::StepError;
use crate::runner::{BatchRow, DecodeInput, Pending, StepBatch};
use crate::scheduler::{PlannedRow, StepPlan};

/// A decode step queued on the device whose tokens are not read yet.
pub(super) struct Queued {
    /// The rows' sequence ids, in row order.
    ids: Vec<u64>,
    pending: Pending,
}

/// A stand-in host token for rows whose input comes from the device.
const DEVICE_INPUT: [u32; 1] = [0];

impl Worker<'_> {
    /// Whether pipelining may run for these rows at all: it is on, the
    /// runner can queue, no KV group trims keys its attention would still
    /// see (`--max-kv-size`: that trim must land before the next step
    /// reads; a sliding window's trim keeps the queued steps' keys, which
    /// its layers mask, see [`mlxcel_kv::KvCache::trims_inside_attention`]
    /// and [`mlxcel_kv::KvCache::trim_keeping`]), and (tests only) no
    /// poison token is being injected.
    fn pipeline_allowed(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self.config.fault.poison_token.is_some() {
            return false;
        }
        self.config.pipeline && self.runner.can_queue() && !self.kv.trims_inside_attention()
    }

    /// A plan starts a pipeline when every running sequence is in it as a
    /// decode row (one token, its last known one, sampled on the device),
    /// unless the last pipelined step failed (the next step then runs
    /// synchronously, where a failing row is isolated).
    pub(super) fn starts_pipeline(&self, plan: &StepPlan) -> bool {
        !self.pipeline_paused
            && self.pipeline_allowed()
            && plan.rows.len() == self.running.len()
            && plan.rows.iter().all(|r| {
                let s = &self.running[r.seq];
                r.sample && r.real == 1 && r.padded == 1 && s.samples_on_device()
            })
    }

    /// Queues the next decode step behind `queued` (when every running
    /// sequence is in it and some of its rows will still want a token after
    /// it), then reads `queued`'s tokens and streams them.
    pub(super) fn continue_pipeline(&mut self, queued: Queued) {
        if profile::mode() != ProfileMode::Off {
            profile::begin_step(format!("decode x{} (pipelined)", queued.ids.len()));
        }
        let next = self.chain_after(&queued).and_then(|ids| {
            self.queue_decode(&ids, Some(&queued))
                .map_err(|e| tracing::warn!(error = %e, "queueing a decode step failed"))
                .ok()
        });
        match self.runner.read(&mut self.kv, &queued.pending) {
            Ok(tokens) => {
                let ahead: Vec<u64> = next.as_ref().map(|n| n.ids.clone()).unwrap_or_default();
                profile::region("engine.sample_emit", || {
                    self.emit_queued(&queued, &tokens, &ahead)
                });
                self.inflight = next;
            }
            Err(e) => {
                // The runner rolled both steps back; the sync path reruns
                // the rows and isolates a failing one.
                self.counters.failed_steps += 1;
                tracing::error!(error = %e, rows = queued.ids.len(), "pipelined step failed");
                self.pipeline_paused = true;
                if self.config.check_invariants {
                    self.check_rolled_back(&queued.ids);
                }
            }
        }
    }

    /// Checks the caches of the sequences `ids` after a pipelined read
    /// failed and the runner rolled their queued steps back: each must
    /// end at its computed tokens and hold every key its synchronous rerun
    /// reads. A broken one fails its sequence (tests check invariants).
    fn check_rolled_back(&mut self, ids: &[u64]) {
        for &id in ids {
            let Some(seq) = self.running.iter().position(|s| s.id == id) else {
                continue;
            };
            if let Err(e) = self.check_cache(seq, 0) {
                tracing::error!(error = %e, "a cache after a pipelined rollback");
                self.fail(seq, &e);
            }
        }
    }

    /// The sequences of `queued` that get another pipelined step: all of
    /// them must be every running sequence (nothing else waits to compute),
    /// and a row continues only while the token in flight won't be its last.
    fn chain_after(&self, queued: &Queued) -> Option<Vec<u64>> {
        if !self.pipeline_allowed() || self.running.len() != queued.ids.len() {
            return None;
        }
        let mut ids = Vec::with_capacity(queued.ids.len());
        for &id in &queued.ids {
            let seq = self.running.iter().position(|s| s.id == id)?;
            let s = &self.running[seq];
            if !s.samples_on_device() {
                return None;
            }
            if self.wants_to_speculate(seq) {
                // The next step verifies a draft (synchronously).
                return None;
            }
            if s.usage.completion_tokens + 1 < s.job.request.max_tokens {
                ids.push(id);
            }
        }
        (!ids.is_empty()).then_some(ids)
    }

    /// Queues a greedy decode step of the sequences `ids`, whose inputs are
    /// their last tokens (on the host), or `after`'s sampled tokens (on the
    /// device, not read yet).
    pub(super) fn queue_decode(
        &mut self,
        ids: &[u64],
        after: Option<&Queued>,
    ) -> Result<Queued, StepError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.queue_decode_unguarded(ids, after)
        }))
        .unwrap_or_else(|panic| Err(StepError::from_panic(&*panic)))
    }

    /// [`Worker::queue_decode`] without its panic guard.
    fn queue_decode_unguarded(
        &mut self,
        ids: &[u64],
        after: Option<&Queued>,
    ) -> Result<Queued, StepError> {
        let seqs: Vec<usize> = ids
            .iter()
            .map(|id| self.running.iter().position(|s| s.id == *id))
            .collect::<Option<_>>()
            .ok_or(StepError::Internal("a pipelined sequence is gone"))?;
        let picks: Option<Vec<i32>> = match after {
            Some(q) if q.ids != ids => Some(
                ids.iter()
                    .map(|id| q.ids.iter().position(|x| x == id).map(|p| p as i32))
                    .collect::<Option<Vec<i32>>>()
                    .ok_or(StepError::Internal(
                        "a pipelined row has no token in flight",
                    ))?,
            ),
            _ => None,
        };
        let host_inputs: Vec<[u32; 1]> = seqs
            .iter()
            .map(|&i| match after {
                Some(_) => DEVICE_INPUT,
                None => [self.running[i].tokens.last().copied().unwrap_or(0)],
            })
            .collect();
        let rows = seqs
            .iter()
            .zip(&host_inputs)
            .map(|(&i, t)| BatchRow {
                kv: &self.running[i].kv,
                input: RowInput::Tokens(t),
                real: 1,
                host_logits: 0..0,
                device_argmax: 0..1,
                hidden: 0..0,
            })
            .collect();
        let input = match after {
            None => DecodeInput::Host,
            Some(q) => DecodeInput::Device {
                after: &q.pending,
                picks: picks.as_deref(),
            },
        };
        let pending = self
            .runner
            .queue_decode(&mut self.kv, &StepBatch { rows }, input)?;
        if after.is_some() {
            self.counters.pipelined_steps += 1;
        }
        Ok(Queued {
            ids: ids.to_vec(),
            pending,
        })
    }

    /// Streams the tokens of a pipelined step. Sequences that ended or left
    /// since it was queued are skipped (their positions go with their
    /// blocks); `ahead` holds the sequences with a later step queued.
    fn emit_queued(&mut self, queued: &Queued, tokens: &[u32], ahead: &[u64]) {
        let rows = queued.ids.len();
        self.count(&StepPlan {
            rows: (0..rows)
                .map(|seq| PlannedRow {
                    seq,
                    real: 1,
                    padded: 1,
                    sample: true,
                    draft: 0,
                })
                .collect(),
        });
        let path = self.runner.attention_path();
        self.count_attention_rows(path, rows);
        for (&id, &token) in queued.ids.iter().zip(tokens) {
            let Some(seq) = self.running.iter().position(|s| s.id == id) else {
                continue;
            };
            if self.done.contains(&id) {
                continue;
            }
            self.pass_speculation(seq);
            let reserved_ahead = usize::from(ahead.contains(&id));
            if let Err(e) = self.advance(seq, 1, reserved_ahead) {
                tracing::error!(error = %e, "row failed after its forward");
                self.fail(seq, &e);
                continue;
            }
            // Its blocks up to the computed positions were donated in
            // `advance`; the queued step's position waits for its read.
            self.emit_and_record(seq, NextToken::Sampled(token));
        }
    }
}
