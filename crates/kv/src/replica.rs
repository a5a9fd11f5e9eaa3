//! The KV cache of a follower rank under tensor parallelism
//! (docs/distributed.md): rank 0 owns the whole bookkeeping (block pool,
//! block tables, prefix cache, scheduler); every other rank keeps only the
//! tensors of its own K/V heads, in a paged pool of the same block count,
//! indexed by the same block ids. Each step, rank 0 sends a
//! [`StepLayout`]: the block copies its bookkeeping asked for since the
//! last step (copy-on-write) and each row's positions and block table. A
//! follower's [`KvReplica::step`] applies the copies and gives the model
//! the same reads and writes as rank 0's [`crate::StepKv`], slot for slot.

use std::ops::Range;

use mlxcel_mlx::Array;
use serde::{Deserialize, Serialize};

use crate::cache::{KvCache, KvSequence};
use crate::error::KvError;
use crate::pool::BlockId;
use crate::sequence::BlockCopy;
use crate::step::{AttentionKv, PagedKv};
use crate::storage::{KvLayout, PagedStorage};

/// One row of a step as plain data: the sequence's live positions
/// `[start, end)`, its `new` last positions being this step's tokens, and
/// its block table (block ids, `blocks[0]` holding position
/// `start / block_size * block_size`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowLayout {
    /// First live position.
    pub start: usize,
    /// One past the last position (this step's tokens included).
    pub end: usize,
    /// The step's tokens of this row (pads included), the last of `[start, end)`.
    pub new: usize,
    /// Block ids in position order.
    pub blocks: Vec<u32>,
}

/// A block copy as plain data: the first `tokens` slots of block `src`
/// into block `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyLayout {
    pub src: u32,
    pub dst: u32,
    pub tokens: u32,
}

impl From<BlockCopy> for CopyLayout {
    fn from(c: BlockCopy) -> Self {
        CopyLayout {
            src: c.src.0,
            dst: c.dst.0,
            tokens: c.tokens as u32,
        }
    }
}

/// What a follower's KV needs for one step: the copies to make first, then
/// the rows (packed in this order, as [`crate::StepKv`] packs them).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StepLayout {
    pub copies: Vec<CopyLayout>,
    pub rows: Vec<RowLayout>,
}

impl KvCache {
    /// Starts (or stops) keeping a log of the block copies the paged
    /// backend makes, for [`KvCache::take_block_copies`] (rank 0 under
    /// tensor parallelism). Off by default: nothing would drain it.
    pub fn record_block_copies(&mut self, on: bool) {
        self.copy_log = on.then(Vec::new);
    }

    /// The block copies made since the last call, in order (empty unless
    /// recording).
    pub fn take_block_copies(&mut self) -> Vec<CopyLayout> {
        match &mut self.copy_log {
            Some(log) => std::mem::take(log)
                .into_iter()
                .map(CopyLayout::from)
                .collect(),
            None => Vec::new(),
        }
    }

    /// The rows of a step over `rows` (each sequence with its last `new`
    /// positions reserved) as plain data, with no copies (the caller adds
    /// [`KvCache::take_block_copies`]).
    ///
    /// # Errors
    /// An unknown sequence, a dense cache (only the paged pool is
    /// addressed by block ids), or a cache of several KV groups (a layout
    /// addresses one pool).
    pub fn step_layout(&self, rows: &[(&KvSequence, usize)]) -> Result<StepLayout, KvError> {
        if self.groups.len() != 1 || self.groups[0].paged.is_none() {
            return Err(KvError::Invariant(
                "a step layout needs the paged backend and one KV group".into(),
            ));
        }
        let rows = rows
            .iter()
            .map(|(seq, new)| {
                let s = self.state(seq)?.first();
                Ok(RowLayout {
                    start: s.start(),
                    end: s.end(),
                    new: *new,
                    blocks: s.blocks().iter().map(|b| b.0).collect(),
                })
            })
            .collect::<Result<Vec<_>, KvError>>()?;
        Ok(StepLayout {
            copies: Vec::new(),
            rows,
        })
    }
}

/// A follower rank's K/V tensors: a paged pool of `num_blocks` blocks,
/// addressed by rank 0's block ids.
#[derive(Debug)]
pub struct KvReplica {
    storage: PagedStorage,
    block_size: usize,
    num_blocks: usize,
}

impl KvReplica {
    /// Allocates the pool (zero-filled, evaluated now).
    ///
    /// # Errors
    /// A zero block size, too many slots, an MLX allocation failure.
    pub fn new(layout: KvLayout, num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if block_size == 0 || num_blocks == 0 {
            return Err(KvError::Invariant(format!(
                "a pool of {num_blocks} blocks of {block_size} tokens"
            )));
        }
        Ok(KvReplica {
            storage: PagedStorage::new(layout, num_blocks, block_size)?,
            block_size,
            num_blocks,
        })
    }

    /// Makes `layout`'s block copies, then returns the step's view.
    ///
    /// # Errors
    /// A layout that does not fit the pool: a block id out of range, a
    /// block table too short for its positions, a row with no new token.
    pub fn step<'a>(&'a mut self, layout: &'a StepLayout) -> Result<ReplicaStep<'a>, KvError> {
        let bs = self.block_size;
        let check_block = |b: u32| -> Result<(), KvError> {
            if (b as usize) < self.num_blocks {
                Ok(())
            } else {
                Err(KvError::Invariant(format!(
                    "block {b} outside a pool of {}",
                    self.num_blocks
                )))
            }
        };
        for r in &layout.rows {
            let span = r.end.saturating_sub(r.start);
            if r.new == 0 || r.new > span {
                return Err(KvError::Invariant(format!(
                    "bad replica row [{}, {}) with {} new tokens",
                    r.start, r.end, r.new
                )));
            }
            let needed = (r.end - 1) / bs - r.start / bs + 1;
            if r.blocks.len() < needed {
                return Err(KvError::Invariant(format!(
                    "row [{}, {}) has {} blocks, needs {needed}",
                    r.start,
                    r.end,
                    r.blocks.len()
                )));
            }
            r.blocks.iter().try_for_each(|&b| check_block(b))?;
        }
        for c in &layout.copies {
            check_block(c.src)?;
            check_block(c.dst)?;
            if c.tokens as usize > bs {
                return Err(KvError::Invariant(format!(
                    "a copy of {} tokens from blocks of {bs}",
                    c.tokens
                )));
            }
            self.storage.copy_block(BlockCopy {
                src: BlockId(c.src),
                dst: BlockId(c.dst),
                tokens: c.tokens as usize,
            })?;
        }
        let mut slots = Vec::new();
        for r in &layout.rows {
            slots.extend(row_slots(r, bs, r.end - r.new..r.end));
        }
        let n = slots.len() as i32;
        let write_slots = Array::from_i32(&slots, &[n, 1, 1])?;
        Ok(ReplicaStep {
            storage: &mut self.storage,
            rows: &layout.rows,
            block_size: bs,
            write_slots,
            row_slots: vec![None; layout.rows.len()],
            padded: None,
            tables: None,
        })
    }
}

/// Flat pool slots of positions `range` of row `r` (inside `[start, end)`).
fn row_slots(r: &RowLayout, bs: usize, range: Range<usize>) -> Vec<i32> {
    let first = r.start / bs;
    range
        .map(|p| (r.blocks[p / bs - first] as usize * bs + p % bs) as i32)
        .collect()
}

/// The [`AttentionKv`] of one step on a follower rank: the same slots,
/// gathers and block tables as rank 0's [`crate::StepKv`], over this
/// rank's heads.
pub struct ReplicaStep<'a> {
    storage: &'a mut PagedStorage,
    rows: &'a [RowLayout],
    block_size: usize,
    write_slots: Array,
    row_slots: Vec<Option<Array>>,
    padded: Option<(Vec<usize>, Array, usize)>,
    tables: Option<(Vec<usize>, Array, Array)>,
}

impl ReplicaStep<'_> {
    fn row(&self, row: usize) -> Result<&RowLayout, KvError> {
        self.rows
            .get(row)
            .ok_or(KvError::Invariant(format!("no row {row} in the step")))
    }
}

impl AttentionKv for ReplicaStep<'_> {
    fn num_rows(&self) -> usize {
        self.rows.len()
    }

    fn new_positions(&self, row: usize) -> Range<usize> {
        self.rows.get(row).map_or(0..0, |r| r.end - r.new..r.end)
    }

    fn write(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<(), KvError> {
        self.storage.write(layer, &self.write_slots, keys, values)
    }

    fn read(&mut self, layer: usize, row: usize) -> Result<(Array, Array), KvError> {
        let r = self.row(row)?;
        let len = (r.end - r.start) as i32;
        if self.row_slots[row].is_none() {
            let slots = row_slots(r, self.block_size, r.start..r.end);
            self.row_slots[row] = Some(Array::from_i32(&slots, &[len])?);
        }
        match &self.row_slots[row] {
            Some(slots) => self.storage.gather(layer, slots, 1, len),
            None => Err(KvError::Invariant("row slots missing".into())),
        }
    }

    fn read_padded(
        &mut self,
        layer: usize,
        rows: &[usize],
    ) -> Result<Option<(Array, Array, Vec<usize>)>, KvError> {
        if rows.is_empty() {
            return Ok(None);
        }
        let lens = rows
            .iter()
            .map(|&r| self.row(r).map(|r| r.end - r.start))
            .collect::<Result<Vec<_>, _>>()?;
        if self
            .padded
            .as_ref()
            .is_none_or(|(built, _, _)| built != rows)
        {
            let max = lens.iter().copied().max().unwrap_or(0);
            let mut slots = Vec::with_capacity(rows.len() * max);
            for &row in rows {
                let r = self.row(row)?;
                let mut own = row_slots(r, self.block_size, r.start..r.end);
                // Padded with the row's own first slot, as StepKv does.
                let fill = own[0];
                own.resize(max, fill);
                slots.extend(own);
            }
            let arr = Array::from_i32(&slots, &[slots.len() as i32])?;
            self.padded = Some((rows.to_vec(), arr, max));
        }
        match &self.padded {
            Some((_, slots, max)) => {
                let (k, v) = self
                    .storage
                    .gather(layer, slots, rows.len() as i32, *max as i32)?;
                Ok(Some((k, v, lens)))
            }
            None => Ok(None),
        }
    }

    fn read_paged(&mut self, layer: usize, rows: &[usize]) -> Result<Option<PagedKv<'_>>, KvError> {
        if rows.is_empty() {
            return Ok(None);
        }
        if self
            .tables
            .as_ref()
            .is_none_or(|(built, _, _)| built != rows)
        {
            let bs = self.block_size;
            let mut tables: Vec<Vec<i32>> = Vec::with_capacity(rows.len());
            let mut meta = Vec::with_capacity(rows.len() * 2);
            for &row in rows {
                let r = self.row(row)?;
                tables.push(r.blocks.iter().map(|&b| b as i32).collect());
                meta.push((r.start % bs) as i32);
                meta.push((r.end - r.start) as i32);
            }
            let width = tables.iter().map(Vec::len).max().unwrap_or(1).max(1);
            let mut flat = Vec::with_capacity(rows.len() * width);
            for mut t in tables {
                let fill = t.last().copied().unwrap_or(0);
                t.resize(width, fill);
                flat.extend(t);
            }
            let n = rows.len() as i32;
            let tables = Array::from_i32(&flat, &[n, width as i32])?;
            let meta = Array::from_i32(&meta, &[n, 2])?;
            self.tables = Some((rows.to_vec(), tables, meta));
        }
        match &self.tables {
            Some((_, tables, meta)) => Ok(Some(self.storage.layer(layer)?.paged_kv(
                tables,
                meta,
                self.block_size,
            )?)),
            None => Ok(None),
        }
    }

    fn storage(&self) -> Vec<&Array> {
        self.storage.arrays().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{CopyLayout, RowLayout, StepLayout};

    #[test]
    fn step_layout_round_trips_through_json() {
        let layout = StepLayout {
            copies: vec![CopyLayout {
                src: 3,
                dst: 7,
                tokens: 5,
            }],
            rows: vec![
                RowLayout {
                    start: 0,
                    end: 21,
                    new: 1,
                    blocks: vec![7, 2],
                },
                RowLayout {
                    start: 16,
                    end: 40,
                    new: 8,
                    blocks: vec![4, 9],
                },
            ],
        };
        let json = serde_json::to_string(&layout).unwrap();
        let back: StepLayout = serde_json::from_str(&json).unwrap();
        assert_eq!(back, layout);
        let empty: StepLayout =
            serde_json::from_str(&serde_json::to_string(&StepLayout::default()).unwrap()).unwrap();
        assert_eq!(empty, StepLayout::default());
    }
}
