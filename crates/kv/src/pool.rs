//! The block pool: block ids, reference counts, the LRU free queue and the
//! map from content hash to cached block. Nothing about models, requests or
//! sequences (as vLLM's `block_pool.py` keeps it).
//!
//! # States of a block
//!
//! | refcount | hash | where | name |
//! | --- | --- | --- | --- |
//! | 0 | none | free queue | empty |
//! | 0 | some | free queue | cached, evictable |
//! | > 0 | none | held | used |
//! | > 0 | some | held | used and cached (shareable) |
//!
//! A block is in the free queue exactly when its reference count is 0, so
//! `used + free == total` always holds. Allocation takes the free queue's
//! head; an evictable cached block taken that way loses its hash (an
//! eviction). Freeing a block to refcount 0 puts it back: a cached block at
//! the tail (evicted last: least recently freed goes first), an empty one at
//! the head (it holds nothing worth keeping, so it is reused before any
//! cached block is evicted).

use std::collections::HashMap;
use std::fmt;

use crate::error::{KvError, PoolExhausted};
use crate::hash::BlockHash;

/// The index of one KV block in the pool, `0..total_blocks`.
///
/// The tensor side stores block `i` at row `i` of its pool arrays; token slot
/// `offset` of block `i` is flat slot `i * block_size + offset`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The block's index into the pool, as `usize`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// The "no neighbour" value of the free-queue links.
const NIL: u32 = u32::MAX;

/// Bookkeeping of one block; the free queue is threaded through `prev`/`next`.
#[derive(Debug, Clone)]
struct BlockMeta {
    /// Holders of this block (sequences, each counted once per hold).
    ref_count: u32,
    /// The content hash while the block is registered in the prefix cache.
    hash: Option<BlockHash>,
    /// Previous block in the free queue (towards the head), or `NIL`.
    prev: u32,
    /// Next block in the free queue (towards the tail), or `NIL`.
    next: u32,
}

/// Block counts of a pool at one moment, in blocks. Plain data for stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockCounts {
    /// Blocks in the pool.
    pub total: usize,
    /// Blocks with a reference count above zero (held by some sequence).
    pub used: usize,
    /// Blocks that `allocate` can hand out: empty plus evictable cached.
    /// `used + free == total`.
    pub free: usize,
    /// Blocks carrying a content hash (registered in the prefix cache),
    /// referenced or not. Equals the number of prefix-cache entries.
    pub cached: usize,
    /// Cached blocks with no reference: free, but still hittable until
    /// evicted. `used + evictable` are the blocks holding live or reusable
    /// K/V; when no sequence is live, that is `evictable == cached`.
    pub evictable: usize,
}

/// A fixed set of KV blocks of `block_size` tokens each.
///
/// Single-threaded by design: the engine thread owns it.
#[derive(Debug, Clone)]
pub struct BlockPool {
    /// Tokens per block.
    block_size: usize,
    /// Every block, indexed by [`BlockId`].
    blocks: Vec<BlockMeta>,
    /// Free queue head (allocated, and so evicted, first), or `NIL`.
    head: u32,
    /// Free queue tail (most recently freed cached block), or `NIL`.
    tail: u32,
    /// Blocks in the free queue.
    free_len: usize,
    /// Cached blocks by content hash; each entry's block carries that hash.
    by_hash: HashMap<BlockHash, BlockId>,
    /// Cached blocks whose hash was dropped to reuse them, since creation.
    evictions: u64,
    /// When on ([`BlockPool::log_evictions`]), every block evicted by
    /// `allocate` or `evict_cached` with the hash it had, until taken.
    evicted: Option<Vec<(BlockId, BlockHash)>>,
}

impl BlockPool {
    /// A pool of `num_blocks` empty blocks of `block_size` tokens each, all
    /// in the free queue in id order (block 0 is allocated first).
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if block_size == 0 {
            return Err(KvError::ZeroBlockSize);
        }
        if num_blocks >= NIL as usize {
            return Err(KvError::TooManyBlocks(num_blocks));
        }
        let empty = BlockMeta {
            ref_count: 0,
            hash: None,
            prev: NIL,
            next: NIL,
        };
        let mut pool = BlockPool {
            block_size,
            blocks: vec![empty; num_blocks],
            head: NIL,
            tail: NIL,
            free_len: 0,
            by_hash: HashMap::new(),
            evictions: 0,
            evicted: None,
        };
        for i in 0..num_blocks as u32 {
            pool.push_tail(i);
        }
        Ok(pool)
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks `allocate` can hand out now (empty plus evictable cached).
    pub fn free_blocks(&self) -> usize {
        self.free_len
    }

    /// Blocks referenced by at least one holder.
    pub fn used_blocks(&self) -> usize {
        self.blocks.len() - self.free_len
    }

    /// Blocks registered in the prefix cache (carrying a hash).
    pub fn cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    /// All counts at once. O(total blocks): meant for stats, not the step.
    pub fn counts(&self) -> BlockCounts {
        let evictable = self
            .blocks
            .iter()
            .filter(|b| b.ref_count == 0 && b.hash.is_some())
            .count();
        BlockCounts {
            total: self.total_blocks(),
            used: self.used_blocks(),
            free: self.free_blocks(),
            cached: self.cached_blocks(),
            evictable,
        }
    }

    /// Cached blocks evicted (hash dropped to reuse the block) since creation.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Turns the eviction log on or off (off drops what it held). While
    /// on, every cached block that `allocate` or `evict_cached` evicts is
    /// logged with its hash until [`BlockPool::take_evicted`]: its K/V
    /// stay in the pool arrays until the new holder writes, so the disk
    /// tier can save them first. A reset drops hashes without logging.
    pub fn log_evictions(&mut self, on: bool) {
        self.evicted = on.then(Vec::new);
    }

    /// The blocks evicted since the last call (oldest first), with the
    /// hash each had; empty when the log is off.
    pub fn take_evicted(&mut self) -> Vec<(BlockId, BlockHash)> {
        self.evicted
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Every cached block with its hash (held or not), in no order.
    pub fn cached_entries(&self) -> Vec<(BlockId, BlockHash)> {
        self.by_hash.iter().map(|(&h, &b)| (b, h)).collect()
    }

    /// The reference count of `block`.
    pub fn ref_count(&self, block: BlockId) -> Result<u32, KvError> {
        Ok(self.meta(block)?.ref_count)
    }

    /// The content hash `block` is cached under, if any.
    pub fn hash_of(&self, block: BlockId) -> Result<Option<BlockHash>, KvError> {
        Ok(self.meta(block)?.hash)
    }

    /// The block cached under `hash`, without taking a reference.
    pub fn cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.by_hash.get(&hash).copied()
    }

    /// The free queue from head (allocated first) to tail. O(free blocks);
    /// for tests and debugging.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.free_len);
        let mut at = self.head;
        while at != NIL {
            out.push(BlockId(at));
            at = self.blocks[at as usize].next;
        }
        out
    }

    /// Takes `n` blocks from the head of the free queue, each with reference
    /// count 1 and no hash. A cached block taken this way is evicted: its
    /// hash leaves the map. All or nothing: on error nothing changed.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, PoolExhausted> {
        if n > self.free_len {
            return Err(PoolExhausted {
                requested: n,
                free: self.free_len,
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let meta = &mut self.blocks[id as usize];
            meta.ref_count = 1;
            if let Some(hash) = meta.hash.take() {
                self.by_hash.remove(&hash);
                self.evictions += 1;
                if let Some(log) = &mut self.evicted {
                    log.push((BlockId(id), hash));
                }
            }
            out.push(BlockId(id));
        }
        Ok(out)
    }

    /// Takes one more reference on each block (a prefix-cache hit, or a
    /// sequence sharing another's block). A block at refcount 0 leaves the
    /// free queue. All or nothing: ids are checked first.
    pub fn touch(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        for &b in blocks {
            self.meta(b)?;
        }
        for &b in blocks {
            if self.blocks[b.index()].ref_count == 0 {
                self.unlink(b.0);
            }
            self.blocks[b.index()].ref_count += 1;
        }
        Ok(())
    }

    /// Drops one reference on each block, in the order given. A block that
    /// reaches 0 returns to the free queue: at the tail when cached (so the
    /// first block given here is evicted first among them), at the head when
    /// empty. A sequence passes its blocks last-first so its tail is evicted
    /// before its prefix. All or nothing: the counts are checked first.
    pub fn free(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        self.check_free(blocks)?;
        for &b in blocks {
            let meta = &mut self.blocks[b.index()];
            meta.ref_count -= 1;
            if meta.ref_count == 0 {
                if meta.hash.is_some() {
                    self.push_tail(b.0);
                } else {
                    self.push_head(b.0);
                }
            }
        }
        Ok(())
    }

    /// Registers a referenced, full block under `hash` so lookups can find
    /// it. Returns `Ok(true)` when the block is now the cache entry for
    /// `hash`, `Ok(false)` when another block already holds that entry (this
    /// one stays uncached and is freed normally) or this block already
    /// carries it.
    pub fn register(&mut self, block: BlockId, hash: BlockHash) -> Result<bool, KvError> {
        let meta = self.meta(block)?;
        if meta.ref_count == 0 {
            return Err(KvError::NotReferenced(block));
        }
        match meta.hash {
            Some(h) if h == hash => return Ok(false),
            Some(_) => return Err(KvError::HashMismatch(block)),
            None => {}
        }
        if self.by_hash.contains_key(&hash) {
            return Ok(false);
        }
        self.by_hash.insert(hash, block);
        self.blocks[block.index()].hash = Some(hash);
        Ok(true)
    }

    /// Drops the hash of every cached block nobody references, making them
    /// empty; returns how many. Referenced cached blocks keep their hash (they
    /// become evictable when their holders finish). Idempotent; safe while
    /// sequences run. Empty blocks keep their place in the free queue.
    pub fn reset_prefix_cache(&mut self) -> usize {
        let mut dropped = 0;
        for meta in &mut self.blocks {
            if meta.ref_count == 0 {
                if let Some(hash) = meta.hash.take() {
                    self.by_hash.remove(&hash);
                    dropped += 1;
                }
            }
        }
        dropped
    }

    /// Drops the hash of up to `n` unreferenced cached blocks, least
    /// recently used first (free-queue order), making them empty; returns
    /// how many. Used to bound the prefix cache below the pool size.
    pub fn evict_cached(&mut self, n: usize) -> usize {
        let mut evicted = 0;
        let mut at = self.head;
        while at != NIL && evicted < n {
            let meta = &mut self.blocks[at as usize];
            if let Some(hash) = meta.hash.take() {
                self.by_hash.remove(&hash);
                self.evictions += 1;
                evicted += 1;
                if let Some(log) = &mut self.evicted {
                    log.push((BlockId(at), hash));
                }
            }
            at = meta.next;
        }
        evicted
    }

    /// Verifies the pool's own consistency: the free queue is a well-linked
    /// list of exactly the refcount-0 blocks, and the hash map and the
    /// blocks' hashes agree both ways. O(total blocks).
    pub fn check_invariants(&self) -> Result<(), KvError> {
        let bad = |msg: String| Err(KvError::Invariant(msg));
        let mut seen = vec![false; self.blocks.len()];
        let (mut at, mut prev, mut len) = (self.head, NIL, 0usize);
        while at != NIL {
            let meta = self.blocks.get(at as usize);
            let Some(meta) = meta else {
                return bad(format!("free queue links to missing block {at}"));
            };
            if std::mem::replace(&mut seen[at as usize], true) {
                return bad(format!("free queue visits block {at} twice"));
            }
            if meta.prev != prev || meta.ref_count != 0 {
                return bad(format!("free block {at}: bad back link or refcount"));
            }
            (prev, at, len) = (at, meta.next, len + 1);
        }
        if prev != self.tail || len != self.free_len {
            return bad(format!("free queue length {len} != {}", self.free_len));
        }
        for (i, meta) in self.blocks.iter().enumerate() {
            if (meta.ref_count == 0) != seen[i] {
                return bad(format!("block {i}: refcount 0 iff in the free queue"));
            }
            if let Some(h) = meta.hash {
                if self.by_hash.get(&h) != Some(&BlockId(i as u32)) {
                    return bad(format!("block {i}: hash has no map entry back"));
                }
            }
        }
        for (h, b) in &self.by_hash {
            if self.meta(*b)?.hash != Some(*h) {
                return bad(format!("map entry {h} -> {b} does not match the block"));
            }
        }
        Ok(())
    }

    /// The metadata of `block`, or `UnknownBlock`.
    fn meta(&self, block: BlockId) -> Result<&BlockMeta, KvError> {
        self.blocks.get(block.index()).ok_or(KvError::UnknownBlock {
            block,
            total: self.blocks.len(),
        })
    }

    /// Checks that freeing `blocks` (duplicates included) underflows nothing.
    fn check_free(&self, blocks: &[BlockId]) -> Result<(), KvError> {
        let mut pending: HashMap<BlockId, u32> = HashMap::new();
        for &b in blocks {
            let held = self.meta(b)?.ref_count;
            let n = pending.entry(b).or_insert(0);
            *n += 1;
            if *n > held {
                return Err(KvError::DoubleFree(b));
            }
        }
        Ok(())
    }

    /// Removes block `id` from the free queue.
    fn unlink(&mut self, id: u32) {
        let BlockMeta { prev, next, .. } = self.blocks[id as usize];
        match prev {
            NIL => self.head = next,
            p => self.blocks[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.blocks[n as usize].prev = prev,
        }
        let meta = &mut self.blocks[id as usize];
        (meta.prev, meta.next) = (NIL, NIL);
        self.free_len -= 1;
    }

    /// Appends block `id` (not in the queue) at the free queue's tail.
    fn push_tail(&mut self, id: u32) {
        let old_tail = self.tail;
        (self.blocks[id as usize].prev, self.blocks[id as usize].next) = (old_tail, NIL);
        match old_tail {
            NIL => self.head = id,
            t => self.blocks[t as usize].next = id,
        }
        self.tail = id;
        self.free_len += 1;
    }

    /// Puts block `id` (not in the queue) at the free queue's head.
    fn push_head(&mut self, id: u32) {
        let old_head = self.head;
        (self.blocks[id as usize].prev, self.blocks[id as usize].next) = (NIL, old_head);
        match old_head {
            NIL => self.tail = id,
            h => self.blocks[h as usize].prev = id,
        }
        self.head = id;
        self.free_len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(raw: &[u32]) -> Vec<BlockId> {
        raw.iter().map(|&i| BlockId(i)).collect()
    }

    fn h(n: u128) -> BlockHash {
        BlockHash(n)
    }

    #[test]
    fn rejects_bad_sizes() {
        assert_eq!(BlockPool::new(4, 0).unwrap_err(), KvError::ZeroBlockSize);
        let empty = BlockPool::new(0, 16).unwrap();
        assert_eq!(empty.free_blocks(), 0);
        assert!(empty.check_invariants().is_ok());
    }

    #[test]
    fn allocates_in_id_order_then_exhausts_atomically() {
        let mut pool = BlockPool::new(4, 16).unwrap();
        assert_eq!(pool.allocate(3).unwrap(), ids(&[0, 1, 2]));
        let err = pool.allocate(2).unwrap_err();
        assert_eq!(
            err,
            PoolExhausted {
                requested: 2,
                free: 1
            }
        );
        assert_eq!(pool.free_queue(), ids(&[3]));
        assert_eq!((pool.used_blocks(), pool.free_blocks()), (3, 1));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn empty_blocks_return_to_head_cached_to_tail_in_given_order() {
        let mut pool = BlockPool::new(6, 4).unwrap();
        let a = pool.allocate(4).unwrap(); // 0 1 2 3
        pool.register(a[0], h(10)).unwrap();
        pool.register(a[1], h(11)).unwrap();
        pool.register(a[2], h(12)).unwrap();
        // A sequence frees last-first: 3 (empty) 2 1 0 (cached).
        pool.free(&ids(&[3, 2, 1, 0])).unwrap();
        assert_eq!(pool.free_queue(), ids(&[3, 4, 5, 2, 1, 0]));
        // Empty blocks first, then the sequence's tail, its root last.
        assert_eq!(pool.allocate(4).unwrap(), ids(&[3, 4, 5, 2]));
        assert_eq!(pool.evictions(), 1);
        assert_eq!(pool.cached_block(h(12)), None);
        assert_eq!(pool.cached_block(h(11)), Some(BlockId(1)));
        assert_eq!(pool.hash_of(BlockId(2)).unwrap(), None);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn touch_takes_cached_block_out_of_free_queue() {
        let mut pool = BlockPool::new(3, 4).unwrap();
        let a = pool.allocate(2).unwrap();
        pool.register(a[0], h(1)).unwrap();
        pool.register(a[1], h(2)).unwrap();
        pool.free(&ids(&[1, 0])).unwrap();
        assert_eq!(pool.free_queue(), ids(&[2, 1, 0]));
        // A hit on the middle of the queue.
        pool.touch(&[BlockId(1)]).unwrap();
        assert_eq!(pool.ref_count(BlockId(1)).unwrap(), 1);
        assert_eq!(pool.free_queue(), ids(&[2, 0]));
        // Touching a held block shares it.
        pool.touch(&[BlockId(1)]).unwrap();
        assert_eq!(pool.ref_count(BlockId(1)).unwrap(), 2);
        pool.free(&[BlockId(1)]).unwrap();
        assert_eq!(pool.free_queue(), ids(&[2, 0]));
        pool.free(&[BlockId(1)]).unwrap();
        // Back at the tail: freed most recently, evicted last.
        assert_eq!(pool.free_queue(), ids(&[2, 0, 1]));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn free_is_checked_and_atomic() {
        let mut pool = BlockPool::new(2, 4).unwrap();
        let a = pool.allocate(1).unwrap();
        assert_eq!(
            pool.free(&[a[0], a[0]]).unwrap_err(),
            KvError::DoubleFree(a[0])
        );
        assert_eq!(pool.ref_count(a[0]).unwrap(), 1);
        assert!(matches!(
            pool.free(&[BlockId(9)]).unwrap_err(),
            KvError::UnknownBlock { .. }
        ));
        assert_eq!(
            pool.free(&[BlockId(1)]).unwrap_err(),
            KvError::DoubleFree(BlockId(1))
        );
        pool.check_invariants().unwrap();
    }

    #[test]
    fn register_rules() {
        let mut pool = BlockPool::new(3, 4).unwrap();
        let a = pool.allocate(2).unwrap();
        assert!(pool.register(a[0], h(5)).unwrap());
        assert!(!pool.register(a[0], h(5)).unwrap(), "already carries it");
        assert!(
            !pool.register(a[1], h(5)).unwrap(),
            "duplicate stays uncached"
        );
        assert_eq!(pool.hash_of(a[1]).unwrap(), None);
        assert_eq!(
            pool.register(a[0], h(6)).unwrap_err(),
            KvError::HashMismatch(a[0])
        );
        assert_eq!(
            pool.register(BlockId(2), h(7)).unwrap_err(),
            KvError::NotReferenced(BlockId(2))
        );
        pool.check_invariants().unwrap();
    }

    #[test]
    fn reset_frees_exactly_unreferenced_cached_blocks() {
        let mut pool = BlockPool::new(5, 4).unwrap();
        let a = pool.allocate(4).unwrap();
        for (i, &b) in a.iter().enumerate() {
            pool.register(b, h(i as u128 + 100)).unwrap();
        }
        pool.free(&ids(&[3, 2])).unwrap(); // 2 and 3 evictable; 0, 1 held
        let before = pool.counts();
        assert_eq!((before.cached, before.evictable, before.used), (4, 2, 2));
        assert_eq!(pool.reset_prefix_cache(), 2);
        assert_eq!(pool.reset_prefix_cache(), 0, "idempotent");
        let after = pool.counts();
        assert_eq!((after.cached, after.evictable, after.used), (2, 0, 2));
        assert_eq!(pool.cached_block(h(100)), Some(BlockId(0)));
        assert_eq!(pool.cached_block(h(102)), None);
        pool.free(&ids(&[1, 0])).unwrap();
        assert_eq!(pool.reset_prefix_cache(), 2);
        let end = pool.counts();
        assert_eq!((end.used, end.free, end.cached), (0, 5, 0));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn the_eviction_log_names_each_evicted_block_with_its_hash() {
        let mut pool = BlockPool::new(4, 2).unwrap();
        let a = pool.allocate(3).unwrap();
        for (i, &b) in a.iter().enumerate() {
            pool.register(b, h(i as u128 + 1)).unwrap();
        }
        pool.free(&a).unwrap();
        // Off: nothing is logged.
        assert_eq!(pool.allocate(2).unwrap(), ids(&[3, 0]));
        assert!(pool.take_evicted().is_empty());
        pool.log_evictions(true);
        assert_eq!(pool.allocate(1).unwrap(), ids(&[1]));
        assert_eq!(pool.evict_cached(5), 1);
        assert_eq!(
            pool.take_evicted(),
            vec![(BlockId(1), h(2)), (BlockId(2), h(3))]
        );
        assert!(pool.take_evicted().is_empty(), "taken once");
        // A reset drops hashes without logging them.
        let b = pool.allocate(1).unwrap();
        pool.register(b[0], h(9)).unwrap();
        assert_eq!(pool.cached_entries(), vec![(b[0], h(9))]);
        pool.free(&b).unwrap();
        assert_eq!(pool.reset_prefix_cache(), 1);
        assert!(pool.take_evicted().is_empty());
        pool.check_invariants().unwrap();
    }
}
