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

mod admission;
mod config;
mod disk;
mod positions;
mod prefix;
mod reserve;

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::rc::Rc;

use crate::error::KvError;
use crate::group::KvGroupConfig;
use crate::hash::BlockHash;
use crate::pool::{BlockCounts, BlockPool};
use crate::prefix::PrefixCache;
use crate::recurrent::{RecurrentConfig, SeqRecurrent, SnapshotStore};
use crate::sequence::{BlockCopy, SequenceBlocks};
use crate::storage::{DenseStorage, KvLayout, PagedStorage};

pub use config::{KvCacheConfig, PrefixCacheConfig, ResetOutcome, StorageBackend};
pub use disk::DiskTierConfig;
pub use reserve::{RowReserve, StepReservation};

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
    /// Its recurrent layers' state entries (crate::recurrent).
    pub(crate) recurrent: SeqRecurrent,
    /// The step reserved for it and not completed yet: its end before the
    /// step and its real tokens (the rest are pads, which a recurrent
    /// state must not fold in).
    pub(crate) reserved: Option<(usize, usize)>,
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
    /// The prefix cache's disk tier, when open (disk.rs).
    pub(crate) disk: Option<disk::DiskTier>,
    /// The model's recurrent layers (crate::recurrent).
    pub(crate) recurrent: RecurrentConfig,
    /// Model layer -> its index among the recurrent layers.
    pub(crate) layer_recurrent: Vec<Option<usize>>,
    /// Model layer -> the layer whose K/V it reads: itself, or its source
    /// for a layer that shares another's K/V (`LayerState::SharedAttention`).
    pub(crate) kv_source: Vec<usize>,
    /// Recurrent-state snapshots at block boundaries (prefix cache).
    pub(crate) snapshots: SnapshotStore,
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
        Self::with_layer_states(config, groups, RecurrentConfig::default())
    }

    /// [`KvCache::with_groups`] for a model some of whose layers keep a
    /// recurrent state instead of K/V (crate::recurrent): every layer of
    /// `config.layout` is in one KV group or in `recurrent.layers`, and a
    /// prefix cache keeps up to `recurrent.snapshots` state snapshots.
    ///
    /// # Errors
    /// As [`KvCache::with_groups`]; a layer both in a group and recurrent.
    pub fn with_layer_states(
        config: KvCacheConfig,
        groups: Vec<KvGroupConfig>,
        recurrent: RecurrentConfig,
    ) -> Result<Self, KvError> {
        Self::with_shared_layers(config, groups, recurrent, &[])
    }

    /// [`KvCache::with_layer_states`] for a model some of whose layers
    /// read another layer's K/V and write none (`shared`: `(layer,
    /// source)` pairs, `LayerState::SharedAttention`): such a layer is in
    /// no group; it is mapped to its source's group and index, so its reads
    /// return the source's K/V on every storage (dense, paged, KV groups,
    /// prefix cache, the paged decode kernel), and a write to it is an
    /// error.
    ///
    /// # Errors
    /// As [`KvCache::with_layer_states`]; a shared layer listed twice, in
    /// a group, recurrent or out of range; a source that keeps no K/V of
    /// its own.
    pub fn with_shared_layers(
        config: KvCacheConfig,
        groups: Vec<KvGroupConfig>,
        recurrent: RecurrentConfig,
        shared: &[(usize, usize)],
    ) -> Result<Self, KvError> {
        let layers = config.layout.layers;
        let mut layer_group = vec![(usize::MAX, 0); layers];
        let mut layer_recurrent = vec![None; layers];
        for (i, &l) in recurrent.layers.iter().enumerate() {
            match layer_group.get_mut(l) {
                Some(slot) if slot.0 == usize::MAX && layer_recurrent[l].is_none() => {
                    *slot = (usize::MAX - 1, i);
                    layer_recurrent[l] = Some(i);
                }
                _ => {
                    return Err(KvError::Invariant(format!(
                        "recurrent layer {l} of {layers} listed twice or out of range"
                    )))
                }
            }
        }
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
        let mut kv_source: Vec<usize> = (0..layers).collect();
        for &(l, source) in shared {
            let from = layer_group.get(source).copied();
            match (layer_group.get(l), from) {
                (Some(&(usize::MAX, _)), Some(from))
                    if from.0 < groups.len() && kv_source[source] == source =>
                {
                    layer_group[l] = from;
                    kv_source[l] = source;
                }
                _ => {
                    return Err(KvError::Invariant(format!(
                        "shared layer {l} of {layers} (reading layer {source}): listed twice, \
                         in a KV group, out of range, or its source keeps no K/V"
                    )))
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
        if config.backend == StorageBackend::Dense {
            config.layout.check_dense()?;
        }
        config.layout.check()?;
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
            disk: None,
            snapshots: SnapshotStore::new(recurrent.snapshots),
            recurrent,
            layer_recurrent,
            kv_source,
        })
    }

    /// The model's recurrent layers and the state a sequence holds in them.
    pub fn recurrent(&self) -> &RecurrentConfig {
        &self.recurrent
    }

    /// Whether the model has recurrent layers (a hybrid: Qwen3.5, Granite
    /// 4), whose state cannot be truncated like K/V.
    pub fn has_recurrent_layers(&self) -> bool {
        !self.recurrent.layers.is_empty()
    }

    /// Recurrent-state snapshots kept for the prefix cache.
    pub fn snapshots(&self) -> usize {
        self.snapshots.len()
    }

    /// Recurrent-state snapshots taken and evicted since the cache was
    /// built.
    pub fn snapshot_counts(&self) -> (u64, u64) {
        (self.snapshots.taken, self.snapshots.evicted)
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

    /// Whether some group keeps fewer keys than its layers' attention
    /// sees (`--max-kv-size`): a step built before the previous step's
    /// [`KvCache::trim`] would then attend to keys the trim drops. A
    /// sliding-window group alone keeps `window - 1` keys
    /// ([`KvGroupConfig::keep_for`]) and its layers mask every key past
    /// the window themselves, so a step queued behind another (pipelined
    /// decode, whose trims also keep the queued step's key:
    /// [`KvCache::trim_keeping`]) may see one key past its window.
    pub fn trims_inside_attention(&self) -> bool {
        self.groups.iter().any(|g| {
            g.config.keep.is_some()
                && (g.config.window.is_none()
                    || g.config.keep != KvGroupConfig::keep_for(g.config.window, None))
        })
    }

    /// Sequences alive (handles not yet reclaimed).
    pub fn live_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// A new empty sequence at `[0, 0)`.
    pub fn new_sequence(&mut self) -> KvSequence {
        let dense = match self.config.backend {
            StorageBackend::Dense => {
                let no_kv: Vec<usize> = (0..self.kv_source.len())
                    .filter(|&l| self.kv_source[l] != l)
                    .chain(self.recurrent.layers.iter().copied())
                    .collect();
                Some(DenseStorage::new(self.config.layout, 0).without(&no_kv))
            }
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
            recurrent: SeqRecurrent::default(),
            reserved: None,
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
            recurrent: SeqRecurrent {
                entries: state.recurrent.entries.clone(),
                ..SeqRecurrent::default()
            },
            reserved: None,
        };
        Ok(self.insert_sequence(forked))
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
}
