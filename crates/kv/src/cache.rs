//! The KV cache the engine owns: the block pool, every sequence's positions
//! and block table, and the tensors behind them (paged or dense).
//!
//! Both backends keep a sequence's positions in one [`SequenceBlocks`]
//! (docs/architecture.md invariant 1): the dense backend allocates pool blocks
//! too, for the budget, but stores K/V in per-sequence buffers. Growing is
//! [`KvCache::append`]; shrinking is [`KvCache::truncate_tail`] and
//! [`KvCache::drop_front`], one function per direction for both backends.
//!
//! A cache holds one or more KV groups (group.rs): each has its own pool
//! and paged arrays for its layers, a sequence one [`SequenceBlocks`] per
//! group (same `end`), and [`KvCache::trim`] drops each group's front to its
//! keep after a step. One group of every layer, keeping every key, is a
//! cache without groups ([`KvCache::new`]).
//!
//! A sequence is held through an opaque [`KvSequence`]; dropping it gives
//! its blocks back at the cache's next [`KvCache::reclaim`] (the engine calls
//! it at every step), so a request that ends in any way (finished, failed,
//! cancelled, or unwound by a panic) cannot leak blocks.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::rc::Rc;

use crate::admission::{Admission, GroupAdmission};
use crate::error::KvError;
use crate::group::KvGroupConfig;
use crate::hash::BlockHash;
use crate::pool::{BlockCounts, BlockPool};
use crate::prefix::{PrefixCache, PrefixCacheStats};
use crate::sequence::{BlockCopy, SequenceBlocks};
use crate::step::StepKv;
use crate::storage::{DenseStorage, KvLayout, PagedStorage};

/// Where K/V tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageBackend {
    /// Contiguous buffers per sequence (reads are slices).
    Dense,
    /// One pool of fixed-size blocks per layer (reads gather a row's slots).
    Paged,
}

impl fmt::Display for StorageBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StorageBackend::Dense => "dense",
            StorageBackend::Paged => "paged",
        })
    }
}

/// How to build a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Per-token K/V shape of the model.
    pub layout: KvLayout,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool (the budget: `num_blocks * block_size` tokens);
    /// with KV groups ([`KvCache::with_groups`]), in every group's pool
    /// together.
    pub num_blocks: usize,
    /// Tensor storage.
    pub backend: StorageBackend,
    /// The prefix cache; `None` disables it (it needs paged storage).
    pub prefix: Option<PrefixCacheConfig>,
}

/// Prefix-cache options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCacheConfig {
    /// Identity of what produced the K/V (model, dtype), mixed into every
    /// block hash so entries never cross models.
    pub extra_key: u64,
    /// Most unreferenced cached blocks kept in each KV group's pool; older
    /// ones are evicted first.
    pub capacity_blocks: usize,
}

/// What a prefix-cache reset freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResetOutcome {
    /// Cached blocks nobody held, now empty.
    pub blocks_freed: usize,
    /// Their size in bytes.
    pub bytes_freed: usize,
}

impl KvCacheConfig {
    /// Blocks that fit in `budget_bytes` for `layout` and `block_size`.
    pub fn blocks_for_budget(layout: KvLayout, block_size: usize, budget_bytes: usize) -> usize {
        budget_bytes / (layout.bytes_per_token() * block_size).max(1)
    }
}

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

/// An opaque handle on one sequence's KV. Dropping it releases the
/// sequence; its blocks return to the pool at the next [`KvCache::reclaim`].
pub struct KvSequence {
    id: u64,
    released: Rc<RefCell<Vec<u64>>>,
}

impl fmt::Debug for KvSequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KvSequence({})", self.id)
    }
}

impl Drop for KvSequence {
    fn drop(&mut self) {
        self.released.borrow_mut().push(self.id);
    }
}

/// One sequence's bookkeeping and (dense backend) storage.
#[derive(Debug)]
pub(crate) struct SeqState {
    /// Positions and block table in each group, in group order; every
    /// group has the same `end`, a window group a later `start`.
    pub(crate) blocks: Vec<SequenceBlocks>,
    pub(crate) dense: Option<DenseStorage>,
    /// Chained hashes of its full blocks from position 0 (prefix cache);
    /// they depend only on the tokens, so every group shares them.
    hashes: Vec<BlockHash>,
    /// A tensor-side failure may have left its K/V half-updated (a block
    /// copy, a buffer resize): it can't run again and only awaits release.
    poisoned: bool,
}

impl SeqState {
    /// The first group's positions (every group has the same `end`).
    pub(crate) fn first(&self) -> &SequenceBlocks {
        &self.blocks[0]
    }
}

/// One KV group's pool and (paged) tensors.
#[derive(Debug)]
pub(crate) struct Group {
    pub(crate) config: KvGroupConfig,
    pub(crate) pool: BlockPool,
    /// Pool arrays of the group's layers only.
    pub(crate) paged: Option<PagedStorage>,
    /// Bytes of K/V one block of this group holds.
    block_bytes: usize,
}

/// The engine's KV cache; see the module docs.
#[derive(Debug)]
pub struct KvCache {
    config: KvCacheConfig,
    /// The KV groups, full-attention group first (crate::group).
    pub(crate) groups: Vec<Group>,
    /// Model layer -> (its group, its index among the group's layers).
    pub(crate) layer_group: Vec<(usize, usize)>,
    pub(crate) seqs: HashMap<u64, SeqState>,
    next_id: u64,
    released: Rc<RefCell<Vec<u64>>>,
    prefix: Option<(PrefixCache, PrefixCacheConfig)>,
    /// Block copies made since last taken, when recording (tensor
    /// parallelism's rank 0: see replica.rs).
    pub(crate) copy_log: Option<Vec<BlockCopy>>,
}

impl KvCache {
    /// A cache of one group holding every layer in `config.num_blocks`
    /// blocks, keeping every key. The paged backend allocates and
    /// zero-fills its pool arrays now.
    ///
    /// # Errors
    /// A zero block size, too many blocks, or an MLX allocation failure.
    pub fn new(config: KvCacheConfig) -> Result<Self, KvError> {
        let group = KvGroupConfig {
            layers: (0..config.layout.layers).collect(),
            window: None,
            keep: None,
            num_blocks: config.num_blocks,
        };
        Self::with_groups(config, vec![group])
    }

    /// A cache of KV `groups` (built with
    /// [`KvGroupConfig::from_layer_windows`] and sized by the caller):
    /// each group has its own pool of `num_blocks` blocks and, paged, pool
    /// arrays `[num_blocks * block_size, kv_heads, head_dim]` for its layers
    /// only. `config.num_blocks` must be the sum of the groups' blocks and
    /// every layer of `config.layout` must be in exactly one group.
    ///
    /// # Errors
    /// A layer in no group or in two, a block count that doesn't add up,
    /// several groups on the dense backend (dense buffers hold one range
    /// of positions per sequence), a zero block size, too many blocks, or
    /// an MLX allocation failure.
    pub fn with_groups(config: KvCacheConfig, groups: Vec<KvGroupConfig>) -> Result<Self, KvError> {
        let layers = config.layout.layers;
        let mut layer_group = vec![(usize::MAX, 0); layers];
        for (g, group) in groups.iter().enumerate() {
            for (i, &l) in group.layers.iter().enumerate() {
                match layer_group.get_mut(l) {
                    Some(slot) if slot.0 == usize::MAX => *slot = (g, i),
                    _ => {
                        return Err(KvError::Invariant(format!(
                            "layer {l} of {layers} is in two KV groups or out of range"
                        )))
                    }
                }
            }
        }
        if groups.is_empty() || layer_group.iter().any(|&(g, _)| g == usize::MAX) {
            return Err(KvError::Invariant(
                "every layer must be in one KV group".into(),
            ));
        }
        let total: usize = groups.iter().map(|g| g.num_blocks).sum();
        if total != config.num_blocks {
            return Err(KvError::Invariant(format!(
                "KV groups hold {total} blocks, the cache {}",
                config.num_blocks
            )));
        }
        if config.backend == StorageBackend::Dense && groups.len() > 1 {
            return Err(KvError::Invariant(
                "the dense backend holds one KV group; use paged storage".into(),
            ));
        }
        let groups = groups
            .into_iter()
            .map(|g| {
                let layout = KvLayout {
                    layers: g.layers.len(),
                    ..config.layout
                };
                let paged = match config.backend {
                    StorageBackend::Paged => {
                        Some(PagedStorage::new(layout, g.num_blocks, config.block_size)?)
                    }
                    StorageBackend::Dense => None,
                };
                Ok(Group {
                    pool: BlockPool::new(g.num_blocks, config.block_size)?,
                    paged,
                    block_bytes: layout.bytes_per_token() * config.block_size,
                    config: g,
                })
            })
            .collect::<Result<Vec<_>, KvError>>()?;
        let prefix = match (config.backend, config.prefix) {
            (StorageBackend::Paged, Some(p)) => Some((PrefixCache::new(), p)),
            _ => None,
        };
        Ok(KvCache {
            config,
            groups,
            layer_group,
            seqs: HashMap::new(),
            next_id: 0,
            released: Rc::default(),
            prefix,
            copy_log: None,
        })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The first group's block pool (the only one of a cache without
    /// groups): counts, for tests. [`KvCache::counts`] sums every group.
    pub fn pool(&self) -> &BlockPool {
        &self.groups[0].pool
    }

    /// The KV groups, full-attention group first.
    pub fn groups(&self) -> impl Iterator<Item = &KvGroupConfig> {
        self.groups.iter().map(|g| &g.config)
    }

    /// Group `group`'s block pool.
    pub fn group_pool(&self, group: usize) -> Option<&BlockPool> {
        self.groups.get(group).map(|g| &g.pool)
    }

    /// Bytes of K/V one block of group `group` holds (its layers only).
    pub fn group_block_bytes(&self, group: usize) -> usize {
        self.groups.get(group).map_or(0, |g| g.block_bytes)
    }

    /// Block counts summed over every group's pool.
    pub fn counts(&self) -> BlockCounts {
        self.groups
            .iter()
            .map(|g| g.pool.counts())
            .fold(BlockCounts::default(), |a, c| BlockCounts {
                total: a.total + c.total,
                used: a.used + c.used,
                free: a.free + c.free,
                cached: a.cached + c.cached,
                evictable: a.evictable + c.evictable,
            })
    }

    /// Whether some group keeps fewer keys than a sequence has (a window or
    /// `--max-kv-size`): [`KvCache::trim`] then drops fronts after steps.
    pub fn trims(&self) -> bool {
        self.groups.iter().any(|g| g.config.keep.is_some())
    }

    /// Sequences alive (handles not yet reclaimed).
    pub fn live_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// A new empty sequence at `[0, 0)`.
    pub fn new_sequence(&mut self) -> KvSequence {
        let dense = match self.config.backend {
            StorageBackend::Dense => Some(DenseStorage::new(self.config.layout, 0)),
            StorageBackend::Paged => None,
        };
        let blocks = self
            .groups
            .iter()
            .map(|g| SequenceBlocks::new(&g.pool))
            .collect();
        self.insert_sequence(SeqState {
            blocks,
            dense,
            hashes: Vec::new(),
            poisoned: false,
        })
    }

    fn insert_sequence(&mut self, state: SeqState) -> KvSequence {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, state);
        KvSequence {
            id,
            released: Rc::clone(&self.released),
        }
    }

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
        let Some((cache, cfg)) = &mut self.prefix else {
            return Ok((self.new_sequence(), 0));
        };
        let keeps: Vec<Option<usize>> = self.groups.iter().map(|g| g.config.keep).collect();
        let mut pools: Vec<&mut BlockPool> = self.groups.iter_mut().map(|g| &mut g.pool).collect();
        let hit = cache.lookup_groups(&mut pools, &keeps, tokens, cfg.extra_key, chunk)?;
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
        let seq = self.insert_sequence(SeqState {
            blocks,
            dense: None,
            hashes,
            poisoned: false,
        });
        Ok((seq, hit.cached))
    }

    /// A second sequence holding the same positions and K/V as `seq` (the
    /// `n` choices of one prompt): paged, it references the same blocks
    /// (each block's refcount goes up; the first write into a shared
    /// partial block copies it); dense, it shares the buffers until one is
    /// written. Errors: an unknown or poisoned sequence.
    pub fn fork(&mut self, seq: &KvSequence) -> Result<KvSequence, KvError> {
        let state = self
            .seqs
            .get(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        if state.poisoned {
            return Err(KvError::Invariant(format!(
                "sequence {} lost its K/V to an earlier storage failure",
                seq.id
            )));
        }
        let mut blocks = Vec::with_capacity(self.groups.len());
        for (g, b) in state.blocks.iter().enumerate() {
            match b.fork(&mut self.groups[g].pool) {
                Ok(f) => blocks.push(f),
                Err(e) => {
                    for (g, mut f) in blocks.into_iter().enumerate() {
                        f.release(&mut self.groups[g].pool)?;
                    }
                    return Err(e);
                }
            }
        }
        let forked = SeqState {
            blocks,
            dense: state.dense.clone(),
            hashes: state.hashes.clone(),
            poisoned: false,
        };
        Ok(self.insert_sequence(forked))
    }

    /// Donates the sequence's full blocks of `tokens` (its token ids from
    /// position 0, at least `end` of them) to the prefix cache, in every
    /// group under the same chained hashes; see [`PrefixCache::donate`].
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
        let end = state.blocks[0].end();
        crate::prefix::extend_hashes(
            &mut state.hashes,
            tokens,
            end,
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
        Ok((added, shared))
    }

    /// Frees every cached block nobody holds, in every group (idempotent;
    /// blocks of running sequences stay).
    pub fn reset_prefix_cache(&mut self) -> ResetOutcome {
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

    /// Bytes of K/V one block holds: exact with one group; with several,
    /// the mean over every block of every group (so `total blocks ×
    /// block_bytes` is the cache's bytes, up to rounding down).
    pub fn block_bytes(&self) -> usize {
        let blocks: usize = self.groups.iter().map(|g| g.config.num_blocks).sum();
        if self.groups.len() == 1 || blocks == 0 {
            return self.groups[0].block_bytes;
        }
        self.total_bytes() / blocks
    }

    /// Bytes of K/V of every block of every group.
    pub fn total_bytes(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.config.num_blocks * g.block_bytes)
            .sum()
    }

    /// Evicts least recently used unreferenced cached blocks beyond the
    /// prefix cache's capacity, in each group.
    fn enforce_prefix_capacity(&mut self) {
        let Some((_, cfg)) = &self.prefix else { return };
        for g in &mut self.groups {
            let evictable = g.pool.counts().evictable;
            if evictable > cfg.capacity_blocks {
                g.pool.evict_cached(evictable - cfg.capacity_blocks);
            }
        }
    }

    /// Gives back the blocks of every dropped [`KvSequence`]; returns how
    /// many sequences were released.
    pub fn reclaim(&mut self) -> Result<usize, KvError> {
        let ids: Vec<u64> = self.released.borrow_mut().drain(..).collect();
        let mut first_error = None;
        for id in &ids {
            if let Some(mut s) = self.seqs.remove(id) {
                for (g, blocks) in s.blocks.iter_mut().enumerate() {
                    if let Err(e) = blocks.release(&mut self.groups[g].pool) {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        if !ids.is_empty() {
            self.enforce_prefix_capacity();
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(ids.len()),
        }
    }

    pub(crate) fn state(&self, seq: &KvSequence) -> Result<&SeqState, KvError> {
        self.seqs
            .get(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))
    }

    /// The sequence's first live position in the first group (a window
    /// group's may be later: [`KvCache::group_range`]).
    pub fn start(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.first().start())
    }

    /// One past its last live position: the next token's (RoPE) position,
    /// the same in every group.
    pub fn end(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.first().end())
    }

    /// Live tokens in the first group, `end - start` (the key count its
    /// layers' attention sees).
    pub fn len(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.first().len())
    }

    /// The sequence's live positions `[start, end)` in group `group`.
    pub fn group_range(
        &self,
        seq: &KvSequence,
        group: usize,
    ) -> Result<std::ops::Range<usize>, KvError> {
        let b = self
            .state(seq)?
            .blocks
            .get(group)
            .ok_or(KvError::Invariant(format!("no KV group {group}")))?;
        Ok(b.start()..b.end())
    }

    /// Blocks the sequence holds, summed over groups.
    pub fn blocks_held(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.group_blocks_held(seq)?.iter().sum())
    }

    /// Blocks the sequence holds in each group, in group order.
    pub fn group_blocks_held(&self, seq: &KvSequence) -> Result<Vec<usize>, KvError> {
        Ok(self
            .state(seq)?
            .blocks
            .iter()
            .map(|b| b.blocks().len())
            .collect())
    }

    /// Reserves positions `[end, end + n)` for `n` new tokens in every
    /// group: blocks from the pools (copy-on-write of a shared last block
    /// first) and, dense, room in the buffers. All or nothing.
    ///
    /// # Errors
    /// [`KvError::PoolExhausted`] when a pool can't hold them (nothing
    /// changed), or an MLX failure growing a buffer or copying a block (the
    /// blocks are given back, the sequence poisoned).
    pub fn append(&mut self, seq: &KvSequence, n: usize) -> Result<(), KvError> {
        let id = seq.id;
        let state = self
            .seqs
            .get_mut(&id)
            .ok_or(KvError::Invariant(format!("unknown sequence {id}")))?;
        if state.poisoned {
            return Err(KvError::Invariant(format!(
                "sequence {id} lost its K/V to an earlier storage failure"
            )));
        }
        let old_end = state.blocks[0].end();
        let mut result = Ok(());
        let mut grown = 0;
        for (g, blocks) in state.blocks.iter_mut().enumerate() {
            let group = &mut self.groups[g];
            let appended = match blocks.append_slots(&mut group.pool, n) {
                Ok(a) => a,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            grown += 1;
            if let (Some(p), Some(copy)) = (&mut group.paged, appended.copy) {
                if let Some(log) = &mut self.copy_log {
                    log.push(copy);
                }
                if let Err(e) = p.copy_block(copy) {
                    // The copy may have stopped half-way: this sequence's
                    // K/V can no longer be trusted.
                    state.poisoned = true;
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() {
            if let Some(d) = &mut state.dense {
                if let Err(e) = d.reserve(state.blocks[0].start(), state.blocks[0].end()) {
                    state.poisoned = true;
                    result = Err(e);
                }
            }
        }
        if result.is_err() {
            for (g, blocks) in state.blocks.iter_mut().enumerate().take(grown) {
                blocks.truncate_tail(&mut self.groups[g].pool, old_end)?;
            }
        }
        result
    }

    /// Rewinds the tail to `new_end` in every group (drops pad rows, or a
    /// failed step's tokens): positions and blocks move together; the
    /// dropped positions are never read again.
    pub fn truncate_tail(&mut self, seq: &KvSequence, new_end: usize) -> Result<(), KvError> {
        let state = self
            .seqs
            .get_mut(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        for (g, blocks) in state.blocks.iter_mut().enumerate() {
            blocks.truncate_tail(&mut self.groups[g].pool, new_end)?;
        }
        Ok(())
    }

    /// Drops the front to `new_start` in every group that starts before
    /// it; positions keep their absolute values.
    pub fn drop_front(&mut self, seq: &KvSequence, new_start: usize) -> Result<(), KvError> {
        let state = self
            .seqs
            .get_mut(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        for (g, blocks) in state.blocks.iter_mut().enumerate() {
            if blocks.start() < new_start {
                blocks.drop_front(&mut self.groups[g].pool, new_start)?;
            }
        }
        Ok(())
    }

    /// Drops each group's front to what it keeps between steps (its
    /// [`KvGroupConfig::keep`]: `end - keep` when it holds more): a window
    /// group frees the blocks that fell out of its window, the full group
    /// keeps everything (or the last `--max-kv-size`). Call it after every
    /// step, once the step's blocks were donated.
    pub fn trim(&mut self, seq: &KvSequence) -> Result<(), KvError> {
        let state = self
            .seqs
            .get_mut(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        for (g, blocks) in state.blocks.iter_mut().enumerate() {
            let group = &mut self.groups[g];
            if let Some(keep) = group.config.keep {
                if blocks.len() > keep {
                    blocks.drop_front(&mut group.pool, blocks.end() - keep)?;
                }
            }
        }
        Ok(())
    }

    /// Checks that the sequence's positions, block tables and storage
    /// agree, and that every group ends at the same position.
    pub fn check(&self, seq: &KvSequence) -> Result<(), KvError> {
        let s = self.state(seq)?;
        let end = s.first().end();
        for b in &s.blocks {
            b.check_invariants()?;
            if b.end() != end {
                return Err(KvError::Invariant(format!(
                    "KV groups end at {} and {end}",
                    b.end()
                )));
            }
        }
        if let Some(d) = &s.dense {
            d.check_covers(s.first().start(), end)?;
        }
        Ok(())
    }

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
        }
        Ok(StepReservation { rows: done })
    }

    /// Ends a step reserved by [`KvCache::reserve_step`]. On success each
    /// row keeps exactly its real tokens (`end = old_end + real`: pad rows
    /// are rewound through the one tail-shrink path); on failure every row
    /// returns to where it was. Rows whose sequence was released meanwhile
    /// are skipped.
    pub fn complete_step(&mut self, step: StepReservation, success: bool) -> Result<(), KvError> {
        let targets = step
            .rows
            .iter()
            .map(|&(id, old_end, real)| (id, if success { old_end + real } else { old_end }));
        self.rewind_ids(targets.collect::<Vec<_>>())
    }

    fn rewind_ids(
        &mut self,
        targets: impl IntoIterator<Item = (u64, usize)>,
    ) -> Result<(), KvError> {
        for (id, end) in targets {
            if let Some(state) = self.seqs.get_mut(&id) {
                for (g, blocks) in state.blocks.iter_mut().enumerate() {
                    if blocks.end() != end {
                        blocks.truncate_tail(&mut self.groups[g].pool, end)?;
                    }
                }
            }
        }
        Ok(())
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

impl KvCache {
    /// The admission rule of this cache (crates/kv/src/admission.rs): per
    /// group, the worst case under its keep, prefill tiles of `tile`
    /// tokens and chunks of `chunk`, over its pool's blocks.
    pub fn admission(&self, tile: usize, chunk: usize) -> GroupAdmission {
        GroupAdmission::new(
            self.groups
                .iter()
                .map(|g| {
                    (
                        Admission::new(self.config.block_size, tile, g.config.keep, chunk),
                        g.config.num_blocks,
                    )
                })
                .collect(),
        )
    }

    /// Whether a request that may hold `need[g]` blocks of group `g` fits
    /// now, on top of what the running sequences may still take: each
    /// `(sequence, worst[g])` of `running` may grow to `worst[g]` blocks.
    /// The one admission question, answered per group.
    pub fn fits<'s>(
        &self,
        need: &[usize],
        running: impl IntoIterator<Item = (&'s KvSequence, &'s [usize])>,
    ) -> bool {
        let mut promised = vec![0usize; self.groups.len()];
        for (seq, worst) in running {
            let held = self.group_blocks_held(seq).ok();
            for (g, p) in promised.iter_mut().enumerate() {
                let w = worst.get(g).copied().unwrap_or(0);
                let h = held.as_ref().and_then(|h| h.get(g).copied()).unwrap_or(w);
                *p += w.saturating_sub(h);
            }
        }
        self.groups.iter().enumerate().all(|(g, group)| {
            group.pool.free_blocks() >= promised[g] + need.get(g).copied().unwrap_or(0)
        })
    }
}
