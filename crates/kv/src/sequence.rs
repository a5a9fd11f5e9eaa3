//! One sequence's block table: the absolute positions `[start, end)` it holds
//! K/V for and the blocks that hold them (docs/architecture.md, invariant 1).
//!
//! Position `p` lives in logical block `p / block_size` at offset
//! `p % block_size`. The table holds the logical blocks from
//! `start / block_size` up to the one holding `end - 1`, none when empty.
//! The length is `end - start`, derived. Growing is [`SequenceBlocks::append_slots`];
//! shrinking is [`SequenceBlocks::truncate_tail`] (rewind) and
//! [`SequenceBlocks::drop_front`] (window), each the only function for its
//! direction, moving positions and blocks together.
//!
//! A block that is shared (refcount above 1) or cached (carrying a hash) is
//! never written: before the first write into such a partial last block,
//! [`SequenceBlocks::prepare_write`] swaps in a private copy and says which
//! copy the tensor side must make.

use std::collections::HashSet;

use crate::error::KvError;
use crate::pool::{BlockId, BlockPool};

/// Where one token's K/V is written: a block and a token offset inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// The block.
    pub block: BlockId,
    /// Offset inside the block, in tokens, `0..block_size`.
    pub offset: usize,
}

impl Slot {
    /// The slot's index in a pool laid out as `total_blocks * block_size`
    /// token rows.
    pub fn flat_index(self, block_size: usize) -> usize {
        self.block.index() * block_size + self.offset
    }
}

/// A copy the tensor side must make before writing: the first `tokens` token
/// slots of `src` into `dst` (copy-on-write of a shared or cached partial
/// block). `dst` then replaces `src` in the sequence's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    /// The shared or cached block; other holders keep it unchanged.
    pub src: BlockId,
    /// The sequence's new private block.
    pub dst: BlockId,
    /// Leading token slots that hold live K/V, `1..block_size`.
    pub tokens: usize,
}

/// What [`SequenceBlocks::append_slots`] asks the tensor side to do, in order:
/// make `copy` (if any), then write the new tokens' K/V into `slots`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Appended {
    /// A copy-on-write to make before any slot is written.
    pub copy: Option<BlockCopy>,
    /// One slot per appended token, in position order.
    pub slots: Vec<Slot>,
}

/// One sequence's positions and block table over a [`BlockPool`].
///
/// The sequence owns one reference on each block in its table. It must be
/// given back with [`SequenceBlocks::release`] (or shrunk to empty) on the
/// pool it was built on; dropping it without that leaks its blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceBlocks {
    /// Tokens per block, copied from the pool.
    block_size: usize,
    /// First live position (absolute, tokens).
    start: usize,
    /// One past the last live position (absolute, tokens).
    end: usize,
    /// Blocks for logical blocks `start / block_size ..`, in order.
    blocks: Vec<BlockId>,
}

impl SequenceBlocks {
    /// An empty sequence at `[0, 0)`, holding no block.
    pub fn new(pool: &BlockPool) -> Self {
        SequenceBlocks {
            block_size: pool.block_size(),
            start: 0,
            end: 0,
            blocks: Vec::new(),
        }
    }

    /// A sequence made of full cached blocks from a prefix-cache hit,
    /// covering `[0, blocks.len() * block_size)`. The caller's references on
    /// `blocks` (taken by the lookup) pass to the sequence.
    pub fn from_prefix(pool: &BlockPool, blocks: Vec<BlockId>) -> Self {
        let seq = SequenceBlocks {
            block_size: pool.block_size(),
            start: 0,
            end: blocks.len() * pool.block_size(),
            blocks,
        };
        seq.debug_check();
        seq
    }

    /// A sequence made of full cached blocks holding logical blocks
    /// `first..first + blocks.len()` (a window group's part of a prefix
    /// hit), covering `[first * block_size, (first + blocks.len()) *
    /// block_size)`; empty at `[first * block_size, ..)` without blocks.
    /// The caller's references on `blocks` pass to the sequence.
    pub fn from_prefix_at(pool: &BlockPool, first: usize, blocks: Vec<BlockId>) -> Self {
        let bs = pool.block_size();
        let seq = SequenceBlocks {
            block_size: bs,
            start: first * bs,
            end: (first + blocks.len()) * bs,
            blocks,
        };
        seq.debug_check();
        seq
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The first live position (absolute, tokens).
    pub fn start(&self) -> usize {
        self.start
    }

    /// One past the last live position (absolute, tokens): the position the
    /// next appended token gets (its RoPE position).
    pub fn end(&self) -> usize {
        self.end
    }

    /// Live tokens, `end - start`: the key count attention sees.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether no position is live.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The block table, first held logical block first.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// The logical index (`position / block_size`) of `blocks()[0]`.
    pub fn first_logical_block(&self) -> usize {
        self.start / self.block_size
    }

    /// Where the K/V of live position `pos` is, or `None` outside `[start, end)`.
    pub fn slot_of(&self, pos: usize) -> Option<Slot> {
        if !(self.start..self.end).contains(&pos) {
            return None;
        }
        let block = self.blocks[pos / self.block_size - self.first_logical_block()];
        Some(Slot {
            block,
            offset: pos % self.block_size,
        })
    }

    /// A second holder of the same positions and blocks (each block's
    /// refcount goes up by one); the first write of either into a shared
    /// partial block copies it.
    pub fn fork(&self, pool: &mut BlockPool) -> Result<Self, KvError> {
        self.check_pool(pool)?;
        pool.touch(&self.blocks)?;
        Ok(self.clone())
    }

    /// Makes the last block private if the next append would write into it
    /// while it is shared or cached: allocates a new block, swaps it into the
    /// table, drops this sequence's reference on the old one, and returns the
    /// copy to make. `None` when the next write needs no copy.
    pub fn prepare_write(&mut self, pool: &mut BlockPool) -> Result<Option<BlockCopy>, KvError> {
        self.check_pool(pool)?;
        if !self.needs_copy(pool)? {
            return Ok(None);
        }
        let dst = pool.allocate(1)?[0];
        let copy = self.swap_last(pool, dst)?;
        self.debug_check();
        Ok(Some(copy))
    }

    /// Reserves slots for `n` new tokens at positions `[end, end + n)`:
    /// copy-on-write of the last block when needed, new blocks as positions
    /// cross block boundaries. All or nothing: on error (e.g. the pool is
    /// exhausted) nothing changed.
    pub fn append_slots(&mut self, pool: &mut BlockPool, n: usize) -> Result<Appended, KvError> {
        self.check_pool(pool)?;
        if n == 0 {
            return Ok(Appended::default());
        }
        let copy_needed = self.needs_copy(pool)?;
        let new_blocks = self.blocks_for(self.start, self.end + n) - self.blocks.len();
        let mut fresh = pool.allocate(new_blocks + usize::from(copy_needed))?;
        let copy = if copy_needed {
            Some(self.swap_last(pool, fresh.remove(0))?)
        } else {
            None
        };
        self.blocks.extend(fresh);
        let (from, to) = (self.end, self.end + n);
        self.end = to;
        let slots = (from..to).filter_map(|p| self.slot_of(p)).collect();
        self.debug_check();
        Ok(Appended { copy, slots })
    }

    /// Rewinds the tail to `new_end` (`start <= new_end <= end`): frees the
    /// whole blocks past it, last block first. A partial last block that is
    /// shared or cached is kept as is; the next write copies it.
    pub fn truncate_tail(&mut self, pool: &mut BlockPool, new_end: usize) -> Result<(), KvError> {
        self.check_pool(pool)?;
        self.check_bound(new_end)?;
        let keep = self.blocks_for(self.start, new_end);
        let mut freed = self.blocks[keep..].to_vec();
        freed.reverse();
        pool.free(&freed)?;
        self.blocks.truncate(keep);
        self.end = new_end;
        self.debug_check();
        Ok(())
    }

    /// Drops the front to `new_start` (`start <= new_start <= end`): frees
    /// the blocks that hold only positions before it, later block first.
    /// Positions keep their absolute values (RoPE is unchanged).
    pub fn drop_front(&mut self, pool: &mut BlockPool, new_start: usize) -> Result<(), KvError> {
        self.check_pool(pool)?;
        self.check_bound(new_start)?;
        let drop = self.blocks.len() - self.blocks_for(new_start, self.end);
        let mut freed = self.blocks[..drop].to_vec();
        freed.reverse();
        pool.free(&freed)?;
        self.blocks.drain(..drop);
        self.start = new_start;
        self.debug_check();
        Ok(())
    }

    /// Swaps the full block at table index `index` for `with`, a block
    /// holding the same tokens (a prefix-cache entry another sequence
    /// computed): takes a reference on `with`, drops the one on the old
    /// block. Positions don't move. The last block, when partial, can't be
    /// swapped (it will still be written).
    pub fn replace_block(
        &mut self,
        pool: &mut BlockPool,
        index: usize,
        with: BlockId,
    ) -> Result<(), KvError> {
        self.check_pool(pool)?;
        let block_end = (self.first_logical_block() + index + 1) * self.block_size;
        if index >= self.blocks.len() || block_end > self.end {
            return Err(KvError::Invariant(format!(
                "block {index} of [{}, {}) is not a full block",
                self.start, self.end
            )));
        }
        let old = self.blocks[index];
        if old == with {
            return Ok(());
        }
        pool.touch(&[with])?;
        self.blocks[index] = with;
        pool.free(&[old])?;
        self.debug_check();
        Ok(())
    }

    /// Gives every block back (tail first); the sequence is left empty at
    /// `[start, start)`. Idempotent.
    pub fn release(&mut self, pool: &mut BlockPool) -> Result<(), KvError> {
        self.truncate_tail(pool, self.start)
    }

    /// Verifies the table against the positions: as many blocks as the range
    /// `[start, end)` spans, no block twice. O(blocks).
    pub fn check_invariants(&self) -> Result<(), KvError> {
        let bad = |msg: String| Err(KvError::Invariant(msg));
        if self.start > self.end {
            return bad(format!("start {} > end {}", self.start, self.end));
        }
        let want = self.blocks_for(self.start, self.end);
        if self.blocks.len() != want {
            return bad(format!(
                "[{}, {}) needs {want} blocks of {}, table has {}",
                self.start,
                self.end,
                self.block_size,
                self.blocks.len()
            ));
        }
        let mut seen = HashSet::with_capacity(self.blocks.len());
        if let Some(b) = self.blocks.iter().find(|b| !seen.insert(**b)) {
            return bad(format!("block {b} held twice"));
        }
        Ok(())
    }

    /// Blocks spanned by positions `[from, to)`; none when empty.
    fn blocks_for(&self, from: usize, to: usize) -> usize {
        if to > from {
            to.div_ceil(self.block_size) - from / self.block_size
        } else {
            0
        }
    }

    /// Whether the next write lands in a partial last block that others share
    /// or the cache describes.
    fn needs_copy(&self, pool: &BlockPool) -> Result<bool, KvError> {
        let Some(&last) = self.blocks.last() else {
            return Ok(false);
        };
        if self.end.is_multiple_of(self.block_size) {
            return Ok(false);
        }
        Ok(pool.ref_count(last)? > 1 || pool.hash_of(last)?.is_some())
    }

    /// Replaces the last block by `dst` (already referenced by us) and drops
    /// our reference on the old one.
    fn swap_last(&mut self, pool: &mut BlockPool, dst: BlockId) -> Result<BlockCopy, KvError> {
        let last = self.blocks.len() - 1;
        let src = std::mem::replace(&mut self.blocks[last], dst);
        pool.free(&[src])?;
        Ok(BlockCopy {
            src,
            dst,
            tokens: self.end % self.block_size,
        })
    }

    /// `PositionOutOfRange` unless `start <= pos <= end`.
    fn check_bound(&self, pos: usize) -> Result<(), KvError> {
        if (self.start..=self.end).contains(&pos) {
            return Ok(());
        }
        Err(KvError::PositionOutOfRange {
            requested: pos,
            start: self.start,
            end: self.end,
        })
    }

    /// `BlockSizeMismatch` when `pool` is not the kind this sequence was built on.
    fn check_pool(&self, pool: &BlockPool) -> Result<(), KvError> {
        if pool.block_size() == self.block_size {
            return Ok(());
        }
        Err(KvError::BlockSizeMismatch {
            sequence: self.block_size,
            pool: pool.block_size(),
        })
    }

    /// Runs [`SequenceBlocks::check_invariants`] in debug builds.
    fn debug_check(&self) {
        debug_assert_eq!(self.check_invariants(), Ok(()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(raw: &[u32]) -> Vec<BlockId> {
        raw.iter().map(|&i| BlockId(i)).collect()
    }

    fn slot(block: u32, offset: usize) -> Slot {
        Slot {
            block: BlockId(block),
            offset,
        }
    }

    #[test]
    fn append_crosses_block_boundaries() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut seq = SequenceBlocks::new(&pool);
        let a = seq.append_slots(&mut pool, 6).unwrap();
        assert_eq!(a.copy, None);
        assert_eq!(
            a.slots,
            vec![
                slot(0, 0),
                slot(0, 1),
                slot(0, 2),
                slot(0, 3),
                slot(1, 0),
                slot(1, 1)
            ]
        );
        let b = seq.append_slots(&mut pool, 3).unwrap();
        assert_eq!(b.slots, vec![slot(1, 2), slot(1, 3), slot(2, 0)]);
        assert_eq!((seq.start(), seq.end(), seq.len()), (0, 9, 9));
        assert_eq!(seq.blocks(), ids(&[0, 1, 2]));
        assert_eq!(seq.slot_of(5), Some(slot(1, 1)));
        assert_eq!(seq.slot_of(9), None);
        assert_eq!(slot(2, 1).flat_index(4), 9);
        seq.release(&mut pool).unwrap();
        assert_eq!(pool.used_blocks(), 0);
    }

    #[test]
    fn exhausted_append_changes_nothing() {
        let mut pool = BlockPool::new(2, 4).unwrap();
        let mut seq = SequenceBlocks::new(&pool);
        seq.append_slots(&mut pool, 5).unwrap();
        let before = seq.clone();
        let err = seq.append_slots(&mut pool, 4).unwrap_err();
        assert!(matches!(err, KvError::PoolExhausted(_)));
        assert_eq!(seq, before);
        assert_eq!(pool.free_blocks(), 0);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn truncate_tail_frees_whole_blocks_past_new_end_tail_first() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut seq = SequenceBlocks::new(&pool);
        seq.append_slots(&mut pool, 13).unwrap(); // blocks 0..=3
        seq.truncate_tail(&mut pool, 5).unwrap();
        assert_eq!(seq.blocks(), ids(&[0, 1]));
        assert_eq!(seq.len(), 5);
        // Empty blocks return to the head; 3 was freed first, then 2.
        assert_eq!(pool.free_queue(), ids(&[2, 3, 4, 5, 6, 7]));
        // The next token goes right after position 4, in block 1.
        assert_eq!(
            seq.append_slots(&mut pool, 1).unwrap().slots,
            vec![slot(1, 1)]
        );
        seq.truncate_tail(&mut pool, 4).unwrap();
        assert_eq!(seq.blocks(), ids(&[0]));
        assert_eq!(
            seq.truncate_tail(&mut pool, 5).unwrap_err(),
            KvError::PositionOutOfRange {
                requested: 5,
                start: 0,
                end: 4
            }
        );
        seq.release(&mut pool).unwrap();
        seq.release(&mut pool).unwrap();
        assert_eq!((seq.len(), pool.used_blocks()), (0, 0));
    }

    #[test]
    fn drop_front_frees_blocks_before_new_start() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut seq = SequenceBlocks::new(&pool);
        seq.append_slots(&mut pool, 10).unwrap(); // [0,10) in 0 1 2
        seq.drop_front(&mut pool, 3).unwrap();
        assert_eq!((seq.blocks(), seq.len()), (&ids(&[0, 1, 2])[..], 7));
        seq.drop_front(&mut pool, 8).unwrap();
        assert_eq!(seq.blocks(), ids(&[2]));
        assert_eq!(
            (seq.start(), seq.end(), seq.first_logical_block()),
            (8, 10, 2)
        );
        assert_eq!(seq.slot_of(9), Some(slot(2, 1)));
        assert_eq!(seq.slot_of(7), None);
        // Positions stay absolute: the next token is position 10.
        let a = seq.append_slots(&mut pool, 3).unwrap();
        // Freed empty blocks went to the head of the free queue: 0 is reused.
        assert_eq!(a.slots, vec![slot(2, 2), slot(2, 3), slot(0, 0)]);
        // Dropping everything frees every block; appending starts afresh.
        seq.drop_front(&mut pool, 13).unwrap();
        assert!(seq.is_empty() && seq.blocks().is_empty());
        let b = seq.append_slots(&mut pool, 1).unwrap();
        assert_eq!(b.slots, vec![slot(2, 1)]);
        assert_eq!(seq.first_logical_block(), 3);
        seq.release(&mut pool).unwrap();
        assert_eq!(pool.used_blocks(), 0);
    }

    #[test]
    fn forked_partial_block_is_copied_on_write() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut a = SequenceBlocks::new(&pool);
        a.append_slots(&mut pool, 6).unwrap(); // blocks 0, 1 (partial)
        let mut b = a.fork(&mut pool).unwrap();
        assert_eq!(pool.ref_count(BlockId(1)).unwrap(), 2);
        // b writes position 6: block 1 is shared, so it is copied to block 2.
        let w = b.append_slots(&mut pool, 1).unwrap();
        let copy = BlockCopy {
            src: BlockId(1),
            dst: BlockId(2),
            tokens: 2,
        };
        assert_eq!(w.copy, Some(copy));
        assert_eq!(w.slots, vec![slot(2, 2)]);
        assert_eq!(b.blocks(), ids(&[0, 2]));
        assert_eq!(pool.ref_count(BlockId(1)).unwrap(), 1);
        // a now holds block 1 alone: it writes in place.
        let v = a.append_slots(&mut pool, 1).unwrap();
        assert_eq!((v.copy, v.slots), (None, vec![slot(1, 2)]));
        // The full shared block 0 is never copied.
        assert_eq!(pool.ref_count(BlockId(0)).unwrap(), 2);
        a.release(&mut pool).unwrap();
        b.release(&mut pool).unwrap();
        assert_eq!(pool.used_blocks(), 0);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn rewound_cached_block_is_copied_not_written() {
        let mut pool = BlockPool::new(4, 4).unwrap();
        let mut seq = SequenceBlocks::new(&pool);
        seq.append_slots(&mut pool, 4).unwrap();
        pool.register(BlockId(0), crate::hash::BlockHash(42))
            .unwrap();
        // Recompute the last token of a fully cached prompt: rewind by one.
        seq.truncate_tail(&mut pool, 3).unwrap();
        assert_eq!(seq.blocks(), ids(&[0]));
        let copy = seq.prepare_write(&mut pool).unwrap();
        assert_eq!(
            copy,
            Some(BlockCopy {
                src: BlockId(0),
                dst: BlockId(1),
                tokens: 3
            })
        );
        assert_eq!(seq.prepare_write(&mut pool).unwrap(), None, "now private");
        // The cached block stays cached and evictable, nobody writes it.
        assert_eq!(pool.ref_count(BlockId(0)).unwrap(), 0);
        assert_eq!(
            pool.cached_block(crate::hash::BlockHash(42)),
            Some(BlockId(0))
        );
        let w = seq.append_slots(&mut pool, 1).unwrap();
        assert_eq!((w.copy, w.slots), (None, vec![slot(1, 3)]));
        seq.release(&mut pool).unwrap();
        pool.check_invariants().unwrap();
    }

    #[test]
    fn rejects_a_pool_of_another_block_size() {
        let pool4 = BlockPool::new(2, 4).unwrap();
        let mut pool8 = BlockPool::new(2, 8).unwrap();
        let mut seq = SequenceBlocks::new(&pool4);
        assert_eq!(
            seq.append_slots(&mut pool8, 1).unwrap_err(),
            KvError::BlockSizeMismatch {
                sequence: 4,
                pool: 8
            }
        );
    }
}
