//! Batch-invariant execution (`--deterministic`): every row's result is
//! bit for bit the same whatever else shares its step (batch-mates, how a
//! prompt was chunked, which part came from the prefix cache).
//!
//! In floating point the order of a reduction changes its rounding, and
//! the kernels a step runs pick their order from the step's shape: a
//! matmul of 1 row takes a GEMV (a quantized one `qmv`), of 64 rows a tiled
//! GEMM, and a paged-attention launch splits rows' keys into parts when the
//! batch is small. A row computed alone and the same row computed beside
//! others then differ in the last bit, and in bfloat16 a greedy choice at
//! a near tie can flip. The remedy is the one of vLLM's batch-invariant
//! mode and SGLang's deterministic inference (Thinking Machines, "Defeating
//! Nondeterminism in LLM Inference", 2025): make each kernel's reduction
//! order independent of the batch. Here:
//!
//! - every product with a weight matrix ([`crate::layers::Matrix::apply`])
//!   runs on row chunks ([`Chunking`]), short chunks padded with zero
//!   rows, so every row goes through the same kernel (on a GPU at one
//!   shape); a row's output does not depend on the other rows of its
//!   chunk, as no kernel reduces across rows;
//! - grouped projections ([`crate::layers::LinearGroup`]) always take their
//!   fused product, never the per-part one;
//! - on a GPU with paged storage, every query — prefill and decode — is
//!   attended by the paged kernel as a row of its own, over its own live
//!   keys, and the kernel never splits keys into parts
//!   ([`mlxcel_mlx::set_paged_attention_split`]): a query's attention is
//!   one walk over its keys in position order;
//! - mixture-of-experts layers never sort token-expert pairs (the sorted
//!   gathered matmul rounds differently from the unsorted one).
//!
//! The state is per thread (the engine thread's), set before the model
//! loads.

use std::cell::Cell;

/// How batch-invariant execution cuts a matmul's input rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunking {
    /// Rows per chunk, at most.
    pub rows: usize,
    /// Rows a chunk is padded to with zero rows, at least (`rows` pads
    /// every chunk to one shape).
    pub pad_to: usize,
}

impl Chunking {
    /// The chunking for this machine. On a GPU, chunks of exactly 64 rows
    /// (one tile of MLX's GEMM and quantized GEMM kernels, and
    /// [`crate::layers::FUSED_MAX_ROWS`]): one shape, one kernel. On a CPU,
    /// chunks of 2 to `mlxcel_mlx::skinny_max_rows` rows (8 with AVX2, 48
    /// with AVX-512), which all take the skinny GEMM, whose output rows are
    /// bit for bit the same whatever the row count (a single row is padded
    /// to 2: it would take the GEMV, and more rows BLAS).
    pub fn for_device(gpu: bool) -> Self {
        if gpu {
            Chunking {
                rows: 64,
                pad_to: 64,
            }
        } else {
            Chunking {
                rows: mlxcel_mlx::skinny_max_rows().max(2),
                pad_to: 2,
            }
        }
    }
}

thread_local! {
    /// The chunking of this thread's forwards (`None`: off).
    static CHUNKING: Cell<Option<Chunking>> = const { Cell::new(None) };
}

/// Turns batch-invariant execution on with `chunking` for the forwards this
/// thread builds (`None`: off), and stops the paged-attention kernels this
/// thread launches from splitting rows into parts while it is on. The
/// engine thread sets it before it loads the model, so two engines in one
/// process (tests) keep their own settings.
pub fn set(chunking: Option<Chunking>) {
    let chunking = chunking.map(|c| Chunking {
        rows: c.rows.max(1),
        pad_to: c.pad_to.min(c.rows.max(1)),
    });
    CHUNKING.with(|c| c.set(chunking));
    mlxcel_mlx::set_paged_attention_split(chunking.is_none());
}

/// The chunking in force on this thread, `None` when batch-invariant
/// execution is off.
pub fn chunking() -> Option<Chunking> {
    CHUNKING.with(Cell::get)
}

/// Whether batch-invariant execution is on for this thread.
pub fn enabled() -> bool {
    chunking().is_some()
}
