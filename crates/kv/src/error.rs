//! The errors of the KV bookkeeping.
//!
//! Every error leaves the pool and the sequence it was called on exactly as
//! they were before the call (operations validate first, then mutate), so a
//! failing request can be failed alone while the engine goes on
//! (docs/architecture.md, invariant 6).

use crate::pool::BlockId;

/// The pool has fewer allocatable blocks than a request asked for.
///
/// Not a bug: the scheduler answers it by letting the request wait (or by
/// preempting another one). Nothing was allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV pool exhausted: {requested} blocks requested, {free} free")]
pub struct PoolExhausted {
    /// Blocks asked for.
    pub requested: usize,
    /// Blocks allocatable at the time of the call (empty plus evictable cached).
    pub free: usize,
}

/// An error of the block pool, a sequence's block table or the prefix cache.
///
/// Apart from [`KvError::PoolExhausted`], every variant means the caller broke
/// a rule of the API (a bug above this crate), reported instead of panicking.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Not enough free blocks; see [`PoolExhausted`].
    #[error(transparent)]
    PoolExhausted(#[from] PoolExhausted),
    /// A pool needs a block size of at least one token.
    #[error("block size must be at least 1 token")]
    ZeroBlockSize,
    /// A pool's block count must fit the `u32` of a [`BlockId`] (minus the
    /// reserved link value).
    #[error("{0} blocks do not fit in a u32 block id")]
    TooManyBlocks(usize),
    /// A block id outside `0..total_blocks`.
    #[error("block {block} is out of range (pool has {total} blocks)")]
    UnknownBlock {
        /// The id that was passed.
        block: BlockId,
        /// Blocks in the pool.
        total: usize,
    },
    /// A block was freed more times than it was referenced.
    #[error("block {0} freed while unreferenced")]
    DoubleFree(BlockId),
    /// A hash may only be registered on a block that someone references.
    #[error("block {0} is not referenced; cannot register a hash on it")]
    NotReferenced(BlockId),
    /// A block already carries a different hash: its contents were described
    /// twice in two different ways.
    #[error("block {0} already carries a different hash")]
    HashMismatch(BlockId),
    /// A shrink asked for a position outside the sequence's `[start, end)`.
    #[error("position {requested} is outside the sequence's [{start}, {end}) (tokens)")]
    PositionOutOfRange {
        /// Requested new boundary, in tokens (absolute position).
        requested: usize,
        /// The sequence's first live position.
        start: usize,
        /// One past the sequence's last live position.
        end: usize,
    },
    /// Fewer token ids were passed than the sequence holds.
    #[error("{got} token ids passed for a sequence of {needed} tokens")]
    TooFewTokens {
        /// Token ids needed (the sequence's `end`).
        needed: usize,
        /// Token ids passed.
        got: usize,
    },
    /// A sequence and a pool with different block sizes were mixed.
    #[error("block size mismatch: sequence uses {sequence} tokens, pool {pool}")]
    BlockSizeMismatch {
        /// The sequence's block size, in tokens.
        sequence: usize,
        /// The pool's block size, in tokens.
        pool: usize,
    },
    /// MLX failed on the tensor side (allocation, scatter, gather).
    #[error(transparent)]
    Mlx(#[from] mlxcel_mlx::Error),
    /// A cache configuration that can't be built (e.g. a quantized KV
    /// dtype for heads the quantizer can't split, or on dense storage).
    #[error("{0}")]
    Config(String),
    /// A consistency check failed (see the `check_invariants` helpers).
    #[error("KV bookkeeping invariant violated: {0}")]
    Invariant(String),
}
