//! The prefix-cache side of a [`KvCache`]: a new sequence starting from
//! the longest cached prefix of its prompt, donation of its full blocks,
//! reset, counters, and the capacity kept after releases.

use super::{KvCache, KvSequence, ResetOutcome, SeqState};
use crate::error::KvError;
use crate::hash::BlockHash;
use crate::pool::BlockPool;
use crate::prefix::PrefixCacheStats;
use crate::recurrent::{SeqRecurrent, StateEntry, CHUNK_SNAPSHOTS_KEPT};
use crate::sequence::SequenceBlocks;

#[cfg(doc)]
use crate::prefix::PrefixCache;

impl KvCache {
    /// Whether the prefix cache is on.
    pub fn prefix_cache_enabled(&self) -> bool {
        self.prefix.is_some()
    }

    /// [`KvCache::new_sequence_for_prompt_chunked`] for a prompt computed
    /// in one chunk.
    pub fn new_sequence_for_prompt(
        &mut self,
        tokens: &[u32],
    ) -> Result<(KvSequence, usize), KvError> {
        self.new_sequence_for_prompt_chunked(tokens, usize::MAX)
    }

    /// A new sequence for a prompt of `tokens` that the engine computes in
    /// chunks ending at multiples of `chunk` (absolute positions), starting
    /// from the longest cached prefix every group can serve (see
    /// [`PrefixCache::lookup_groups`]: a group that keeps `k` keys needs the
    /// blocks a cold run holds at the last chunk boundary before the hit,
    /// `k` positions back from it); the blocks are adopted by reference,
    /// never copied. Returns it and the number of prompt tokens whose K/V
    /// it already holds. When every prompt token is cached, the last one is
    /// rewound so that its logits are computed (its block is then copied
    /// before the write, the cached one staying intact). Without a prefix
    /// cache, an empty sequence.
    ///
    /// # Errors
    /// A pool inconsistency while taking the blocks.
    pub fn new_sequence_for_prompt_chunked(
        &mut self,
        tokens: &[u32],
        chunk: usize,
    ) -> Result<(KvSequence, usize), KvError> {
        if self.prefix.is_none() {
            return Ok((self.new_sequence(), 0));
        }
        self.load_from_disk(tokens, chunk)?;
        let Some((cache, cfg)) = &mut self.prefix else {
            return Ok((self.new_sequence(), 0));
        };
        let keeps: Vec<Option<usize>> = self.groups.iter().map(|g| g.config.keep).collect();
        let mut pools: Vec<&mut BlockPool> = self.groups.iter_mut().map(|g| &mut g.pool).collect();
        // With recurrent layers, a hit ends at a block boundary inside the
        // prompt whose state snapshot is kept (crate::recurrent).
        let recurrent = !self.recurrent.layers.is_empty();
        let snapshots = &self.snapshots;
        let resumable = |m: usize, hashes: &[BlockHash]| {
            !recurrent
                || (m * self.config.block_size < tokens.len()
                    && hashes
                        .get(m.wrapping_sub(1))
                        .is_some_and(|h| snapshots.contains(h)))
        };
        let hit = cache.lookup_groups_where(
            &mut pools,
            &keeps,
            tokens,
            cfg.extra_key,
            chunk,
            &resumable,
        )?;
        let mut hashes = hit.hashes;
        let mut blocks = Vec::with_capacity(self.groups.len());
        let mut failed = None;
        for (g, (first, found)) in hit.groups.into_iter().enumerate() {
            let pool = &mut self.groups[g].pool;
            let mut seq = SequenceBlocks::from_prefix_at(pool, first, found);
            if seq.end() > hit.cached {
                if let Err(e) = seq.truncate_tail(pool, hit.cached) {
                    failed.get_or_insert(e);
                }
            }
            if seq.start() < hit.start[g] && failed.is_none() {
                if let Err(e) = seq.drop_front(pool, hit.start[g]) {
                    failed.get_or_insert(e);
                }
            }
            blocks.push(seq);
        }
        if let Some(e) = failed {
            for (g, mut seq) in blocks.into_iter().enumerate() {
                seq.release(&mut self.groups[g].pool)?;
            }
            return Err(e);
        }
        hashes.truncate(hit.cached / self.config.block_size);
        let mut recurrent = SeqRecurrent::default();
        if let Some(last) = hashes.last().filter(|_| !self.recurrent.layers.is_empty()) {
            let snapshot = self.snapshots.take(last).ok_or(KvError::Invariant(
                "a prefix hit without its recurrent-state snapshot".into(),
            ))?;
            recurrent.entries.push(StateEntry {
                at: snapshot.at,
                layers: snapshot.layers.into_iter().map(Some).collect(),
                chunk: false,
            });
        }
        let seq = self.insert_sequence(SeqState {
            blocks,
            dense: None,
            hashes,
            poisoned: false,
            recurrent,
            reserved: None,
        });
        Ok((seq, hit.cached))
    }

    /// Donates the sequence's full blocks among the positions of `tokens`
    /// (its token ids from position 0, of positions whose K/V every read
    /// so far has seen written; those past the cache's end are ignored) to
    /// the prefix cache, in every group under the same chained hashes; see
    /// [`PrefixCache::donate`]. The newest complete recurrent state within
    /// them becomes a snapshot if it sits at a block boundary. A caller with a step
    /// queued and not read passes only the tokens before that step's
    /// positions, so a failed read never leaves a cached block (or
    /// snapshot) its step did not write.
    /// Returns (newly cached, swapped for shared), summed over groups.
    pub fn donate(&mut self, seq: &KvSequence, tokens: &[u32]) -> Result<(usize, usize), KvError> {
        let Some((cache, cfg)) = &mut self.prefix else {
            return Ok((0, 0));
        };
        let state = self
            .seqs
            .get_mut(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        let from = state.hashes.len();
        let known = tokens.len().min(state.blocks[0].end());
        crate::prefix::extend_hashes(
            &mut state.hashes,
            tokens,
            known,
            self.config.block_size,
            cfg.extra_key,
        )?;
        let (mut added, mut shared) = (0, 0);
        for (g, blocks) in state.blocks.iter_mut().enumerate() {
            let (a, s) =
                cache.register_blocks(&mut self.groups[g].pool, blocks, &state.hashes, from)?;
            added += a;
            shared += s;
        }
        // The newest complete recurrent state at a block boundary becomes a
        // snapshot under the hash of the block ending there.
        let bs = self.config.block_size;
        let newest = state
            .recurrent
            .entries
            .iter()
            .rev()
            .find(|e| e.at <= known && e.complete())
            .cloned();
        if let Some(entry) = newest.filter(|e| e.at > 0 && e.at % bs == 0) {
            if let Some(&hash) = state.hashes.get(entry.at / bs - 1) {
                if !self.snapshots.contains(&hash) {
                    let owner = seq.id;
                    let own = &mut state.recurrent;
                    if entry.chunk {
                        own.chunk_snapshots.push(hash);
                        if own.chunk_snapshots.len() > CHUNK_SNAPSHOTS_KEPT {
                            let old = own.chunk_snapshots.remove(0);
                            self.snapshots.remove_owned(&old, owner);
                        }
                    } else if let Some(old) = own.decode_snapshot.replace(hash) {
                        self.snapshots.remove_owned(&old, owner);
                    }
                    let evicted = self.snapshots.insert(hash, &entry, owner);
                    super::disk::save_snapshots(&mut self.disk, self.config.block_size, evicted);
                }
            }
        }
        Ok((added, shared))
    }

    /// Frees every cached block nobody holds, in every group (idempotent;
    /// blocks of running sequences stay).
    pub fn reset_prefix_cache(&mut self) -> ResetOutcome {
        self.snapshots.clear();
        let mut out = ResetOutcome::default();
        for g in &mut self.groups {
            let freed = g.pool.reset_prefix_cache();
            out.blocks_freed += freed;
            out.bytes_freed += freed * g.block_bytes;
        }
        out
    }

    /// Prefix-cache counters (zero when disabled); evictions are summed
    /// over groups.
    pub fn prefix_stats(&self) -> PrefixCacheStats {
        match &self.prefix {
            Some((c, _)) => PrefixCacheStats {
                evictions: self.groups.iter().map(|g| g.pool.evictions()).sum(),
                ..c.stats(&self.groups[0].pool)
            },
            None => PrefixCacheStats::default(),
        }
    }

    /// Most unreferenced cached blocks each group keeps (0 when disabled).
    pub fn prefix_capacity_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, |(_, c)| c.capacity_blocks)
    }

    /// Evicts least recently used unreferenced cached blocks beyond the
    /// prefix cache's capacity, in each group.
    pub(super) fn enforce_prefix_capacity(&mut self) {
        let Some((_, cfg)) = &self.prefix else { return };
        for (i, g) in self.groups.iter_mut().enumerate() {
            let evictable = g.pool.counts().evictable;
            if evictable > cfg.capacity_blocks {
                g.pool.evict_cached(evictable - cfg.capacity_blocks);
                super::disk::save_evicted(&mut self.disk, &self.config.layout, i, g);
            }
        }
    }
}
