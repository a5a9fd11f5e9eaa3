//! Safe Rust over MLX's C++ API — the only C++ boundary of mlxcel.
//!
//! [`Array`] is a lazily evaluated MLX array. Every operation returns
//! [`Result`]: an exception thrown by MLX (a shape mismatch in
//! `broadcast_shapes`, a failed allocation during `eval`, a missing file) is
//! caught at the bridge and becomes an [`Error`]; the process goes on.
//!
//! What MLX does inside `eval` (measured on MLX 0.32.4, CPU backend): each
//! primitive's `eval_cpu` runs on the calling thread, and an exception it
//! throws (e.g. LAPACK's LU failing on a singular matrix) reaches us as an
//! `Err` from [`eval`] / [`Array::to_vec_f32`] — tested in `tests/errors.rs`.
//! The kernels themselves run on the stream's worker thread, where nothing
//! is caught: in particular the CPU allocator does not check `malloc`'s
//! result, so an allocation the machine cannot back is a null-pointer write
//! on that thread, and the process dies. MLX cannot report that as an error,
//! so the engine must never ask for it: the KV pool is sized from a memory
//! budget and prefill is chunked, which bounds every step's allocations.

pub mod distributed;
mod dtype;
mod ffi;
mod ops;

pub use dtype::Dtype;
pub use ops::*;

use cxx::UniquePtr;
use ffi::bridge;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bridge calls made since the process started, for profiling: how large a
/// step's graph is and how often it talks to the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallCounts {
    /// Graph nodes built (every op that returned a new array).
    pub ops: u64,
    /// Arrays built from host memory (token ids, positions, slot indices, masks).
    pub uploads: u64,
    /// `eval` / `async_eval` calls.
    pub evals: u64,
    /// Reads of an array back to host memory (each one waits for the device).
    pub reads: u64,
}

impl CallCounts {
    /// Counts made between `earlier` and `self`.
    pub fn since(&self, earlier: &CallCounts) -> CallCounts {
        CallCounts {
            ops: self.ops - earlier.ops,
            uploads: self.uploads - earlier.uploads,
            evals: self.evals - earlier.evals,
            reads: self.reads - earlier.reads,
        }
    }
}

static OPS: AtomicU64 = AtomicU64::new(0);
static UPLOADS: AtomicU64 = AtomicU64::new(0);
static EVALS: AtomicU64 = AtomicU64::new(0);
static READS: AtomicU64 = AtomicU64::new(0);

fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The bridge calls made so far (all threads).
pub fn call_counts() -> CallCounts {
    CallCounts {
        ops: OPS.load(Ordering::Relaxed),
        uploads: UPLOADS.load(Ordering::Relaxed),
        evals: EVALS.load(Ordering::Relaxed),
        reads: READS.load(Ordering::Relaxed),
    }
}

/// An MLX failure, with MLX's own message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mlx: {0}")]
pub struct Error(pub String);

impl Error {
    /// Whether MLX failed to allocate memory (a C++ `std::bad_alloc`, or
    /// an allocator of the CPU, Metal or CUDA backend refusing a buffer):
    /// the request asked for more than the device holds, not a bug.
    pub fn is_out_of_memory(&self) -> bool {
        let m = self.0.to_ascii_lowercase();
        m.contains("bad_alloc")
            || m.contains("out of memory")
            || m.contains("unable to allocate")
            || m.contains("failed to allocate")
            || (m.contains("malloc") && m.contains("allocate"))
    }
}

impl From<cxx::Exception> for Error {
    fn from(e: cxx::Exception) -> Self {
        Error(e.what().to_string())
    }
}

/// Result of every MLX call.
pub type Result<T> = std::result::Result<T, Error>;

/// A (lazy) MLX array. Cheap to clone: clones share the same buffer.
pub struct Array(UniquePtr<bridge::array>);

// SAFETY: an MLX array is a reference-counted handle whose shared state is
// guarded by MLX itself; mlxcel evaluates a graph from one thread at a time
// (the engine thread), and moving the handle between threads is what MLX's
// own Python bindings do when they release the GIL.
unsafe impl Send for Array {}
// SAFETY: `&Array` only exposes reads of immutable metadata or builds new
// graph nodes from it; see `Send` above.
unsafe impl Sync for Array {}

impl Array {
    fn wrap(p: std::result::Result<UniquePtr<bridge::array>, cxx::Exception>) -> Result<Array> {
        count(&OPS);
        Self::wrap_uncounted(p)
    }

    fn wrap_uncounted(
        p: std::result::Result<UniquePtr<bridge::array>, cxx::Exception>,
    ) -> Result<Array> {
        let p = p?;
        if p.is_null() {
            return Err(Error("null array".into()));
        }
        Ok(Array(p))
    }

    pub(crate) fn raw(&self) -> &bridge::array {
        // A non-null pointer is checked in `wrap`, the only constructor.
        self.0.as_ref().expect("Array is never null")
    }

    /// A float32 array of `shape` from row-major `data`.
    ///
    /// # Errors
    /// `data.len()` must equal the product of `shape`.
    pub fn from_f32(data: &[f32], shape: &[i32]) -> Result<Array> {
        check_len(data.len(), shape)?;
        count(&UPLOADS);
        Self::wrap_uncounted(bridge::from_f32(data, shape))
    }

    /// An int32 array of `shape` from row-major `data`.
    pub fn from_i32(data: &[i32], shape: &[i32]) -> Result<Array> {
        check_len(data.len(), shape)?;
        count(&UPLOADS);
        Self::wrap_uncounted(bridge::from_i32(data, shape))
    }

    /// A uint32 array of `shape` from row-major `data` (token ids).
    pub fn from_u32(data: &[u32], shape: &[i32]) -> Result<Array> {
        check_len(data.len(), shape)?;
        count(&UPLOADS);
        Self::wrap_uncounted(bridge::from_u32(data, shape))
    }

    /// An array of `shape` and `dtype` from its raw row-major bytes, in
    /// the machine's byte order as MLX keeps them (no conversion; the
    /// inverse of [`Array::to_bytes`]).
    ///
    /// # Errors
    /// `data` not `shape`'s element count times the dtype's size.
    pub fn from_bytes(data: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        count(&UPLOADS);
        Self::wrap_uncounted(bridge::from_bytes(data, shape, dtype as i32))
    }

    /// The array's raw row-major bytes (evaluates it), `nbytes()` long.
    ///
    /// # Errors
    /// An evaluation failure.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        count(&READS);
        let mut out = vec![0u8; self.nbytes()];
        bridge::copy_bytes(self.raw(), &mut out)?;
        Ok(out)
    }

    /// A float32 scalar (shape `[]`).
    pub fn scalar(v: f32) -> Result<Array> {
        count(&UPLOADS);
        Self::wrap_uncounted(bridge::scalar_f32(v))
    }

    /// The array's shape.
    pub fn shape(&self) -> Vec<i32> {
        bridge::shape(self.raw()).unwrap_or_default()
    }

    /// Size of dimension `axis` (negative counts from the end).
    ///
    /// # Errors
    /// When `axis` is out of range.
    pub fn dim(&self, axis: i32) -> Result<i32> {
        let s = self.shape();
        let n = s.len() as i32;
        let i = if axis < 0 { n + axis } else { axis };
        if i < 0 || i >= n {
            return Err(Error(format!("axis {axis} out of range for shape {s:?}")));
        }
        Ok(s[i as usize])
    }

    /// The array's element type.
    pub fn dtype(&self) -> Dtype {
        bridge::dtype_code(self.raw())
            .ok()
            .and_then(Dtype::from_code)
            .unwrap_or(Dtype::Float32)
    }

    /// Size of the array's data in bytes.
    pub fn nbytes(&self) -> usize {
        bridge::nbytes(self.raw()).unwrap_or(0)
    }

    /// Evaluates the array and returns the size in bytes of the buffer
    /// holding its data: larger than [`Array::nbytes`] when the array is a
    /// view (a slice) of a larger array, whose whole buffer it keeps alive.
    ///
    /// # Errors
    /// MLX errors of the evaluation.
    pub fn buffer_bytes(&self) -> Result<usize> {
        Ok(bridge::buffer_bytes(self.raw())?)
    }

    /// Evaluates and copies the array out as float32, row-major.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        count(&READS);
        Ok(bridge::to_f32_vec(self.raw())?)
    }

    /// Evaluates and copies the array out as int32, row-major.
    pub fn to_vec_i32(&self) -> Result<Vec<i32>> {
        count(&READS);
        Ok(bridge::to_i32_vec(self.raw())?)
    }

    /// Evaluates and copies the array out as uint32, row-major.
    pub fn to_vec_u32(&self) -> Result<Vec<u32>> {
        count(&READS);
        Ok(bridge::to_u32_vec(self.raw())?)
    }

    /// Evaluates this array.
    pub fn eval(&self) -> Result<()> {
        count(&EVALS);
        Ok(bridge::eval_one(self.raw())?)
    }
}

impl Clone for Array {
    fn clone(&self) -> Self {
        // Copying a handle (a shared_ptr copy) cannot throw.
        Array::wrap_uncounted(bridge::clone_array(self.raw())).expect("copying an array handle")
    }
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Array({:?}, {:?})", self.shape(), self.dtype())
    }
}

fn check_len(len: usize, shape: &[i32]) -> Result<()> {
    let want: i64 = shape.iter().map(|&d| d as i64).product();
    if shape.iter().any(|&d| d < 0) || want != len as i64 {
        return Err(Error(format!(
            "data of {len} elements does not fill shape {shape:?}"
        )));
    }
    Ok(())
}

/// Whether MLX's CPU matmuls go through mlxcel's GEMM-to-GEMV forwarder
/// (`src/gemv_forward.cc`) rather than straight to a BLAS library.
pub fn gemv_forwarding_active() -> bool {
    bridge::gemv_forwarding_active().unwrap_or(false)
}

/// The most rows (tokens) a float32 product against a `[out, in]` weight
/// sends to mlxcel's skinny GEMM (`src/skinny_gemm.cc`, one pass over the
/// weights) instead of BLAS: 48 with AVX-512, 8 with AVX2, 0 elsewhere;
/// past one register tile (6 rows with AVX-512) only while the rows fit in
/// 512 KiB (`rows · in · 4` bytes). Among the products it takes (2 rows or
/// more), a row's product is bit for bit the same whatever the rows beside
/// it; one row goes to GEMV and more rows to BLAS, which round otherwise.
pub fn skinny_max_rows() -> usize {
    bridge::skinny_max_rows().map_or(0, |n| n.max(0) as usize)
}

/// Whether MLX has a GPU backend on this machine (Metal or CUDA).
pub fn gpu_available() -> bool {
    bridge::gpu_available().unwrap_or(false)
}

/// Whether MLX's CUDA backend uses cuDNN's fused attention (it builds a
/// cuDNN graph for every new query/key shape, ~50-800 ms each on an H200;
/// see docs/performance.md). Call before the first attention is evaluated;
/// a `MLX_CUDA_USE_CUDNN_SDPA` already in the environment wins. No effect on
/// other backends.
pub fn set_cudnn_attention(enabled: bool) -> Result<()> {
    Ok(bridge::set_cudnn_attention(enabled)?)
}

/// Where MLX's CUDA backend keeps the kernels it compiles (PTX), so a
/// restart does not compile them again (MLX's default is under `/tmp`,
/// which many systems empty at boot; a fresh H200 spends ~4 minutes
/// compiling what the engine needs). Call before the first evaluation; a
/// `MLX_PTX_CACHE_DIR` already in the environment wins; MLX creates the
/// directory, and compiles without a cache when it cannot.
///
/// # Errors
/// A path that is not UTF-8.
pub fn set_kernel_cache_dir(dir: &std::path::Path) -> Result<()> {
    let dir = dir
        .to_str()
        .ok_or_else(|| Error(format!("{} is not UTF-8", dir.display())))?;
    Ok(bridge::set_kernel_cache_dir(dir)?)
}

/// Makes the GPU (`true`) or the CPU (`false`) MLX's default device.
pub fn use_device(gpu: bool) -> Result<()> {
    Ok(bridge::use_device(gpu)?)
}

/// Whether MLX's default device ([`use_device`]) is the GPU.
pub fn default_device_is_gpu() -> bool {
    bridge::default_device_is_gpu().unwrap_or(false)
}

/// The MLX version string of the loaded `libmlx`.
pub fn version() -> String {
    bridge::version().unwrap_or_default()
}

/// What MLX reports of the GPU (`true`) or the CPU (`false`): its name,
/// then its architecture in parentheses when MLX gives one (a CPU:
/// `Intel(R) Xeon(R) Processor (x86_64)`).
///
/// # Errors
/// The device is not there (no GPU backend), or MLX cannot describe it.
pub fn device_name(gpu: bool) -> Result<String> {
    Ok(bridge::device_name(gpu)?)
}
