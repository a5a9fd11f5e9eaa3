//! The prefix cache: full blocks named by their chained hash, looked up by
//! longest prefix, donated by sequences, evicted least recently used by the
//! pool when it needs room.
//!
//! The cache holds no references of its own. A cached block nobody holds sits
//! in the pool's free queue with its hash: hittable until `allocate` reaches
//! it. So invariant 7 reads, in [`crate::BlockCounts`]: with no live
//! sequence, `used == 0` and every non-empty block is `evictable`; after
//! [`crate::BlockPool::reset_prefix_cache`], `cached == 0` too.

use crate::error::KvError;
use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool};
use crate::sequence::SequenceBlocks;

/// A prefix-cache hit over KV groups ([`PrefixCache::lookup_groups`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupHit {
    /// Prompt tokens whose K/V the hit holds, in tokens: `m * block_size`,
    /// or the prompt length minus one when the `m` blocks cover it all; 0
    /// on a miss.
    pub cached: usize,
    /// Per group: the logical index (`position / block_size`) of its first
    /// block, and its blocks (one reference each, taken for the caller).
    pub groups: Vec<(usize, Vec<BlockId>)>,
    /// Per group: the first position its sequence keeps ([`hold_from`]).
    pub start: Vec<usize>,
    /// Chained hashes of the prompt's full blocks from position 0 (at least
    /// `cached / block_size` of them).
    pub hashes: Vec<BlockHash>,
}

/// The first position a KV group keeping `keep` keys (`None`: all) must
/// hold for a sequence that resumes at position `cached`, its prompt run in
/// chunks ending at multiples of `chunk` tokens: a cold run trims to `keep`
/// keys after each chunk, so at the last chunk boundary `b <= cached` it
/// holds `[b - keep, b)`, and the chunk it then runs reads those keys.
pub fn hold_from(cached: usize, keep: Option<usize>, chunk: usize) -> usize {
    let chunk = chunk.max(1);
    match keep {
        None => 0,
        Some(k) => (cached / chunk * chunk).saturating_sub(k),
    }
}

/// Extends `hashes`, the chain of full blocks from position 0, to the
/// `end / block_size` full blocks of `tokens`.
///
/// # Errors
/// Fewer than `end` tokens.
pub(crate) fn extend_hashes(
    hashes: &mut Vec<BlockHash>,
    tokens: &[u32],
    end: usize,
    block_size: usize,
    extra_key: u64,
) -> Result<(), KvError> {
    if tokens.len() < end {
        return Err(KvError::TooFewTokens {
            needed: end,
            got: tokens.len(),
        });
    }
    let mut scratch = Vec::new();
    while hashes.len() < end / block_size {
        let i = hashes.len();
        let block = &tokens[i * block_size..(i + 1) * block_size];
        let hash = BlockHash::chained_with(&mut scratch, hashes.last().copied(), block, extra_key);
        hashes.push(hash);
    }
    Ok(())
}

/// Prefix-cache counters since start, plain data for `/v1/cache/stats` and
/// `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCacheStats {
    /// Calls to [`PrefixCache::lookup`].
    pub lookups: u64,
    /// Lookups that found at least one cached block.
    pub hits: u64,
    /// Lookups that found none.
    pub misses: u64,
    /// Prompt tokens looked up, in tokens (hit rate by tokens:
    /// `tokens_reused / tokens_queried`).
    pub tokens_queried: u64,
    /// Tokens covered by the blocks lookups returned, in tokens.
    pub tokens_reused: u64,
    /// Blocks newly registered by [`PrefixCache::insert`].
    pub inserts: u64,
    /// Cached blocks evicted by the pool to reuse them.
    pub evictions: u64,
}

/// Longest-prefix lookup and donation over a [`BlockPool`]'s hash map, plus
/// the counters. Stateless apart from the counters: the pool holds the map.
#[derive(Debug, Clone, Default)]
pub struct PrefixCache {
    /// Counters this type moves (`evictions` is read from the pool).
    counts: PrefixCacheStats,
}

impl PrefixCache {
    /// A cache with all counters at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// The cached blocks holding the longest run of FULL blocks of `tokens`
    /// (which start at position 0), under `extra_key`; takes one reference
    /// on each for the caller (see [`SequenceBlocks::from_prefix`]). They
    /// cover `blocks.len() * block_size` tokens, possibly all of `tokens`: to
    /// compute the last prompt token's logits the caller then rewinds one
    /// token, and the next write copies the shared last block.
    pub fn lookup(
        &mut self,
        pool: &mut BlockPool,
        tokens: &[u32],
        extra_key: u64,
    ) -> Result<Vec<BlockId>, KvError> {
        let mut scratch = Vec::new();
        let mut parent = None;
        let mut found = Vec::new();
        for block in tokens.chunks_exact(pool.block_size()) {
            let hash = BlockHash::chained_with(&mut scratch, parent, block, extra_key);
            let Some(id) = pool.cached_block(hash) else {
                break;
            };
            found.push(id);
            parent = Some(hash);
        }
        pool.touch(&found)?;
        let reused = found.len() * pool.block_size();
        self.counts.lookups += 1;
        if found.is_empty() {
            self.counts.misses += 1;
        } else {
            self.counts.hits += 1;
        }
        self.counts.tokens_queried += tokens.len() as u64;
        self.counts.tokens_reused += reused as u64;
        Ok(found)
    }

    /// Registers the full blocks of `seq` under their chained hashes, so
    /// later lookups hit them; returns how many blocks were newly cached.
    ///
    /// `tokens` are the sequence's token ids from position 0 (at least
    /// `seq.end()` of them). Call it only for positions whose K/V the step
    /// has written; calling it again after more tokens is cheap and
    /// registers only the new full blocks, so running prompts share their
    /// blocks early, and a finishing sequence donates before it is released.
    /// A sequence whose front was dropped (`start > 0`) donates nothing: its
    /// chain no longer starts at position 0. A block whose content is
    /// already cached in another block stays uncached.
    pub fn insert(
        &mut self,
        pool: &mut BlockPool,
        seq: &SequenceBlocks,
        tokens: &[u32],
        extra_key: u64,
    ) -> Result<usize, KvError> {
        if tokens.len() < seq.end() {
            return Err(KvError::TooFewTokens {
                needed: seq.end(),
                got: tokens.len(),
            });
        }
        if seq.start() > 0 {
            return Ok(0);
        }
        let mut scratch = Vec::new();
        let mut parent = None;
        let mut added = 0;
        let full = tokens[..seq.end()].chunks_exact(pool.block_size());
        for (block, &id) in full.zip(seq.blocks()) {
            let hash = BlockHash::chained_with(&mut scratch, parent, block, extra_key);
            added += usize::from(pool.register(id, hash)?);
            parent = Some(hash);
        }
        self.counts.inserts += added as u64;
        Ok(added)
    }

    /// Registers the full blocks of `seq` past the `hashes` already known
    /// (the chain of its full blocks from position 0, extended here from
    /// `tokens`), so later lookups hit them. A block whose content another
    /// block already caches (computed concurrently by another sequence) is
    /// swapped for that block, so concurrent prompts sharing a prefix end up
    /// holding one copy. After a front drop the chain still starts at
    /// position 0 (hashes need only tokens); blocks no longer held are
    /// skipped. Returns (blocks newly cached, blocks swapped for shared ones).
    ///
    /// # Errors
    /// Fewer `tokens` than `seq.end()`, or a pool inconsistency.
    pub fn donate(
        &mut self,
        pool: &mut BlockPool,
        seq: &mut SequenceBlocks,
        hashes: &mut Vec<BlockHash>,
        tokens: &[u32],
        extra_key: u64,
    ) -> Result<(usize, usize), KvError> {
        let from = hashes.len();
        extend_hashes(hashes, tokens, seq.end(), pool.block_size(), extra_key)?;
        self.register_blocks(pool, seq, hashes, from)
    }

    /// Registers `seq`'s full blocks of logical indices `from..` under
    /// `hashes` (the chain from position 0; see [`PrefixCache::donate`],
    /// which computes them): one KV group's share of a donation, every
    /// group registering its blocks under the same hashes. Returns (newly
    /// cached, swapped for shared).
    ///
    /// # Errors
    /// A pool inconsistency.
    pub fn register_blocks(
        &mut self,
        pool: &mut BlockPool,
        seq: &mut SequenceBlocks,
        hashes: &[BlockHash],
        from: usize,
    ) -> Result<(usize, usize), KvError> {
        let first = seq.first_logical_block();
        let full = hashes.len().min(seq.end() / pool.block_size());
        let (mut added, mut shared) = (0, 0);
        for (i, &hash) in hashes.iter().enumerate().take(full).skip(from) {
            let Some(&id) = i.checked_sub(first).and_then(|t| seq.blocks().get(t)) else {
                continue;
            };
            match pool.cached_block(hash) {
                Some(other) if other != id => {
                    seq.replace_block(pool, i - first, other)?;
                    shared += 1;
                }
                Some(_) => {}
                None => added += usize::from(pool.register(id, hash)?),
            }
        }
        self.counts.inserts += added as u64;
        Ok((added, shared))
    }

    /// The longest prompt prefix that every KV group can serve from its
    /// pool (docs/architecture.md, "KV groups"): `pools[g]` is group `g`'s
    /// pool, `keeps[g]` the keys it keeps between steps (`None`: all). A
    /// hit of `m` full blocks resumes the prompt at `cached = m *
    /// block_size` (one less when it covers the whole prompt: the last
    /// token is recomputed for its logits). A group keeping every key needs
    /// blocks `0..m`; a group keeping `k` keys needs only the blocks from
    /// [`hold_from`]`(cached, k, chunk)` on, the keys a cold run holds at
    /// the last chunk boundary before `cached` (chunks end at multiples of
    /// `chunk`). The hit is the largest `m` for which every group holds
    /// every block it needs; one reference is taken on each for the
    /// caller, none on blocks a group doesn't need. With one group that
    /// keeps every key this is [`PrefixCache::lookup`].
    ///
    /// Rule taken from vLLM's hybrid KV cache manager (the full-attention
    /// group's hit bounds the sliding-window groups' search), rewritten
    /// for block tables that start mid-sequence.
    ///
    /// # Errors
    /// `pools` and `keeps` of different lengths, no group, pools of
    /// different block sizes, or a pool inconsistency.
    pub fn lookup_groups(
        &mut self,
        pools: &mut [&mut BlockPool],
        keeps: &[Option<usize>],
        tokens: &[u32],
        extra_key: u64,
        chunk: usize,
    ) -> Result<GroupHit, KvError> {
        self.lookup_groups_where(pools, keeps, tokens, extra_key, chunk, &|_, _| true)
    }

    /// [`PrefixCache::lookup_groups`] where a hit of `m` blocks must also
    /// satisfy `resumable(m, hashes)` (`hashes`: the prompt's chained block
    /// hashes): a model with recurrent layers resumes only where a state
    /// snapshot is kept.
    ///
    /// # Errors
    /// As [`PrefixCache::lookup_groups`].
    pub fn lookup_groups_where(
        &mut self,
        pools: &mut [&mut BlockPool],
        keeps: &[Option<usize>],
        tokens: &[u32],
        extra_key: u64,
        chunk: usize,
        resumable: &dyn Fn(usize, &[BlockHash]) -> bool,
    ) -> Result<GroupHit, KvError> {
        let bs = match pools.first() {
            Some(p) if pools.len() == keeps.len() => p.block_size(),
            _ => {
                return Err(KvError::Invariant(format!(
                    "{} pools for {} KV groups",
                    pools.len(),
                    keeps.len()
                )))
            }
        };
        if pools.iter().any(|p| p.block_size() != bs) {
            return Err(KvError::Invariant(
                "KV groups of different block sizes".into(),
            ));
        }
        let mut hashes = Vec::with_capacity(tokens.len() / bs);
        extend_hashes(&mut hashes, tokens, tokens.len(), bs, extra_key)?;
        // Groups that keep every key bound the hit by their longest prefix.
        let mut n = hashes.len();
        for (pool, keep) in pools.iter().zip(keeps) {
            if keep.is_none() {
                let run = hashes
                    .iter()
                    .take_while(|&&h| pool.cached_block(h).is_some())
                    .count();
                n = n.min(run);
            }
        }
        let cached_for = |m: usize| {
            if m * bs >= tokens.len() {
                tokens.len().saturating_sub(1)
            } else {
                m * bs
            }
        };
        let holds = |m: usize| {
            if !resumable(m, &hashes) {
                return false;
            }
            let cached = cached_for(m);
            pools.iter().zip(keeps).all(|(pool, &keep)| {
                let from = hold_from(cached, keep, chunk) / bs;
                hashes[from..m]
                    .iter()
                    .all(|&h| pool.cached_block(h).is_some())
            })
        };
        let m = (1..=n).rev().find(|&m| holds(m)).unwrap_or(0);
        let cached = if m == 0 { 0 } else { cached_for(m) };
        let mut hit = GroupHit {
            cached,
            groups: Vec::with_capacity(pools.len()),
            start: Vec::with_capacity(pools.len()),
            hashes,
        };
        for (pool, &keep) in pools.iter_mut().zip(keeps) {
            let from = if m == 0 {
                0
            } else {
                hold_from(cached, keep, chunk)
            };
            let first = from / bs;
            let blocks: Vec<BlockId> = hit.hashes[first.min(m)..m]
                .iter()
                .filter_map(|&h| pool.cached_block(h))
                .collect();
            pool.touch(&blocks)?;
            hit.groups.push((first.min(m), blocks));
            hit.start.push(from);
        }
        self.counts.lookups += 1;
        if m == 0 {
            self.counts.misses += 1;
        } else {
            self.counts.hits += 1;
        }
        self.counts.tokens_queried += tokens.len() as u64;
        self.counts.tokens_reused += (m * bs) as u64;
        Ok(hit)
    }

    /// The counters, with the pool's eviction count.
    pub fn stats(&self, pool: &BlockPool) -> PrefixCacheStats {
        PrefixCacheStats {
            evictions: pool.evictions(),
            ..self.counts
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: u64 = 7;

    fn ids(raw: &[u32]) -> Vec<BlockId> {
        raw.iter().map(|&i| BlockId(i)).collect()
    }

    /// A sequence that appended `tokens` from empty.
    fn filled(pool: &mut BlockPool, tokens: &[u32]) -> SequenceBlocks {
        let mut seq = SequenceBlocks::new(pool);
        seq.append_slots(pool, tokens.len()).unwrap();
        seq
    }

    #[test]
    fn donated_blocks_hit_by_longest_full_prefix() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut cache = PrefixCache::new();
        let turn1: Vec<u32> = (0..10).collect();
        let mut a = filled(&mut pool, &turn1); // blocks 0 1 2
        assert_eq!(cache.insert(&mut pool, &a, &turn1, KEY).unwrap(), 2);
        a.release(&mut pool).unwrap();
        // Block 2 (partial) is empty again, 1 and 0 are evictable.
        assert_eq!(pool.free_queue(), ids(&[2, 3, 4, 5, 6, 7, 1, 0]));

        // Next turn: the first 10 tokens plus more. Two full blocks hit.
        let turn2: Vec<u32> = (0..14).collect();
        let hit = cache.lookup(&mut pool, &turn2, KEY).unwrap();
        assert_eq!(hit, ids(&[0, 1]));
        let mut b = SequenceBlocks::from_prefix(&pool, hit);
        assert_eq!(b.end(), 8);
        let w = b.append_slots(&mut pool, 6).unwrap();
        assert_eq!(w.copy, None, "a hit ends on a block boundary");
        assert_eq!(b.blocks(), ids(&[0, 1, 2, 3]));
        assert_eq!(cache.insert(&mut pool, &b, &turn2, KEY).unwrap(), 1);

        // Another extra key, or another first block: no hit.
        assert!(cache.lookup(&mut pool, &turn2, KEY + 1).unwrap().is_empty());
        let mut other = turn2.clone();
        other[0] = 99;
        assert!(cache.lookup(&mut pool, &other, KEY).unwrap().is_empty());
        b.release(&mut pool).unwrap();

        let stats = cache.stats(&pool);
        assert_eq!((stats.lookups, stats.hits, stats.misses), (3, 1, 2));
        assert_eq!((stats.tokens_reused, stats.tokens_queried), (8, 42));
        assert_eq!((stats.inserts, stats.evictions), (3, 0));
        let counts = pool.counts();
        assert_eq!((counts.used, counts.cached, counts.evictable), (0, 3, 3));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn concurrent_sequences_share_one_copy_of_a_prompt() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut cache = PrefixCache::new();
        let prompt: Vec<u32> = (100..108).collect();
        let first = filled(&mut pool, &prompt);
        cache.insert(&mut pool, &first, &prompt, KEY).unwrap();
        let mut seqs = vec![first];
        for _ in 0..3 {
            let hit = cache.lookup(&mut pool, &prompt, KEY).unwrap();
            seqs.push(SequenceBlocks::from_prefix(&pool, hit));
        }
        assert_eq!(pool.used_blocks(), 2);
        assert_eq!(pool.ref_count(BlockId(0)).unwrap(), 4);
        for seq in &mut seqs {
            seq.release(&mut pool).unwrap();
        }
        assert_eq!(pool.used_blocks(), 0);
    }

    #[test]
    fn whole_prompt_hit_rewinds_one_token_and_copies() {
        let mut pool = BlockPool::new(4, 4).unwrap();
        let mut cache = PrefixCache::new();
        let prompt: Vec<u32> = (0..8).collect();
        let mut a = filled(&mut pool, &prompt);
        cache.insert(&mut pool, &a, &prompt, KEY).unwrap();
        a.release(&mut pool).unwrap();

        let hit = cache.lookup(&mut pool, &prompt, KEY).unwrap();
        let mut b = SequenceBlocks::from_prefix(&pool, hit);
        assert_eq!(b.len(), prompt.len());
        b.truncate_tail(&mut pool, prompt.len() - 1).unwrap();
        let w = b.append_slots(&mut pool, 1).unwrap();
        let copy = w.copy.unwrap();
        assert_eq!((copy.src, copy.tokens), (BlockId(1), 3));
        assert_eq!(w.slots[0].block, copy.dst);
        assert_eq!(b.end(), prompt.len());
        // The cached block is intact and still the cache entry.
        assert_eq!(cache.lookup(&mut pool, &prompt, KEY).unwrap(), ids(&[0, 1]));
        pool.free(&ids(&[1, 0])).unwrap();
        // Donating b again registers nothing new: its copy is a duplicate.
        assert_eq!(cache.insert(&mut pool, &b, &prompt, KEY).unwrap(), 0);
        b.release(&mut pool).unwrap();
        assert_eq!(pool.used_blocks(), 0);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn lru_evicts_least_recently_freed_cached_block_first() {
        let mut pool = BlockPool::new(4, 2).unwrap();
        let mut cache = PrefixCache::new();
        let x: Vec<u32> = vec![1, 1, 2, 2];
        let y: Vec<u32> = vec![3, 3, 4, 4];
        let mut a = filled(&mut pool, &x); // 0 1
        let mut b = filled(&mut pool, &y); // 2 3
        cache.insert(&mut pool, &a, &x, KEY).unwrap();
        cache.insert(&mut pool, &b, &y, KEY).unwrap();
        a.release(&mut pool).unwrap(); // queue: 1 0
        b.release(&mut pool).unwrap(); // queue: 1 0 3 2
        assert_eq!(pool.free_queue(), ids(&[1, 0, 3, 2]));
        // A hit on x refreshes it: freed again, it moves behind y.
        let hit = cache.lookup(&mut pool, &x, KEY).unwrap();
        pool.free(&[hit[1], hit[0]]).unwrap();
        assert_eq!(pool.free_queue(), ids(&[3, 2, 1, 0]));
        // Room for a new sequence evicts y's tail, then y's root.
        let mut c = SequenceBlocks::new(&pool);
        c.append_slots(&mut pool, 3).unwrap();
        assert_eq!(c.blocks(), ids(&[3, 2]));
        assert_eq!(cache.stats(&pool).evictions, 2);
        assert!(cache.lookup(&mut pool, &y, KEY).unwrap().is_empty());
        assert_eq!(cache.lookup(&mut pool, &x, KEY).unwrap(), ids(&[0, 1]));
        pool.free(&ids(&[1, 0])).unwrap();
        c.release(&mut pool).unwrap();
        pool.check_invariants().unwrap();
    }

    #[test]
    fn insert_rules() {
        let mut pool = BlockPool::new(4, 4).unwrap();
        let mut cache = PrefixCache::new();
        let tokens: Vec<u32> = (0..9).collect();
        let mut seq = filled(&mut pool, &tokens);
        assert_eq!(
            cache
                .insert(&mut pool, &seq, &tokens[..8], KEY)
                .unwrap_err(),
            KvError::TooFewTokens { needed: 9, got: 8 }
        );
        seq.drop_front(&mut pool, 4).unwrap();
        assert_eq!(cache.insert(&mut pool, &seq, &tokens, KEY).unwrap(), 0);
        assert_eq!(pool.cached_blocks(), 0);
        seq.release(&mut pool).unwrap();
    }

    /// The lookup rule over KV groups: a full group holding all six blocks
    /// of a prompt and a window group (keeps 5 keys) whose oldest blocks
    /// were evicted and whose last was never cached.
    #[test]
    fn a_group_hit_is_what_every_group_still_holds() {
        let bs = 4;
        let tokens: Vec<u32> = (0..24).collect();
        let mut full = BlockPool::new(16, bs).unwrap();
        let mut window = BlockPool::new(8, bs).unwrap();
        let mut hashes = Vec::new();
        extend_hashes(&mut hashes, &tokens, 24, bs, KEY).unwrap();
        let all = full.allocate(6).unwrap();
        for (&b, &h) in all.iter().zip(&hashes) {
            full.register(b, h).unwrap();
        }
        full.free(&all).unwrap();
        // The window group cached logical blocks 0..5, freed oldest first;
        // then the two oldest were evicted.
        let win = window.allocate(5).unwrap();
        for (&b, &h) in win.iter().zip(&hashes) {
            window.register(b, h).unwrap();
        }
        window.free(&win).unwrap();
        assert_eq!(window.evict_cached(2), 2);
        let keeps = [None, Some(5)];
        let mut cache = PrefixCache::new();
        let mut lookup = |chunk: usize, full: &mut BlockPool, window: &mut BlockPool| {
            cache
                .lookup_groups(&mut [full, window], &keeps, &tokens, KEY, chunk)
                .unwrap()
        };

        // Chunks of 8: six blocks would need logical block 5 (never
        // cached); five blocks resume at 20, whose chunk boundary is 16, so
        // the window group needs positions 11.. (blocks 2..5): held.
        let hit = lookup(8, &mut full, &mut window);
        assert_eq!(hit.cached, 20);
        assert_eq!(hit.groups[0], (0, all[..5].to_vec()));
        assert_eq!(hit.groups[1], (2, win[2..5].to_vec()));
        assert_eq!(hit.start, vec![0, 11]);
        assert_eq!(full.ref_count(all[0]).unwrap(), 1);
        assert_eq!(full.ref_count(all[5]).unwrap(), 0, "not in the hit");
        assert_eq!(window.ref_count(win[2]).unwrap(), 1);
        full.free(&hit.groups[0].1).unwrap();
        window.free(&hit.groups[1].1).unwrap();

        // Chunks of 4: the boundary is 20, so only blocks 3 and 4 are
        // needed; block 2 stays unreferenced.
        let hit = lookup(4, &mut full, &mut window);
        assert_eq!((hit.cached, hit.start.clone()), (20, vec![0, 15]));
        assert_eq!(hit.groups[1], (3, win[3..5].to_vec()));
        assert_eq!(window.ref_count(win[2]).unwrap(), 0);
        full.free(&hit.groups[0].1).unwrap();
        window.free(&hit.groups[1].1).unwrap();

        // One chunk: a cold run keeps everything until the prompt ends, so
        // the window group would need block 0, which was evicted: a miss.
        let hit = lookup(usize::MAX, &mut full, &mut window);
        assert_eq!(hit.cached, 0);
        assert!(hit.groups.iter().all(|(_, b)| b.is_empty()));
        let stats = cache.stats(&full);
        assert_eq!((stats.lookups, stats.hits, stats.misses), (3, 2, 1));
        assert_eq!(full.used_blocks() + window.used_blocks(), 0);
    }

    #[test]
    fn reset_after_all_sequences_end_empties_the_pool() {
        let mut pool = BlockPool::new(6, 4).unwrap();
        let mut cache = PrefixCache::new();
        let tokens: Vec<u32> = (0..12).collect();
        let mut a = filled(&mut pool, &tokens);
        cache.insert(&mut pool, &a, &tokens, KEY).unwrap();
        let hit = cache.lookup(&mut pool, &tokens[..8], KEY).unwrap();
        let mut b = SequenceBlocks::from_prefix(&pool, hit);
        a.release(&mut pool).unwrap();
        // b still holds blocks 0 and 1: only block 2 is unreferenced.
        assert_eq!(pool.reset_prefix_cache(), 1);
        assert_eq!(pool.cached_blocks(), 2);
        b.release(&mut pool).unwrap();
        let c = pool.counts();
        assert_eq!((c.used, c.cached, c.evictable), (0, 2, 2));
        assert_eq!(pool.reset_prefix_cache(), 2);
        let c = pool.counts();
        assert_eq!((c.used, c.free, c.cached), (0, 6, 0));
        assert!(cache.lookup(&mut pool, &tokens, KEY).unwrap().is_empty());
    }
}
