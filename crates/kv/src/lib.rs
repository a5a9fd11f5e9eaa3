//! The KV cache (see docs/architecture.md, crates/kv): the paged block pool,
//! per-sequence block tables, the prefix cache, and the tensors behind them.
//! The bookkeeping (pool.rs, hash.rs, sequence.rs, prefix.rs) is plain Rust
//! with no MLX call; the tensor side (storage.rs: pool arrays, gather,
//! scatter, block copies, dense buffers) follows the plain-data instructions
//! the bookkeeping returns. cache/ joins them into the engine's
//! [`KvCache`]; step.rs is the view one forward reads and writes through.
//!
//! Units: a *position* is an absolute token index in a sequence (its RoPE
//! position); a *block* holds `block_size` consecutive positions; a *slot* is
//! one token's place inside one block.
//!
//! - [`BlockPool`] (pool.rs): block ids, reference counts, the LRU free queue
//!   and the hash → block map. Knows nothing of sequences or models.
//! - [`BlockHash`] (hash.rs): the stable, seeded chained hash of a full block.
//! - [`SequenceBlocks`] (sequence.rs): one sequence's `[start, end)` and its
//!   block table; grows by [`SequenceBlocks::append_slots`], shrinks only by
//!   [`SequenceBlocks::truncate_tail`] and [`SequenceBlocks::drop_front`].
//! - [`PrefixCache`] (prefix.rs): longest-prefix lookup and donation of full
//!   blocks, and its counters.
//! - [`Admission`] (admission.rs): the worst case a request may hold and
//!   the most tokens it may generate in a pool, in closed form;
//!   [`GroupAdmission`] the same over KV groups.
//! - [`KvGroupConfig`] (group.rs): a KV group, the layers that share one
//!   attention window; each group has its own pool, tables and keep (the
//!   keys a sequence holds between steps).
//!
//! - [`RecurrentConfig`] (recurrent.rs): layers that keep a fixed-size
//!   recurrent state per sequence instead of K/V (Gated DeltaNet), kept
//!   as entries by position and, for the prefix cache, as snapshots at
//!   block boundaries.
//!
//! - [`disk`]: the prefix cache's disk tier, block files under a
//!   directory that outlive the process ([`KvCache::open_disk_tier`]).
//!
//! The engine thread owns one pool per KV group; every call is synchronous and O(blocks
//! touched), except the `counts`/`check_invariants` helpers, O(pool).

mod admission;
mod cache;
pub mod disk;
mod error;
mod group;
mod hash;
mod pool;
mod prefix;
mod recurrent;
mod replica;
mod sequence;
mod step;
mod storage;

pub use admission::{Admission, GroupAdmission, RequestBlocks};
pub use cache::{
    DiskTierConfig, KvCache, KvCacheConfig, KvSequence, PrefixCacheConfig, ResetOutcome,
    RowReserve, StepReservation, StorageBackend,
};
pub use error::{KvError, PoolExhausted};
pub use group::{KvGroupConfig, LayerState};
pub use hash::{hash_full_blocks, BlockHash, BLOCK_HASH_SEED};
pub use pool::{BlockCounts, BlockId, BlockPool};
pub use prefix::{hold_from, GroupHit, PrefixCache, PrefixCacheStats};
pub use recurrent::{RecurrentConfig, ENTRIES_KEPT};
pub use replica::{CopyLayout, KvReplica, ReplicaStep, RowLayout, StepLayout};
pub use sequence::{Appended, BlockCopy, SequenceBlocks, Slot};
pub use step::{AttentionKv, PagedKv, PagedQuant, StepKv};
pub use storage::{KvCacheDtype, KvLayout, KvQuant, DENSE_GROW_STEP};
