//! How a [`KvCache`] is built: its storage backend, sizes and prefix-cache
//! options, and what a prefix-cache reset frees.

use std::fmt;

use crate::storage::KvLayout;

#[cfg(doc)]
use super::KvCache;

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
