//! One step's positions in a [`KvCache`]: every row's padded tokens
//! reserved ([`KvCache::reserve_step`]), the real ones kept or all rewound
//! ([`KvCache::complete_step`]), and the view the forward reads and writes
//! through ([`KvCache::step`]).

use super::{KvCache, KvSequence};
use crate::error::KvError;
use crate::step::StepKv;

/// One row of [`KvCache::reserve_step`]: `real` tokens padded to `padded`.
#[derive(Debug, Clone, Copy)]
pub struct RowReserve<'a> {
    /// The sequence.
    pub seq: &'a KvSequence,
    /// Real tokens of the row (at least 1).
    pub real: usize,
    /// Tokens the forward writes: `real` plus pad tokens after them.
    pub padded: usize,
}

/// A reserved step: each row's sequence end before the step and its real
/// token count. Hand it back with [`KvCache::complete_step`] (a copy kept
/// after completing lets a pipelined step roll back later).
#[derive(Debug, Clone)]
#[must_use = "a reserved step must be completed"]
pub struct StepReservation {
    rows: Vec<(u64, usize, usize)>,
}

impl KvCache {
    /// Reserves one step's positions: each row's `padded` tokens (its
    /// `real` tokens followed by `padded - real` pad tokens) are appended.
    /// All or nothing: when a row doesn't fit, the rows before it are
    /// rewound and the error returned.
    pub fn reserve_step(&mut self, rows: &[RowReserve<'_>]) -> Result<StepReservation, KvError> {
        let mut done: Vec<(u64, usize, usize)> = Vec::with_capacity(rows.len());
        for r in rows {
            let old_end = self.end(r.seq)?;
            let result = if r.real == 0 || r.padded < r.real {
                Err(KvError::Invariant(format!(
                    "row of {} real tokens padded to {}",
                    r.real, r.padded
                )))
            } else {
                self.append(r.seq, r.padded)
            };
            if let Err(e) = result {
                self.rewind_ids(done.iter().map(|&(id, end, _)| (id, end)))?;
                return Err(e);
            }
            done.push((r.seq.id, old_end, r.real));
            if let Some(state) = self.seqs.get_mut(&r.seq.id) {
                state.reserved = Some((old_end, r.real));
            }
        }
        Ok(StepReservation { rows: done })
    }

    /// Ends a step reserved by [`KvCache::reserve_step`]. On success each
    /// row keeps exactly its real tokens (`end = old_end + real`: pad rows
    /// are rewound through the one tail-shrink path); on failure every row
    /// returns to where it was. Rows whose sequence was released meanwhile
    /// are skipped.
    pub fn complete_step(&mut self, step: StepReservation, success: bool) -> Result<(), KvError> {
        for &(id, _, _) in &step.rows {
            if let Some(state) = self.seqs.get_mut(&id) {
                state.reserved = None;
            }
        }
        let targets = step
            .rows
            .iter()
            .map(|&(id, old_end, real)| (id, if success { old_end + real } else { old_end }));
        self.rewind_ids(targets.collect::<Vec<_>>())
    }

    /// Truncates each sequence of `targets` to its end; every sequence is
    /// tried (one that fails does not keep the others from rewinding) and
    /// the first error is returned.
    fn rewind_ids(
        &mut self,
        targets: impl IntoIterator<Item = (u64, usize)>,
    ) -> Result<(), KvError> {
        let mut first_error = None;
        for (id, end) in targets {
            if let Some(state) = self.seqs.get_mut(&id) {
                state.recurrent.prune(end);
                for (g, blocks) in state.blocks.iter_mut().enumerate() {
                    if blocks.end() != end {
                        if let Err(e) = blocks.truncate_tail(&mut self.groups[g].pool, end) {
                            first_error.get_or_insert(e);
                        }
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The view of one forward over `rows` (each sequence with its last
    /// `new_tokens` positions just appended); see [`StepKv`].
    ///
    /// # Errors
    /// An unknown sequence, `new_tokens` larger than the sequence, or the
    /// same sequence twice.
    pub fn step(&mut self, rows: &[(&KvSequence, usize)]) -> Result<StepKv<'_>, KvError> {
        StepKv::new(self, rows.iter().map(|(s, n)| (s.id, *n)).collect())
    }
}
