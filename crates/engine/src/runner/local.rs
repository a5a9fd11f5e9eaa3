//! The local runner: one process runs the whole model.
//!
//! A step is one guard: reserve the rows' positions, build the graph,
//! evaluate it with the cache's writes, read back what the rows asked for,
//! complete the reservation (pads rewound on success, everything on
//! failure, a panic caught and treated as a failure). Rows that want a
//! greedy token get it by argmax on the device, so only the token id comes
//! back, not a `[vocab]` row of logits: one device round trip per step.
//! Pipelined decode steps ([`StepRunner::queue_decode`]) are evaluated
//! with `async_eval` and read later (mlx-lm's `generate_step` does the
//! same; see `docs/performance.md`).

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use mlxcel_kv::{KvCache, KvSequence, RowReserve, StorageBackend};
use mlxcel_mlx::{Array, Dtype};
use mlxcel_model::profile;
use mlxcel_model::{AttentionPath, Model, StepGraph, StepRow};

use super::{
    BatchRow, DecodeInput, InFlight, Pending, RowOutput, StepBatch, StepOutput, StepRunner,
};
use crate::error::StepError;

/// What a runner wrapping the local one does around a step
/// ([`LocalRunner::run_with`]): the tensor-parallel leader describes the
/// step to the other ranks between building and evaluating it.
pub(crate) trait StepHook {
    /// After the rows' positions are reserved, before the graph is built.
    ///
    /// # Errors
    /// Fails the step (the reservation is rolled back).
    fn reserved(
        &mut self,
        kv: &mut KvCache,
        rows: &[(&KvSequence, usize)],
    ) -> Result<(), StepError> {
        let _ = (kv, rows);
        Ok(())
    }

    /// After the graph is built without error, before it is evaluated.
    ///
    /// # Errors
    /// Fails the step.
    fn built(&mut self, rows: &[StepRow<'_>]) -> Result<(), StepError> {
        let _ = rows;
        Ok(())
    }

    /// After the evaluation of a step that passed [`StepHook::built`]: may
    /// change its outcome.
    fn evaluated(
        &mut self,
        outcome: Result<StepOutput, StepError>,
    ) -> Result<StepOutput, StepError> {
        outcome
    }
}

/// The hook of a plain local step.
struct NoHook;

impl StepHook for NoHook {}

/// Runs steps of one model in this process.
pub(crate) struct LocalRunner<'m> {
    model: &'m dyn Model,
    /// How decode rows read the cache (per row on dense storage).
    path: AttentionPath,
    /// Test-only: make chosen forwards fail.
    #[cfg(feature = "fault-injection")]
    fault: crate::fault::FaultInjection,
    /// Test-only: pipelined reads so far (`FaultInjection::fail_pipelined_read`).
    #[cfg(feature = "fault-injection")]
    pipelined_reads: u64,
}

impl<'m> LocalRunner<'m> {
    /// A runner of `model` over caches of `backend`, decode rows read by
    /// `path` (per row whatever `path` on dense storage).
    pub(crate) fn new(model: &'m dyn Model, backend: StorageBackend, path: AttentionPath) -> Self {
        LocalRunner {
            model,
            path: match backend {
                StorageBackend::Paged => path,
                StorageBackend::Dense => AttentionPath::PerRow,
            },
            #[cfg(feature = "fault-injection")]
            fault: crate::fault::FaultInjection::default(),
            #[cfg(feature = "fault-injection")]
            pipelined_reads: 0,
        }
    }

    /// The runner, failing the forwards `fault` chooses (tests only).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn with_fault(mut self, fault: crate::fault::FaultInjection) -> Self {
        self.fault = fault;
        self
    }

    /// [`StepRunner::run`] with `hook` called around the forward.
    ///
    /// # Errors
    /// As [`StepRunner::run`].
    pub(crate) fn run_with(
        &mut self,
        kv: &mut KvCache,
        batch: &StepBatch<'_>,
        hook: &mut dyn StepHook,
    ) -> Result<StepOutput, StepError> {
        batch.check()?;
        let started = Instant::now();
        let reserve: Vec<RowReserve<'_>> = batch
            .rows
            .iter()
            .map(|r| RowReserve {
                seq: r.kv,
                real: r.real,
                padded: r.padded(),
            })
            .collect();
        let reservation = kv.reserve_step(&reserve)?;
        let outcome = catch_unwind(AssertUnwindSafe(|| self.forward(kv, batch, hook, started)))
            .unwrap_or_else(|panic| Err(StepError::from_panic(&*panic)));
        let completing = Instant::now();
        let completed = kv.complete_step(reservation, outcome.is_ok());
        profile::record("engine.complete_step", completing);
        if let (Err(step), Err(undo)) = (&outcome, &completed) {
            tracing::error!(error = %undo, step = %step, "rolling back a failed step");
        }
        let output = outcome?;
        completed?;
        Ok(output)
    }

    /// Builds, evaluates and reads back a reserved step.
    fn forward(
        &self,
        kv: &mut KvCache,
        batch: &StepBatch<'_>,
        hook: &mut dyn StepHook,
        started: Instant,
    ) -> Result<StepOutput, StepError> {
        let kv_rows: Vec<(&KvSequence, usize)> =
            batch.rows.iter().map(|r| (r.kv, r.padded())).collect();
        hook.reserved(kv, &kv_rows)?;
        #[cfg(feature = "fault-injection")]
        self.inject_fault(batch)?;
        let rows = batch.model_rows();
        let mut view = kv.step(&kv_rows)?;
        profile::record("engine.prepare", started);
        let graph = self.model.build_step(&rows, None, &mut view, self.path)?;
        hook.built(&rows)?;
        // Once built (and, under tensor parallelism, sent), the hook sees
        // how the evaluation ended, a panic included.
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            read_back(&graph, &batch.rows, mlxcel_kv::AttentionKv::storage(&view))
        }))
        .unwrap_or_else(|panic| Err(StepError::from_panic(&*panic)));
        hook.evaluated(outcome)
    }

    /// Fails (or panics) when a row holds the poison token.
    #[cfg(feature = "fault-injection")]
    fn inject_fault(&self, batch: &StepBatch<'_>) -> Result<(), StepError> {
        let tokens: Vec<Vec<u32>> = batch
            .rows
            .iter()
            .map(|r| match r.input {
                mlxcel_model::RowInput::Tokens(t) => t.to_vec(),
                mlxcel_model::RowInput::Embeddings(_) => Vec::new(),
            })
            .collect();
        self.fault.check(&tokens)
    }
}

impl StepRunner for LocalRunner<'_> {
    fn attention_path(&self) -> AttentionPath {
        self.path
    }

    fn run(
        &mut self,
        kv: &mut KvCache,
        batch: &StepBatch<'_>,
        _in_flight: &dyn InFlight,
    ) -> Result<StepOutput, StepError> {
        self.run_with(kv, batch, &mut NoHook)
    }

    fn can_queue(&self) -> bool {
        true
    }

    fn queue_decode(
        &mut self,
        kv: &mut KvCache,
        batch: &StepBatch<'_>,
        input: DecodeInput<'_>,
    ) -> Result<Pending, StepError> {
        let started = Instant::now();
        if batch.rows.iter().any(|r| {
            r.padded() != r.real
                || r.device_argmax != (0..r.real)
                || !r.host_logits.is_empty()
                || !r.hidden.is_empty()
        }) {
            return Err(StepError::Internal(
                "a queued decode row must be unpadded with every token's argmax on the device",
            ));
        }
        // Everything that can fail before the positions are reserved.
        let device_ids = match input {
            DecodeInput::Host => None,
            DecodeInput::Device { after, picks } => {
                let firsts = match picks {
                    None => after.tokens.clone(),
                    Some(picks) => {
                        let picks = Array::from_i32(picks, &[picks.len() as i32])?;
                        after.tokens.take(&picks, 0)?
                    }
                };
                Some(device_first_tokens(&batch.rows, firsts)?)
            }
        };
        let reserve: Vec<RowReserve<'_>> = batch
            .rows
            .iter()
            .map(|r| RowReserve {
                seq: r.kv,
                real: r.real,
                padded: r.real,
            })
            .collect();
        let reservation = kv.reserve_step(&reserve)?;
        let rows = batch.model_rows();
        let kv_rows: Vec<(&KvSequence, usize)> =
            batch.rows.iter().map(|r| (r.kv, r.real)).collect();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let mut view = kv.step(&kv_rows)?;
            let logits = self
                .model
                .build_step(&rows, device_ids.as_ref(), &mut view, self.path)?
                .logits;
            let tokens = logits.argmax(-1, false)?.astype(Dtype::Uint32)?;
            let mut outputs = vec![&tokens];
            outputs.extend(mlxcel_kv::AttentionKv::storage(&view));
            mlxcel_mlx::async_eval(&outputs)?;
            drop(outputs);
            Ok::<_, StepError>(tokens)
        }))
        .unwrap_or_else(|panic| Err(StepError::from_panic(&*panic)));
        kv.complete_step(reservation.clone(), outcome.is_ok())?;
        profile::record("engine.queue", started);
        Ok(Pending {
            tokens: outcome?,
            reservation,
        })
    }

    fn read(&mut self, kv: &mut KvCache, pending: &Pending) -> Result<Vec<u32>, StepError> {
        let read = profile::region("engine.wait_tokens", || pending.tokens.to_vec_u32())
            .map_err(StepError::from);
        #[cfg(feature = "fault-injection")]
        let read = {
            self.pipelined_reads += 1;
            match self.fault.fail_pipelined_read {
                Some(n) if n == self.pipelined_reads => {
                    read.and(Err(StepError::Internal("injected pipelined read failure")))
                }
                _ => read,
            }
        };
        read.inspect_err(|_| {
            // Roll the step (and any queued behind it) back.
            if let Err(undo) = kv.complete_step(pending.reservation.clone(), false) {
                tracing::error!(error = %undo, "rolling back a failed pipelined step");
            }
        })
    }
}

/// The packed token ids `[tokens]` of a queued step whose rows start with
/// a token still on the device: `firsts` (uint32 `[rows]`, row `r`'s
/// first token) put at each row's first position, the rest of each row
/// from its host tokens (a verification row's draft). Rows of one token
/// take `firsts` as it is.
///
/// # Errors
/// A row whose input is not tokens, an MLX failure.
fn device_first_tokens(rows: &[BatchRow<'_>], firsts: Array) -> Result<Array, StepError> {
    if rows.iter().all(|r| r.real == 1) {
        return Ok(firsts);
    }
    let (mut ids, mut starts) = (Vec::new(), Vec::with_capacity(rows.len()));
    for r in rows {
        let mlxcel_model::RowInput::Tokens(t) = r.input else {
            return Err(StepError::Internal("a queued decode row of embeddings"));
        };
        starts.push(ids.len() as i32);
        ids.extend_from_slice(t.get(..r.real).unwrap_or_default());
    }
    let host = Array::from_u32(&ids, &[ids.len() as i32])?;
    let starts = Array::from_i32(&starts, &[starts.len() as i32])?;
    Ok(host.put_along_axis(&starts, &firsts, 0)?)
}

/// Where each row's wanted positions sit among the step's logits rows
/// (`[wanted positions, vocab]`, rows in order).
struct Placement {
    /// Packed logits rows of every host position, in row order.
    host: Vec<i32>,
    /// Packed logits rows of every device position, in row order.
    device: Vec<i32>,
    /// Logits rows in all.
    total: usize,
}

impl Placement {
    fn of(rows: &[BatchRow<'_>]) -> Self {
        let (mut host, mut device, mut at) = (Vec::new(), Vec::new(), 0i32);
        let offset = |at: i32, wanted: &Range<usize>, r: &Range<usize>| {
            (r.start - wanted.start) as i32 + at..(r.end - wanted.start) as i32 + at
        };
        for row in rows {
            let wanted = row.wanted();
            if !row.host_logits.is_empty() {
                host.extend(offset(at, &wanted, &row.host_logits));
            }
            if !row.device_argmax.is_empty() {
                device.extend(offset(at, &wanted, &row.device_argmax));
            }
            at += wanted.len() as i32;
        }
        Placement {
            host,
            device,
            total: at as usize,
        }
    }
}

/// Evaluates a step (its logits `[wanted positions, vocab]`, any hidden
/// states and the cache `storage`) with the device positions reduced to
/// their greedy token there, and reads back those tokens, the host
/// positions' logits and the hidden states: one device round trip.
fn read_back(
    graph: &StepGraph,
    rows: &[BatchRow<'_>],
    storage: Vec<&Array>,
) -> Result<StepOutput, StepError> {
    let logits = &graph.logits;
    let place = Placement::of(rows);
    let take = |idx: &[i32]| -> Result<Option<Array>, mlxcel_mlx::Error> {
        if idx.is_empty() {
            return Ok(None);
        }
        if idx.len() == place.total && idx.iter().enumerate().all(|(i, &r)| r == i as i32) {
            return Ok(Some(logits.clone()));
        }
        let idx = Array::from_i32(idx, &[idx.len() as i32])?;
        Ok(Some(logits.take(&idx, 0)?))
    };
    let tokens = match take(&place.device)? {
        Some(l) => Some(l.argmax(-1, false)?.astype(Dtype::Uint32)?),
        None => None,
    };
    let host = take(&place.host)?;
    let mut outputs: Vec<&Array> = tokens
        .iter()
        .chain(host.iter())
        .chain(graph.hidden.iter())
        .collect();
    outputs.extend(storage);
    profile::region("model.eval", || mlxcel_mlx::eval(&outputs))?;
    let to_f32 = |a: &Option<Array>| a.as_ref().map_or(Ok(Vec::new()), |a| a.to_vec_f32());
    let (tokens, host, hidden) = profile::region("engine.logits_to_host", || {
        Ok::<_, mlxcel_mlx::Error>((
            match &tokens {
                Some(t) => t.to_vec_u32()?,
                None => Vec::new(),
            },
            to_f32(&host)?,
            to_f32(&graph.hidden)?,
        ))
    })?;
    let vocab = host.len().checked_div(place.host.len()).unwrap_or(0);
    let hidden_positions: usize = rows.iter().map(|r| r.hidden.len()).sum();
    let width = hidden.len().checked_div(hidden_positions).unwrap_or(0);
    let (mut t, mut h, mut s) = (0, 0, 0);
    let rows = rows
        .iter()
        .map(|row| {
            let (nt, nh, ns) = (
                row.device_argmax.len(),
                row.host_logits.len(),
                row.hidden.len(),
            );
            let out = RowOutput {
                tokens: tokens.get(t..t + nt).unwrap_or_default().to_vec(),
                logits: host
                    .get(h * vocab..(h + nh) * vocab)
                    .unwrap_or_default()
                    .to_vec(),
                vocab: if nh > 0 { vocab } else { 0 },
                hidden: hidden
                    .get(s * width..(s + ns) * width)
                    .unwrap_or_default()
                    .to_vec(),
            };
            t += nt;
            h += nh;
            s += ns;
            out
        })
        .collect();
    Ok(StepOutput { rows })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxcel_kv::{KvCacheConfig, KvLayout};
    use mlxcel_mlx::Dtype;
    use mlxcel_model::RowInput;

    fn cache() -> KvCache {
        KvCache::new(KvCacheConfig {
            layout: KvLayout {
                layers: 1,
                kv_heads: 1,
                head_dim: 2,
                dtype: Dtype::Float32,
                kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
            },
            block_size: 4,
            num_blocks: 4,
            backend: StorageBackend::Paged,
            prefix: None,
        })
        .unwrap()
    }

    #[test]
    fn each_rows_positions_land_in_the_right_logits_rows() {
        let mut kv = cache();
        let (a, b, c) = (kv.new_sequence(), kv.new_sequence(), kv.new_sequence());
        let tokens = [1u32, 2, 3, 4, 5];
        let row = |kv, host: Range<usize>, device: Range<usize>| BatchRow {
            kv,
            input: RowInput::Tokens(&tokens),
            real: 5,
            host_logits: host,
            device_argmax: device,
            hidden: 0..0,
        };
        // A scored prompt sampled on the device, a prefill chunk wanting
        // nothing, a verification row sampled on the host.
        let rows = [
            row(&a, 0..4, 4..5),
            row(&b, 0..0, 0..0),
            row(&c, 1..5, 5..5),
        ];
        let place = Placement::of(&rows);
        assert_eq!(place.host, vec![0, 1, 2, 3, 5, 6, 7, 8]);
        assert_eq!(place.device, vec![4]);
        assert_eq!(place.total, 9);
        let batch = StepBatch {
            rows: rows.to_vec(),
        };
        assert!(batch.check().is_ok());
        let rows: Vec<_> = batch
            .model_rows()
            .iter()
            .map(|r| r.logits.clone())
            .collect();
        assert_eq!(rows, vec![0..5, 0..0, 1..5]);
    }

    #[test]
    fn a_queued_steps_first_tokens_come_from_the_device_and_drafts_from_the_host() {
        let mut kv = cache();
        let (a, b, c) = (kv.new_sequence(), kv.new_sequence(), kv.new_sequence());
        // A decode row, a verification row of 3 drafts, another of 1; the
        // stand-in first tokens (0) are replaced by the device's.
        let (decode, verify, short) = ([0u32], [0u32, 11, 12, 13], [0u32, 21]);
        fn row<'a>(kv: &'a KvSequence, t: &'a [u32]) -> BatchRow<'a> {
            BatchRow {
                kv,
                input: RowInput::Tokens(t),
                real: t.len(),
                host_logits: 0..0,
                device_argmax: 0..t.len(),
                hidden: 0..0,
            }
        }
        let rows = [row(&a, &decode), row(&b, &verify), row(&c, &short)];
        let firsts = Array::from_u32(&[7, 8, 9], &[3]).unwrap();
        let ids = device_first_tokens(&rows, firsts).unwrap();
        assert_eq!(ids.to_vec_u32().unwrap(), vec![7, 8, 11, 12, 13, 9, 21]);
        // Rows of one token take the device's tokens as they are.
        let firsts = Array::from_u32(&[4, 5], &[2]).unwrap();
        let decode_rows = [rows[0].clone(), row(&b, &decode)];
        let ids = device_first_tokens(&decode_rows, firsts).unwrap();
        assert_eq!(ids.to_vec_u32().unwrap(), vec![4, 5]);
    }

    #[test]
    fn rows_whose_ranges_do_not_fit_are_refused() {
        let mut kv = cache();
        let seq = kv.new_sequence();
        let tokens = [1u32, 2, 3];
        let bad = |host: Range<usize>, device: Range<usize>, real| StepBatch {
            rows: vec![BatchRow {
                kv: &seq,
                input: RowInput::Tokens(&tokens),
                real,
                host_logits: host,
                device_argmax: device,
                hidden: 0..0,
            }],
        };
        // A gap between host and device positions, a range past the real
        // tokens, no real token, more real tokens than the row holds.
        for batch in [
            bad(0..1, 2..3, 3),
            bad(0..3, 0..0, 2),
            bad(0..0, 0..0, 0),
            bad(0..0, 0..0, 4),
        ] {
            assert!(matches!(batch.check(), Err(StepError::Internal(_))));
        }
        assert!(bad(0..2, 2..3, 3).check().is_ok());
    }
}
