//! Pipelined decode: when every running sequence is a decode row sampled
//! on the device, step n+1 is built from step n's sampled tokens (still on
//! the device) and queued before step n's tokens are read, so building and
//! encoding one step overlaps the device running the other (mlx-lm's
//! `generate_step` does the same; see `docs/performance.md`). The runner
//! queues and reads ([`crate::runner::StepRunner::queue_decode`]); this file
//! decides when.
//!
//! With `--pipelined-verification` (`WorkerConfig::pipelined_verification`;
//! otherwise a chain stops where a row's tokens end in a recurring n-gram,
//! [`Worker::ends_chain`]), prompt lookup verifies inside the pipeline: a
//! row of step n+1 may be a
//! verification row whose first token is step n's token still in flight
//! and whose draft is looked up as if step n kept all its drafts and its
//! token in flight were the one the lookup predicts
//! ([`Worker::guess_draft`]). A wrong guess of the token in flight only
//! makes a draft the model rejects (the row still gets the model's token
//! after its first one, as a decode row would). A verification in step n
//! that rejects a draft makes step n+1's input wrong for that row: step
//! n+1 is then discarded unread (its positions rolled back,
//! [`crate::runner::StepRunner::discard`]) and the next step runs from the
//! tokens read.

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
    /// Each row's draft: empty for a decode row (one token), else the
    /// tokens a verification row (`1 + draft` tokens) checks after its
    /// first one.
    drafts: Vec<Vec<u32>>,
    /// Each verification row's guess of its first token (the token in
    /// flight when it was queued), `None` when that token was known.
    guesses: Vec<Option<u32>>,
    pending: Pending,
}

impl Queued {
    /// Tokens of row `i` in the step (and greedy tokens read back for it).
    fn len(&self, i: usize) -> usize {
        1 + self.drafts[i].len()
    }

    /// Where each row's tokens start among the step's packed tokens.
    fn offsets(&self) -> Vec<usize> {
        (0..self.ids.len())
            .scan(0, |at, i| {
                let start = *at;
                *at += self.len(i);
                Some(start)
            })
            .collect()
    }

    /// Tokens of the whole step.
    fn total(&self) -> usize {
        (0..self.ids.len()).map(|i| self.len(i)).sum()
    }
}

/// A row of a step to queue.
pub(super) struct ChainRow {
    /// The sequence.
    id: u64,
    /// The draft it verifies (empty: a decode row).
    draft: Vec<u32>,
    /// The token the draft was looked up after, when the row's first
    /// token is still in flight ([`Worker::guess_draft`]).
    guess: Option<u32>,
}

/// A stand-in host token for a row's first input when it comes from the
/// device.
const DEVICE_INPUT: u32 = 0;

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
    /// decode or verification row (its last known token and any draft,
    /// sampled on the device), unless the last pipelined step failed (the
    /// next step then runs synchronously, where a failing row is
    /// isolated).
    pub(super) fn starts_pipeline(&self, plan: &StepPlan) -> bool {
        !self.pipeline_paused
            && self.pipeline_allowed()
            && plan.rows.len() == self.running.len()
            && plan.rows.iter().all(|r| {
                let s = &self.running[r.seq];
                r.sample
                    && (r.draft == 0 || self.config.pipelined_verification)
                    && r.real == 1 + r.draft
                    && r.padded == r.real
                    && s.draft.len() == r.draft
                    && s.computed + 1 == s.tokens.len()
                    && s.samples_on_device()
            })
    }

    /// The rows of a plan that [`Worker::starts_pipeline`] accepted, as a
    /// step to queue: each sequence with the draft it verifies.
    pub(super) fn pipeline_rows(&self, plan: &StepPlan) -> Vec<ChainRow> {
        plan.rows
            .iter()
            .map(|r| {
                let s = &self.running[r.seq];
                ChainRow {
                    id: s.id,
                    draft: s.draft[..r.draft].to_vec(),
                    guess: None,
                }
            })
            .collect()
    }

    /// Queues the next step behind `queued` (when every running sequence
    /// is in it and some of its rows will still want a token after it),
    /// then reads `queued`'s tokens, discards the next step if a
    /// verification in `queued` proved it wrong, and streams the tokens.
    pub(super) fn continue_pipeline(&mut self, queued: Queued) {
        if profile::mode() != ProfileMode::Off {
            profile::begin_step(format!("decode x{} (pipelined)", queued.ids.len()));
        }
        let next = self.chain_after(&queued).and_then(|rows| {
            self.queue_decode(&rows, Some(&queued))
                .map_err(|e| tracing::warn!(error = %e, "queueing a decode step failed"))
                .ok()
        });
        match self.runner.read(&mut self.kv, &queued.pending) {
            Ok(tokens) if tokens.len() == queued.total() => {
                let next = match next {
                    Some(n) if !guesses_hold(&queued, &tokens, &n) => {
                        self.discard(n);
                        None
                    }
                    n => n,
                };
                let ahead: Vec<(u64, usize)> = next
                    .as_ref()
                    .map(|n| {
                        n.ids
                            .iter()
                            .enumerate()
                            .map(|(i, &id)| (id, n.len(i)))
                            .collect()
                    })
                    .unwrap_or_default();
                profile::region("engine.sample_emit", || {
                    self.emit_queued(&queued, &tokens, &ahead)
                });
                self.inflight = next;
            }
            Ok(tokens) => {
                // Not expected: the step's rows fail, the engine goes on.
                tracing::error!(
                    got = tokens.len(),
                    want = queued.total(),
                    "a pipelined step read back the wrong number of tokens"
                );
                if let Some(n) = next {
                    self.discard(n);
                }
                let e = StepError::Internal("a pipelined step's tokens");
                for &id in &queued.ids {
                    if let Some(seq) = self.running.iter().position(|s| s.id == id) {
                        self.fail(seq, &e);
                    }
                }
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

    /// Rolls back a queued step that will not be read, keeping its
    /// device work in `retired` until the next step has been built (the
    /// engine does not wait for it in between); a rollback that fails
    /// fails the step's rows.
    fn discard(&mut self, step: Queued) {
        self.counters.discarded_steps += 1;
        let Queued { ids, pending, .. } = step;
        if let Err(e) = self.runner.discard(&mut self.kv, &pending) {
            tracing::error!(error = %e, "rolling back a discarded pipelined step");
            for id in ids {
                if let Some(seq) = self.running.iter().position(|s| s.id == id) {
                    self.fail(seq, &e);
                }
            }
        }
        self.retired = Some(pending);
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

    /// The rows of the step to queue behind `queued`: all of them must be
    /// every running sequence (nothing else waits to compute), and a row
    /// continues only while the tokens in flight won't reach its
    /// `max_tokens`. Each row assumes `queued` keeps its whole draft; with
    /// prompt lookup it verifies the draft [`Worker::guess_draft`] finds.
    /// A row may end the chain ([`Worker::ends_chain`]).
    fn chain_after(&self, queued: &Queued) -> Option<Vec<ChainRow>> {
        if !self.pipeline_allowed() || self.running.len() != queued.ids.len() {
            return None;
        }
        let guesses = self.config.pipelined_verification
            && queued.ids.len() <= self.config.speculative.max_rows;
        let mut rows = Vec::with_capacity(queued.ids.len());
        for (i, &id) in queued.ids.iter().enumerate() {
            let seq = self.running.iter().position(|s| s.id == id)?;
            let s = &self.running[seq];
            if !s.samples_on_device() || self.ends_chain(seq) {
                return None;
            }
            let emitted = s.usage.completion_tokens + queued.len(i);
            let max = s.job.request.max_tokens;
            if emitted >= max {
                continue;
            }
            let (guess, draft) = if guesses {
                self.guess_draft(seq, &queued.drafts[i], max - emitted)
            } else {
                (None, Vec::new())
            };
            rows.push(ChainRow { id, draft, guess });
        }
        // Decode rows before verification rows (as a planned step has
        // them), each kind in the order it had.
        rows.sort_by_key(|r| !r.draft.is_empty());
        (!rows.is_empty()).then_some(rows)
    }

    /// Queues a greedy step of `rows` (decode rows and verification rows),
    /// whose first inputs are their last tokens (on the host), or
    /// `after`'s sampled tokens at each row's last position (on the
    /// device, not read yet).
    pub(super) fn queue_decode(
        &mut self,
        rows: &[ChainRow],
        after: Option<&Queued>,
    ) -> Result<Queued, StepError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.queue_decode_unguarded(rows, after)
        }))
        .unwrap_or_else(|panic| Err(StepError::from_panic(&*panic)))
    }

    /// [`Worker::queue_decode`] without its panic guard.
    fn queue_decode_unguarded(
        &mut self,
        rows: &[ChainRow],
        after: Option<&Queued>,
    ) -> Result<Queued, StepError> {
        let seqs: Vec<usize> = rows
            .iter()
            .map(|r| self.running.iter().position(|s| s.id == r.id))
            .collect::<Option<_>>()
            .ok_or(StepError::Internal("a pipelined sequence is gone"))?;
        let ids: Vec<u64> = rows.iter().map(|r| r.id).collect();
        let picks: Option<Vec<i32>> = match after {
            Some(q) if q.ids != ids || q.drafts.iter().any(|d| !d.is_empty()) => {
                let offsets = q.offsets();
                Some(
                    ids.iter()
                        .map(|id| {
                            let j = q.ids.iter().position(|x| x == id)?;
                            Some((offsets[j] + q.len(j) - 1) as i32)
                        })
                        .collect::<Option<Vec<i32>>>()
                        .ok_or(StepError::Internal(
                            "a pipelined row has no token in flight",
                        ))?,
                )
            }
            _ => None,
        };
        let inputs: Vec<Vec<u32>> = seqs
            .iter()
            .zip(rows)
            .map(|(&i, r)| {
                let first = match after {
                    Some(_) => DEVICE_INPUT,
                    None => self.running[i].tokens.last().copied().unwrap_or(0),
                };
                std::iter::once(first)
                    .chain(r.draft.iter().copied())
                    .collect()
            })
            .collect();
        let batch_rows = seqs
            .iter()
            .zip(&inputs)
            .map(|(&i, t)| BatchRow {
                kv: &self.running[i].kv,
                input: RowInput::Tokens(t),
                real: t.len(),
                host_logits: 0..0,
                device_argmax: 0..t.len(),
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
        let pending =
            self.runner
                .queue_decode(&mut self.kv, &StepBatch { rows: batch_rows }, input)?;
        if after.is_some() {
            self.counters.pipelined_steps += 1;
        }
        let drafts: Vec<Vec<u32>> = rows.iter().map(|r| r.draft.clone()).collect();
        if drafts.iter().any(|d| !d.is_empty()) {
            self.counters.pipelined_verify_steps += 1;
        }
        Ok(Queued {
            ids,
            drafts,
            guesses: rows.iter().map(|r| r.guess).collect(),
            pending,
        })
    }

    /// Streams the tokens of a pipelined step: a decode row's token, or a
    /// verification row's picks ([`Worker::emit_pipelined_verification`]).
    /// Sequences that ended or left since it was queued are skipped (their
    /// positions go with their blocks); `ahead` holds the sequences with a
    /// later step queued and that step's tokens for each.
    fn emit_queued(&mut self, queued: &Queued, tokens: &[u32], ahead: &[(u64, usize)]) {
        let rows = queued.ids.len();
        let mut planned: Vec<PlannedRow> = (0..rows)
            .map(|i| PlannedRow {
                seq: i,
                real: queued.len(i),
                padded: queued.len(i),
                sample: true,
                draft: queued.drafts[i].len(),
            })
            .collect();
        planned.sort_by_key(|r| r.draft > 0);
        let plan = StepPlan { rows: planned };
        self.count(&plan);
        let path = self.runner.attention_path();
        self.count_attention_rows(path, plan.decode_rows());
        for ((i, &id), start) in queued.ids.iter().enumerate().zip(queued.offsets()) {
            let Some(seq) = self.running.iter().position(|s| s.id == id) else {
                continue;
            };
            if self.done.contains(&id) {
                continue;
            }
            let reserved_ahead = ahead.iter().find(|(a, _)| *a == id).map_or(0, |&(_, n)| n);
            let row = &tokens[start..start + queued.len(i)];
            if !queued.drafts[i].is_empty() {
                self.emit_pipelined_verification(
                    seq,
                    &queued.drafts[i],
                    queued.guesses[i],
                    row,
                    reserved_ahead,
                );
                continue;
            }
            self.pass_speculation(seq);
            if let Err(e) = self.advance(seq, 1, reserved_ahead) {
                tracing::error!(error = %e, "row failed after its forward");
                self.fail(seq, &e);
                continue;
            }
            // Its blocks up to the computed positions were donated in
            // `advance`; the queued step's position waits for its read.
            self.emit_and_record(seq, NextToken::Sampled(row[0]));
        }
    }
}

/// Whether every verification row of `queued` that has a row in `next`
/// kept its whole draft (`tokens`: `queued`'s greedy tokens, packed), as
/// `next` assumed when it took that row's last token as its input.
fn guesses_hold(queued: &Queued, tokens: &[u32], next: &Queued) -> bool {
    queued
        .ids
        .iter()
        .zip(&queued.drafts)
        .zip(queued.offsets())
        .all(|((id, draft), start)| {
            draft.is_empty()
                || !next.ids.contains(id)
                || tokens.get(start..start + draft.len()) == Some(draft.as_slice())
        })
}
