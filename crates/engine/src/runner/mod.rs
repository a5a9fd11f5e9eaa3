//! The step runner: the seam between the engine core (which schedules,
//! samples and streams) and what runs a step's forward.
//!
//! The core hands a runner one scheduled step as plain data
//! ([`StepBatch`]: each row's KV sequence, input, real token count and the
//! positions whose logits it wants) and gets typed output back
//! ([`StepOutput`]) or a typed [`StepError`]. A runner owns the whole
//! forward as one guard: reserve the rows' positions, build the graph,
//! evaluate it, read back what the rows asked for, and complete the
//! reservation (pad tokens rewound on success, every position on failure,
//! panics included), so a failed step leaves the cache as it was.
//!
//! Runners (vLLM v1's `engine/core.py` step: schedule → execute → update;
//! mistral.rs's one pipeline per kind of model run):
//! - [`local::LocalRunner`]: one process, one model.
//! - [`tensor_parallel::LeaderRunner`]: rank 0 of a tensor-parallel group;
//!   wraps a local runner and sends each step to the other ranks before it
//!   is evaluated ([`tensor_parallel::follower`] runs them).
//!
//! What changes the step itself goes here, as a new runner or a strategy a
//! runner calls: several tokens per row with logits at each (verification
//! of draft tokens: a row's `host_logits` / `device_argmax` ranges cover
//! them, and [`RowOutput`] carries a token or a logits row per position),
//! rows whose input is embeddings ([`RowInput::Embeddings`]), rows that
//! want final hidden states instead of logits (embedding requests:
//! [`BatchRow::hidden`], [`RowOutput::hidden`]). Per-layer
//! state that is not K/V is declared by the model
//! (`Model::layer_states`, `mlxcel_kv::LayerState::Recurrent`) and
//! refused at start-up for now: its storage, its reads through the KV
//! view and its rollback (a snapshot, not a truncation) come with the
//! first family that needs it.

pub(crate) mod local;
pub(crate) mod tensor_parallel;

use std::ops::Range;
use std::sync::Mutex;

use mlxcel_kv::{KvCache, KvSequence, StepReservation};
use mlxcel_mlx::Array;
use mlxcel_model::{AttentionPath, RowInput, StepRow};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::GenerationEvent;
use crate::error::StepError;

/// One row of a step: a sequence's next tokens and what it wants back.
#[derive(Debug, Clone)]
pub(crate) struct BatchRow<'a> {
    /// The sequence whose cache the row extends.
    pub(crate) kv: &'a KvSequence,
    /// What the row runs: its real tokens, then pad tokens (rewound after
    /// the step), or input embeddings.
    pub(crate) input: RowInput<'a>,
    /// Real tokens at the front of `input`; the rest are pads.
    pub(crate) real: usize,
    /// Positions (in `0..real`) whose next-token logits come back to the
    /// host, float32 `[vocab]` each: a scored prompt chunk, a row sampled
    /// on the host.
    pub(crate) host_logits: Range<usize>,
    /// Positions whose greedy next token is taken on the device (argmax),
    /// so only the token id comes back. Follows `host_logits` when both
    /// are non-empty (`host_logits.end == device_argmax.start`).
    pub(crate) device_argmax: Range<usize>,
    /// Positions (in `0..real`) whose final hidden state (after the final
    /// norm, before the head) comes back to the host, float32 `[hidden]`
    /// each: an embedding request's rows (its last token, or every token
    /// for mean pooling).
    pub(crate) hidden: Range<usize>,
}

impl BatchRow<'_> {
    /// Every position whose logits the model must produce.
    fn wanted(&self) -> Range<usize> {
        match (self.host_logits.is_empty(), self.device_argmax.is_empty()) {
            (true, true) => 0..0,
            (false, true) => self.host_logits.clone(),
            (true, false) => self.device_argmax.clone(),
            (false, false) => self.host_logits.start..self.device_argmax.end,
        }
    }

    /// Tokens the row runs (pads included).
    pub(crate) fn padded(&self) -> usize {
        self.input.len()
    }
}

/// One scheduled step: its rows in order (decode rows first).
#[derive(Debug, Clone, Default)]
pub(crate) struct StepBatch<'a> {
    pub(crate) rows: Vec<BatchRow<'a>>,
}

impl<'a> StepBatch<'a> {
    /// The rows as the model takes them.
    pub(crate) fn model_rows(&self) -> Vec<StepRow<'a>> {
        self.rows
            .iter()
            .map(|r| StepRow {
                input: r.input,
                logits: r.wanted(),
                hidden: r.hidden.clone(),
            })
            .collect()
    }

    /// Checks each row's ranges: within its real tokens, and host logits
    /// before device ones with nothing between.
    ///
    /// # Errors
    /// [`StepError::Internal`] for a row that breaks the rule.
    pub(crate) fn check(&self) -> Result<(), StepError> {
        for r in &self.rows {
            let ok = r.real >= 1
                && r.real <= r.padded()
                && r.host_logits.end <= r.real
                && r.device_argmax.end <= r.real
                && r.hidden.end <= r.real
                && (r.host_logits.is_empty()
                    || r.device_argmax.is_empty()
                    || r.host_logits.end == r.device_argmax.start);
            if !ok {
                return Err(StepError::Internal(
                    "a step row's logits or hidden ranges do not fit its tokens",
                ));
            }
        }
        Ok(())
    }
}

/// What came back for one row of a step.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct RowOutput {
    /// The greedy token at each of the row's `device_argmax` positions.
    pub(crate) tokens: Vec<u32>,
    /// Float32 logits `[host_logits.len(), vocab]`, row-major.
    pub(crate) logits: Vec<f32>,
    /// Logits per position (the model's vocabulary); 0 when none came back.
    pub(crate) vocab: usize,
    /// Float32 final hidden states `[hidden.len(), hidden_size]`,
    /// row-major (the row's `hidden` positions); empty when none.
    pub(crate) hidden: Vec<f32>,
}

impl RowOutput {
    /// The logits of the row's `i`-th host position.
    pub(crate) fn logits_row(&self, i: usize) -> Option<&[f32]> {
        if self.vocab == 0 {
            return None;
        }
        self.logits.get(i * self.vocab..(i + 1) * self.vocab)
    }

    /// Host positions read back.
    pub(crate) fn logits_rows(&self) -> usize {
        self.logits.len().checked_div(self.vocab).unwrap_or(0)
    }
}

/// A step's output: one [`RowOutput`] per row, in row order.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct StepOutput {
    pub(crate) rows: Vec<RowOutput>,
}

/// A greedy decode step queued on the device whose tokens are not read
/// yet (pipelined decode: the next step is built from these tokens before
/// they reach the host).
pub(crate) struct Pending {
    /// The greedy token after every position of every row, uint32
    /// `[tokens]` packed in row order (one per plain decode row, `1 +
    /// draft` per verification row), being evaluated.
    pub(crate) tokens: Array,
    /// The positions it reserved (already completed): rolled back if the
    /// evaluation fails.
    pub(crate) reservation: StepReservation,
}

impl Drop for Pending {
    /// Waits for the step's evaluation: a step dropped unread (its rows
    /// ended) must not leave device work running behind the engine.
    fn drop(&mut self) {
        let _ = self.tokens.eval();
    }
}

/// Where a queued decode step's input tokens come from.
#[derive(Clone, Copy)]
pub(crate) enum DecodeInput<'a> {
    /// The rows' host tokens (`BatchRow::input`).
    Host,
    /// A queued step's sampled tokens, not read yet: each row's first
    /// token is `after`'s at `picks[row]` (`picks: None`: `after` had one
    /// token per row and this step has its rows in the same order); a
    /// verification row's draft tokens after it come from its
    /// `BatchRow::input` (whose first token is a stand-in).
    Device {
        after: &'a Pending,
        picks: Option<&'a [i32]>,
    },
}

/// The request streams a runner fails by itself if a step never returns
/// (a tensor-parallel peer that stopped answering blocks the engine thread
/// in a collective). Asked only by runners that need it.
pub(crate) trait InFlight {
    /// Every running and waiting request's event stream.
    fn streams(&self) -> Vec<UnboundedSender<GenerationEvent>>;
}

/// What runs a step (see the module docs).
pub(crate) trait StepRunner {
    /// How decode rows read a paged cache in this runner.
    fn attention_path(&self) -> AttentionPath;

    /// Runs one step: reserve → build → evaluate → read back → complete.
    /// On error nothing of the step stays in `kv`.
    ///
    /// # Errors
    /// Any [`StepError`]; [`StepError::GroupBroken`] means no later step
    /// can run either.
    fn run(
        &mut self,
        kv: &mut KvCache,
        batch: &StepBatch<'_>,
        in_flight: &dyn InFlight,
    ) -> Result<StepOutput, StepError>;

    /// Whether [`StepRunner::queue_decode`] is available (pipelined
    /// decode needs every input on the device; tensor parallelism sends
    /// inputs from the host).
    fn can_queue(&self) -> bool;

    /// Reserves and queues a greedy decode step without reading it back:
    /// rows of one token (decode) or of `1 + draft` tokens (a
    /// verification: its last token and its draft), unpadded, the greedy
    /// token after every position taken by argmax on the device
    /// (`BatchRow::device_argmax` of `0..real`, nothing for the host). The
    /// reservation is completed at once; [`StepRunner::read`] rolls it
    /// back if the evaluation fails, [`StepRunner::discard`] when the step
    /// is not wanted any more.
    ///
    /// # Errors
    /// Any [`StepError`] while building (nothing stays reserved), a row
    /// that is padded or wants logits on the host.
    fn queue_decode(
        &mut self,
        kv: &mut KvCache,
        batch: &StepBatch<'_>,
        input: DecodeInput<'_>,
    ) -> Result<Pending, StepError>;

    /// Waits for a queued step and reads its tokens (every position's, in
    /// [`Pending::tokens`]' order).
    ///
    /// # Errors
    /// The evaluation failed: `pending`'s positions (and those of any step
    /// queued behind it, which ends later) are rolled back.
    fn read(&mut self, kv: &mut KvCache, pending: &Pending) -> Result<Vec<u32>, StepError>;

    /// Rolls back a queued step that will not be read (it was built on a
    /// guess the step before it proved wrong: a rejected draft): its
    /// rows' positions go back to where they were before it. It must be
    /// the last step queued. Its device work may still be running: a step
    /// built after this reads the cache's storage through that step's
    /// writes, so it runs after them, and the caller keeps `pending`
    /// until then (dropping it waits for its evaluation).
    ///
    /// # Errors
    /// The rollback failed.
    fn discard(&mut self, kv: &mut KvCache, pending: &Pending) -> Result<(), StepError> {
        kv.complete_step(pending.reservation.clone(), false)?;
        Ok(())
    }

    /// `Err` once the runner can run no step any more (a broken
    /// tensor-parallel group).
    fn health(&self) -> Result<(), StepError> {
        Ok(())
    }
}

/// Whether a runner can still run steps, shared with the engine handle
/// (new requests are refused once it cannot) and `/health`: a
/// tensor-parallel group whose rank failed or stopped answering breaks it
/// for good.
#[derive(Debug, Default)]
pub(crate) struct RunnerHealth {
    broken: Mutex<Option<String>>,
}

impl RunnerHealth {
    /// Marks the runner broken (the first reason stays).
    pub(crate) fn mark_broken(&self, reason: &str) {
        let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        if b.is_none() {
            tracing::error!(reason, "the step runner is broken: serving stops");
            *b = Some(reason.to_owned());
        }
    }

    /// Why the runner is broken, if it is.
    pub(crate) fn broken(&self) -> Option<String> {
        self.broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
