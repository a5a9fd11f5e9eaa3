//! Shared layers: linear (dense or affine-quantized), linears over one
//! input fused into one matmul ([`LinearGroup`]), embedding, RMSNorm, the
//! gated SiLU MLP. Each has `load(ctx, path)` with `path` mirroring the
//! checkpoint's tensor names, and `forward`.

use std::cell::Cell;

use crate::{config::QuantSpec, ModelError, TensorParallel, Weights};
use mlxcel_mlx::{Array, Dtype};

/// How quantized weights are used at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightMode {
    /// Keep them quantized and use `quantized_matmul` (GPU default: 4-bit
    /// weights read 4x less memory per token).
    Quantized,
    /// Dequantize once at load into the compute dtype and use dense matmul
    /// (CPU default: MLX's CPU quantized matmul runs ~1.9 GFLOP/s while dense
    /// float32 matmul through OpenBLAS is far faster).
    Dequantized,
}

/// What loading needs besides the tensors.
pub struct LoadContext<'a> {
    pub weights: &'a mut Weights,
    pub quantization: &'a crate::config::Quantization,
    /// Dtype activations and dense weights are computed in.
    pub dtype: Dtype,
    pub mode: WeightMode,
    /// This rank's shard under tensor parallelism; `None` loads whole
    /// layers.
    pub shard: Option<TensorParallel>,
}

impl LoadContext<'_> {
    /// Takes tensor `name`, cast to the compute dtype.
    pub fn float(&mut self, name: &str) -> Result<Array, ModelError> {
        Ok(self.weights.take(name)?.astype(self.dtype)?)
    }

    fn quant_of(&self, path: &str) -> Result<Option<QuantSpec>, ModelError> {
        if !self.weights.contains(&format!("{path}.scales")) {
            return Ok(None);
        }
        self.quantization.for_module(path).map(Some).ok_or_else(|| {
            ModelError::Config(format!(
                "{path} is quantized but config has no quantization"
            ))
        })
    }
}

/// A quantized matrix `[out, in]` stored as MLX affine groups.
#[derive(Debug, Clone)]
pub struct QuantizedMatrix {
    /// Packed weights, uint32 `[out, in · bits / 32]`.
    pub weight: Array,
    /// `[out, in / group_size]`, compute dtype.
    pub scales: Array,
    /// `[out, in / group_size]`, compute dtype.
    pub biases: Array,
    pub spec: QuantSpec,
}

impl QuantizedMatrix {
    /// Weights of the matrix (`out x in` elements).
    pub fn weights(&self) -> usize {
        quantized_weights(&self.scales, self.spec.group_size)
    }

    fn dequantize(&self, dtype: Dtype) -> Result<Array, ModelError> {
        Ok(self
            .weight
            .dequantize(
                &self.scales,
                &self.biases,
                self.spec.group_size,
                self.spec.bits,
            )?
            .astype(dtype)?)
    }
}

thread_local! {
    /// [`dequantized_matmul_rows`] of this thread's forwards.
    static DEQUANTIZED_MATMUL_ROWS: Cell<Option<usize>> = const { Cell::new(None) };
    /// [`dequantized_matmul_min_weights`] of this thread's forwards.
    static DEQUANTIZED_MATMUL_MIN_WEIGHTS: Cell<usize> = const { Cell::new(0) };
}

/// Sets the input row count (tokens of a step, summed over its rows) from
/// which this thread's products with a quantized matrix dequantize the
/// matrix for the product and run a dense matmul instead of the quantized
/// one (`None`: always the quantized matmul). The engine sets it before it
/// loads a model (`--dequant-matmul-rows`).
///
/// Why: a quantized matmul kernel reads 4x fewer weight bytes, which is
/// what decode (a few rows) is bound by, but over many rows (prefill) the
/// product is compute-bound and a dense GEMM runs far faster than the
/// quantized one. Measured on an H100 with MLX 0.32.4 (bfloat16, 4-bit
/// group 64, `benches/results/2026-12-07-dequantized-matmul-h100.md`):
/// at 1,024 rows, Qwen2.5-1.5B's gate/up product takes 0.475 ms quantized
/// and 0.212 ms dequantized then dense (the dequantization included), its
/// down product 0.327 and 0.139 ms; at 512 rows the dense one wins by
/// 1.2-1.7x on four of the six shapes measured and loses 2-12% on the
/// other two (small ones); at 256 the quantized one still wins on the
/// gate/up shape. The dequantized matrix is a temporary of the product.
/// Under batch-invariant chunking ([`crate::invariant`]) every chunk takes
/// the same kernel: dense only when a chunk of `pad_to` rows reaches the
/// threshold.
pub fn set_dequantized_matmul_rows(rows: Option<usize>) {
    DEQUANTIZED_MATMUL_ROWS.with(|c| c.set(rows.filter(|&r| r > 0)));
}

/// The row count set by [`set_dequantized_matmul_rows`] on this thread.
pub fn dequantized_matmul_rows() -> Option<usize> {
    DEQUANTIZED_MATMUL_ROWS.with(Cell::get)
}

/// Sets the fewest weights (`out x in` elements) a quantized matrix must
/// have for [`set_dequantized_matmul_rows`] to apply to it on this thread;
/// smaller matrices keep the quantized matmul at any row count (0: every
/// matrix qualifies). The engine sets it with the row count.
///
/// Why: the product of a small matrix is bound by its launch, not its
/// arithmetic, even over a thousand rows, so dequantizing it only adds a
/// kernel and a temporary to the step. Measured on an H100 (MLX 0.32.4,
/// bfloat16, 4-bit group 64, 1,024-token prefill,
/// `benches/results/2026-12-07-dequantized-matmul-end-to-end-h100.md`): SmolLM2-135M
/// (matrices of at most 0.9 Mi weights) prefilled ~101k tok/s with every
/// product quantized and ~70k with every product from 512 rows
/// dequantized, while Qwen2.5-1.5B (gate, up and down of 13.1 Mi weights)
/// went from 34.6k to 60.4k; with this floor at 4 Mi (only those three
/// dequantized), SmolLM2 93.4k against 90.1k quantized and Qwen2.5-1.5B
/// 54.5k against 33.7k.
pub fn set_dequantized_matmul_min_weights(weights: usize) {
    DEQUANTIZED_MATMUL_MIN_WEIGHTS.with(|c| c.set(weights));
}

/// The floor set by [`set_dequantized_matmul_min_weights`] on this thread.
pub fn dequantized_matmul_min_weights() -> usize {
    DEQUANTIZED_MATMUL_MIN_WEIGHTS.with(Cell::get)
}

/// Whether this thread's product over `rows` input rows with a quantized
/// matrix of `weights` weights dequantizes it and runs dense: `rows`
/// reaches [`dequantized_matmul_rows`] and `weights`
/// [`dequantized_matmul_min_weights`].
pub fn dequantizes_for(rows: usize, weights: usize) -> bool {
    dequantized_matmul_rows().is_some_and(|min| rows >= min)
        && weights >= dequantized_matmul_min_weights()
}

/// Weights (elements before packing) of an affine-quantized tensor from
/// its scales `[..., out, in / group_size]`: every scale's group.
pub fn quantized_weights(scales: &Array, group_size: i32) -> usize {
    let groups: i64 = scales.shape().iter().map(|&d| i64::from(d)).product();
    (groups * i64::from(group_size)).max(0) as usize
}

/// Runs `f` with [`dequantized_matmul_rows`] off on this thread (then
/// restores it). For LM heads: with prompt logprobs, a vocabulary-wide
/// head multiplies every prompt position, and dequantizing it would add
/// vocab x hidden elements (467 MB for Qwen2.5-1.5B in bfloat16) that the
/// KV budget never counted.
pub fn with_quantized_matmul<T>(f: impl FnOnce() -> T) -> T {
    /// Restores the kept setting, also when `f` panics (the worker
    /// catches a forward's panic and goes on serving).
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            set_dequantized_matmul_rows(self.0);
        }
    }
    let _restore = Restore(dequantized_matmul_rows());
    set_dequantized_matmul_rows(None);
    f()
}

/// The weight of a linear layer.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// Dense, `[out, in]` contiguous as in the checkpoint: `x @ wᵀ` streams
    /// weight rows, the layout the CPU paths want (GEMV for one row, the
    /// skinny GEMM of `mlxcel-mlx` for 2 to `mlxcel_mlx::skinny_max_rows()`
    /// rows of decode and verification, which reads every weight row once).
    Dense(Array),
    Quantized(QuantizedMatrix),
}

impl Matrix {
    fn load(ctx: &mut LoadContext<'_>, path: &str) -> Result<Matrix, ModelError> {
        let weight = ctx.weights.take(&format!("{path}.weight"))?;
        let dense = |w: Array| -> Result<Matrix, ModelError> { Ok(Matrix::Dense(w.contiguous()?)) };
        match ctx.quant_of(path)? {
            None => dense(weight.astype(ctx.dtype)?),
            Some(spec) => {
                let q = QuantizedMatrix {
                    weight,
                    scales: ctx.float(&format!("{path}.scales"))?,
                    biases: ctx.float(&format!("{path}.biases"))?,
                    spec,
                };
                match ctx.mode {
                    WeightMode::Quantized => Ok(Matrix::Quantized(q)),
                    WeightMode::Dequantized => dense(q.dequantize(ctx.dtype)?),
                }
            }
        }
    }

    /// `x @ selfᵀ`: `[..., in] -> [..., out]`. Under batch-invariant
    /// execution ([`crate::invariant`]) the rows go through in chunks,
    /// short ones padded with zero rows, so a row's output is the same
    /// whatever rows share its step.
    pub fn apply(&self, x: &Array) -> Result<Array, ModelError> {
        match crate::invariant::chunking() {
            None => self.product(x),
            Some(c) => self.apply_chunked(x, c),
        }
    }

    /// [`Matrix::apply`] in chunks of `c.rows` rows, each padded to at
    /// least `c.pad_to`.
    fn apply_chunked(&self, x: &Array, c: crate::invariant::Chunking) -> Result<Array, ModelError> {
        let mut shape = x.shape();
        let Some(&input) = shape.last() else {
            return self.product(x);
        };
        let rows = input_rows(x);
        let flat = x.reshape(&[rows, input])?;
        let (step, pad_to) = (c.rows as i32, c.pad_to as i32);
        // One kernel for every chunk, whatever its row count: dense when
        // even the shortest chunk (`pad_to` rows) reaches the threshold,
        // dequantized once for all of them.
        let dense = self.dequantized_for(c.pad_to, x.dtype())?;
        let mut parts = Vec::with_capacity((rows / step + 1) as usize);
        let mut start = 0;
        while start < rows {
            let n = step.min(rows - start);
            let chunk = flat.slice(&[start, 0], &[start + n, input])?;
            let y = if n < pad_to {
                let zeros = mlxcel_mlx::zeros(&[pad_to - n, input], x.dtype())?;
                let padded = mlxcel_mlx::concatenate(&[&chunk, &zeros], 0)?;
                let y = self.product_with(&padded, dense.as_ref())?;
                let out = y.dim(1)?;
                y.slice(&[0, 0], &[n, out])?
            } else {
                self.product_with(&chunk, dense.as_ref())?
            };
            parts.push(y);
            start += n;
        }
        let y = match parts.as_slice() {
            [one] => one.clone(),
            _ => {
                let refs: Vec<&Array> = parts.iter().collect();
                mlxcel_mlx::concatenate(&refs, 0)?
            }
        };
        if let Some(last) = shape.last_mut() {
            *last = y.dim(1)?;
        }
        Ok(y.reshape(&shape)?)
    }

    /// `x @ selfᵀ` as one product. A quantized matrix over at least
    /// [`dequantized_matmul_rows`] input rows is dequantized into `x`'s
    /// dtype for this product and multiplied densely.
    fn product(&self, x: &Array) -> Result<Array, ModelError> {
        let dense = self.dequantized_for(input_rows(x) as usize, x.dtype())?;
        self.product_with(x, dense.as_ref())
    }

    /// The matrix dequantized into `dtype` when it is quantized, has at
    /// least [`dequantized_matmul_min_weights`] weights and a product over
    /// `rows` input rows should run dense ([`dequantized_matmul_rows`]);
    /// `None` otherwise.
    fn dequantized_for(&self, rows: usize, dtype: Dtype) -> Result<Option<Array>, ModelError> {
        match self {
            Matrix::Quantized(q) if dequantizes_for(rows, q.weights()) => {
                Ok(Some(q.dequantize(dtype)?))
            }
            _ => Ok(None),
        }
    }

    /// `x @ selfᵀ`, with `dense` (this matrix dequantized) in place of the
    /// quantized matrix when given.
    fn product_with(&self, x: &Array, dense: Option<&Array>) -> Result<Array, ModelError> {
        Ok(match (self, dense) {
            (_, Some(w)) | (Matrix::Dense(w), None) => x.matmul(&w.t()?)?,
            (Matrix::Quantized(q), None) => x.quantized_matmul(
                &q.weight,
                &q.scales,
                &q.biases,
                true,
                q.spec.group_size,
                q.spec.bits,
            )?,
        })
    }

    /// Rows `ids` of the `[out, in]` matrix (embedding lookup):
    /// `[n] -> [n, in]`.
    pub fn rows(&self, ids: &Array, dtype: Dtype) -> Result<Array, ModelError> {
        Ok(match self {
            Matrix::Dense(w) => w.take(ids, 0)?,
            Matrix::Quantized(q) => {
                let w = q.weight.take(ids, 0)?;
                let s = q.scales.take(ids, 0)?;
                let b = q.biases.take(ids, 0)?;
                w.dequantize(&s, &b, q.spec.group_size, q.spec.bits)?
                    .astype(dtype)?
            }
        })
    }

    /// Every tensor of the matrix (to evaluate them at load).
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Matrix::Dense(w) => vec![w],
            Matrix::Quantized(q) => vec![&q.weight, &q.scales, &q.biases],
        }
    }
}

/// `y = x Wᵀ + b`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Matrix,
    pub bias: Option<Array>,
    /// Sharded-to-all under tensor parallelism: `x Wᵀ` is this rank's
    /// partial sum, summed over the ranks (`all_sum`) before the bias.
    pub all_sum: bool,
}

/// How [`Linear::shard`] splits a layer over tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardAxis {
    /// All-to-sharded: each rank keeps its slice of the output rows (q, k,
    /// v, gate, up), bias included.
    Output,
    /// Sharded-to-all: each rank keeps its slice of the input columns (o,
    /// down) and the outputs are summed over the ranks; the bias is kept
    /// whole and added once, after the sum.
    Input,
}

impl Linear {
    /// Loads `{path}.weight` (+ `.scales`/`.biases` when quantized) and, when
    /// `bias`, `{path}.bias`.
    pub fn load(ctx: &mut LoadContext<'_>, path: &str, bias: bool) -> Result<Self, ModelError> {
        let weight = Matrix::load(ctx, path)?;
        let bias = if bias {
            Some(ctx.float(&format!("{path}.bias"))?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            all_sum: false,
        })
    }

    /// Loads the fused linear `path` (`{path}.weight`, quantized or not,
    /// and its bias) as one linear per part, splitting its output rows in
    /// `sizes` (Phi-3's `qkv_proj` into q, k and v; `gate_up_proj` into
    /// gate and up). Quantized matrices split along rows as they are:
    /// packing and groups run along the input axis.
    ///
    /// # Errors
    /// Missing tensors, or `sizes` that do not add up to the output rows.
    pub fn load_split(
        ctx: &mut LoadContext<'_>,
        path: &str,
        bias: bool,
        sizes: &[usize],
    ) -> Result<Vec<Self>, ModelError> {
        let fused = Self::load(ctx, path, bias)?;
        let rows_of = |a: &Array| a.shape().first().copied().unwrap_or(0) as usize;
        let total = match &fused.weight {
            Matrix::Dense(w) => rows_of(w),
            Matrix::Quantized(q) => rows_of(&q.weight),
        };
        if sizes.iter().sum::<usize>() != total {
            return Err(ModelError::Weights(format!(
                "{path}: {total} output rows do not split into {sizes:?}"
            )));
        }
        let rows = |a: &Array, start: usize, len: usize| -> Result<Array, ModelError> {
            let mut stop = a.shape();
            let mut begin = vec![0; stop.len()];
            begin[0] = start as i32;
            stop[0] = (start + len) as i32;
            Ok(a.slice(&begin, &stop)?.contiguous()?)
        };
        let mut parts = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &len in sizes {
            let weight = match &fused.weight {
                Matrix::Dense(w) => Matrix::Dense(rows(w, start, len)?),
                Matrix::Quantized(q) => Matrix::Quantized(QuantizedMatrix {
                    weight: rows(&q.weight, start, len)?,
                    scales: rows(&q.scales, start, len)?,
                    biases: rows(&q.biases, start, len)?,
                    spec: q.spec,
                }),
            };
            let bias = fused
                .bias
                .as_ref()
                .map(|b| rows(b, start, len))
                .transpose()?;
            parts.push(Linear {
                weight,
                bias,
                all_sum: false,
            });
            start += len;
        }
        Ok(parts)
    }

    /// Output rows `start..start + len` of the layer as views of its
    /// tensors (no copy): the row slices of a row-major matrix, its scales,
    /// biases and bias are contiguous.
    ///
    /// # Errors
    /// MLX failing to slice.
    pub fn output_rows(&self, start: i32, len: i32) -> Result<Self, ModelError> {
        let rows = |a: &Array| -> Result<Array, ModelError> {
            let mut stop = a.shape();
            let mut begin = vec![0; stop.len()];
            begin[0] = start;
            stop[0] = start + len;
            Ok(a.slice(&begin, &stop)?)
        };
        let weight = match &self.weight {
            Matrix::Dense(w) => Matrix::Dense(rows(w)?),
            Matrix::Quantized(q) => Matrix::Quantized(QuantizedMatrix {
                weight: rows(&q.weight)?,
                scales: rows(&q.scales)?,
                biases: rows(&q.biases)?,
                spec: q.spec,
            }),
        };
        Ok(Linear {
            weight,
            bias: self.bias.as_ref().map(rows).transpose()?,
            all_sum: self.all_sum,
        })
    }

    /// This rank's shard of the layer along `axis` (see [`ShardAxis`]).
    /// Quantized matrices split along their packed columns and their
    /// scale/bias groups, so the input slice must cover whole groups
    /// ([`TensorParallel::check`]).
    ///
    /// # Errors
    /// A dimension that does not divide by the world size.
    pub fn shard(self, axis: ShardAxis, tp: TensorParallel) -> Result<Self, ModelError> {
        let cut = |a: &Array, dim: usize, what: &str| -> Result<Array, ModelError> {
            let mut stop = a.shape();
            let n = stop.get(dim).copied().unwrap_or(0) as usize;
            let (start, len) = tp.part(n, what)?;
            let mut begin = vec![0; stop.len()];
            begin[dim] = start as i32;
            stop[dim] = (start + len) as i32;
            Ok(a.slice(&begin, &stop)?.contiguous()?)
        };
        let dim = match axis {
            ShardAxis::Output => 0,
            ShardAxis::Input => 1,
        };
        let weight = match &self.weight {
            Matrix::Dense(w) => Matrix::Dense(cut(w, dim, "a linear layer's size")?),
            Matrix::Quantized(q) => Matrix::Quantized(QuantizedMatrix {
                weight: cut(&q.weight, dim, "a quantized layer's packed size")?,
                scales: cut(&q.scales, dim, "a quantized layer's groups")?,
                biases: cut(&q.biases, dim, "a quantized layer's groups")?,
                spec: q.spec,
            }),
        };
        Ok(match axis {
            ShardAxis::Output => Linear {
                weight,
                bias: self
                    .bias
                    .as_ref()
                    .map(|b| cut(b, 0, "a bias"))
                    .transpose()?,
                all_sum: false,
            },
            ShardAxis::Input => Linear {
                weight,
                bias: self.bias,
                all_sum: true,
            },
        })
    }

    /// [`Linear::shard`] when `tp` is set, else the layer unchanged.
    pub fn shard_if(self, axis: ShardAxis, tp: Option<TensorParallel>) -> Result<Self, ModelError> {
        match tp {
            Some(tp) => self.shard(axis, tp),
            None => Ok(self),
        }
    }

    /// `[..., in] -> [..., out]`.
    pub fn forward(&self, x: &Array) -> Result<Array, ModelError> {
        let y = self.weight.apply(x)?;
        let y = if self.all_sum {
            mlxcel_mlx::distributed::all_sum(&y, None)?
        } else {
            y
        };
        match &self.bias {
            Some(b) => Ok(y.add(b)?),
            None => Ok(y),
        }
    }

    /// Every tensor of the layer.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.weight.arrays();
        v.extend(self.bias.as_ref());
        v
    }
}

/// Input rows (tokens) up to which a fused [`LinearGroup`] runs as one
/// matmul: decode batches and speculative verify steps; prefill tiles above
/// it take the per-part products.
pub const FUSED_MAX_ROWS: i32 = 64;

/// Linear layers that read the same input (q, k and v; gate and up), run
/// as one matmul over their output rows concatenated at load whenever they
/// can be: the same weight kind (dense, or quantized with one
/// [`QuantSpec`]), all or none with a bias, none summed over ranks.
///
/// One matmul instead of two or three removes kernels from every layer of a
/// decode step, which is host-bound on the GPU (each kernel costs encoding
/// time whatever its size), and gives the GEMM one wider output. vLLM's
/// `QKVParallelLinear` and `MergedColumnParallelLinear` fuse the same
/// projections. The outputs are views (slices of the last axis) of the one
/// product. Over more than [`FUSED_MAX_ROWS`] input rows (prefill) the
/// product is taken per part instead, against row views of the fused
/// weight (no copy, no extra memory): there a matmul's launch cost is small
/// next to its work, and strided views of one wide product would make the
/// consumers (per-head norms, RoPE) copy them; one fused product for
/// prefill tiles measured 3-4% slower. On the H200 (4-bit, builds run
/// interleaved; `benches/results/2026-12-04-gpu-fused-projections.json`)
/// single-stream decode is within that machine's run-to-run spread of the
/// separate projections (0.95-1.11x) and prefill unchanged. Parts that
/// cannot be fused (mixed per-module quantization) stay separate matmuls,
/// the same result.
#[derive(Debug, Clone)]
pub enum LinearGroup {
    /// One linear whose output rows are the parts' rows in order, with the
    /// parts' output sizes and each part as a view of its rows.
    Fused {
        linear: Linear,
        sizes: Vec<i32>,
        parts: Vec<Linear>,
    },
    /// The parts as loaded.
    Separate(Vec<Linear>),
}

impl LinearGroup {
    /// Fuses `parts` (in output order) when they can be, else keeps them
    /// apart. Under tensor parallelism shard each part first
    /// ([`ShardAxis::Output`]): a rank's fused rows are then its slices of
    /// every part.
    ///
    /// # Errors
    /// MLX failing to concatenate the weights.
    pub fn new(parts: Vec<Linear>) -> Result<Self, ModelError> {
        let fusable = parts.len() > 1
            && parts.iter().all(|p| !p.all_sum)
            && (parts.iter().all(|p| p.bias.is_some()) || parts.iter().all(|p| p.bias.is_none()))
            && match parts.first().map(|p| &p.weight) {
                Some(Matrix::Dense(first)) => parts.iter().all(|p| match &p.weight {
                    Matrix::Dense(w) => w.dtype() == first.dtype(),
                    Matrix::Quantized(_) => false,
                }),
                Some(Matrix::Quantized(first)) => parts.iter().all(|p| match &p.weight {
                    Matrix::Quantized(q) => q.spec == first.spec,
                    Matrix::Dense(_) => false,
                }),
                None => false,
            };
        if !fusable {
            return Ok(LinearGroup::Separate(parts));
        }
        let rows = |m: &Matrix| match m {
            Matrix::Dense(w) => w.shape().first().copied().unwrap_or(0),
            Matrix::Quantized(q) => q.weight.shape().first().copied().unwrap_or(0),
        };
        let sizes: Vec<i32> = parts.iter().map(|p| rows(&p.weight)).collect();
        let cat = |pick: &dyn Fn(&Linear) -> Option<&Array>| -> Result<Option<Array>, ModelError> {
            let arrays: Option<Vec<&Array>> = parts.iter().map(pick).collect();
            arrays
                .map(|a| Ok(mlxcel_mlx::concatenate(&a, 0)?))
                .transpose()
        };
        let quantized = |p: &Linear| match &p.weight {
            Matrix::Quantized(q) => Some(q.clone()),
            Matrix::Dense(_) => None,
        };
        let weight = match parts.first().and_then(quantized) {
            None => cat(&|p| match &p.weight {
                Matrix::Dense(w) => Some(w),
                Matrix::Quantized(_) => None,
            })?
            .map(Matrix::Dense),
            Some(first) => {
                let field = |f: fn(&QuantizedMatrix) -> &Array| {
                    cat(&move |p: &Linear| match &p.weight {
                        Matrix::Quantized(q) => Some(f(q)),
                        Matrix::Dense(_) => None,
                    })
                };
                match (
                    field(|q| &q.weight)?,
                    field(|q| &q.scales)?,
                    field(|q| &q.biases)?,
                ) {
                    (Some(weight), Some(scales), Some(biases)) => {
                        Some(Matrix::Quantized(QuantizedMatrix {
                            weight,
                            scales,
                            biases,
                            spec: first.spec,
                        }))
                    }
                    _ => None,
                }
            }
        };
        let Some(weight) = weight else {
            return Ok(LinearGroup::Separate(parts));
        };
        let bias = cat(&|p| p.bias.as_ref())?;
        let linear = Linear {
            weight,
            bias,
            all_sum: false,
        };
        let mut views = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &len in &sizes {
            views.push(linear.output_rows(start, len)?);
            start += len;
        }
        Ok(LinearGroup::Fused {
            linear,
            sizes,
            parts: views,
        })
    }

    /// Loads the fused linear `path` whose output rows are parts of
    /// `sizes` rows each (Phi-3's `qkv_proj`, `gate_up_proj`), sharding
    /// each part's rows under tensor parallelism (`ctx.shard`).
    ///
    /// # Errors
    /// As [`Linear::load_split`].
    pub fn load_fused(
        ctx: &mut LoadContext<'_>,
        path: &str,
        bias: bool,
        sizes: &[usize],
    ) -> Result<Self, ModelError> {
        let tp = ctx.shard;
        let parts = Linear::load_split(ctx, path, bias, sizes)?
            .into_iter()
            .map(|p| p.shard_if(ShardAxis::Output, tp))
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(parts)
    }

    /// How many outputs [`LinearGroup::forward`] returns.
    pub fn len(&self) -> usize {
        match self {
            LinearGroup::Fused { sizes, .. } => sizes.len(),
            LinearGroup::Separate(parts) => parts.len(),
        }
    }

    /// Whether the group has no part.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The one fused product `[..., sum of out_i]` (the parts' outputs side
    /// by side, in order) when [`LinearGroup::forward`] would take it: a
    /// fused group over at most [`FUSED_MAX_ROWS`] input rows (any row
    /// count under batch-invariant execution). `None` otherwise (take the
    /// parts' outputs from [`LinearGroup::forward`]).
    ///
    /// # Errors
    /// MLX failing to build the product.
    pub fn forward_whole(&self, x: &Array) -> Result<Option<Array>, ModelError> {
        match self {
            LinearGroup::Fused { linear, .. }
                if input_rows(x) <= FUSED_MAX_ROWS || crate::invariant::enabled() =>
            {
                Ok(Some(linear.forward(x)?))
            }
            _ => Ok(None),
        }
    }

    /// A fused group's part output sizes (`out_i`), in order; `None` for
    /// separate parts.
    pub fn fused_sizes(&self) -> Option<&[i32]> {
        match self {
            LinearGroup::Fused { sizes, .. } => Some(sizes),
            LinearGroup::Separate(_) => None,
        }
    }

    /// `[..., in]` -> one `[..., out_i]` per part, in order.
    pub fn forward(&self, x: &Array) -> Result<Vec<Array>, ModelError> {
        match self {
            LinearGroup::Separate(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            // Batch-invariant execution keeps one product whatever the
            // row count (its chunks are at most FUSED_MAX_ROWS rows).
            LinearGroup::Fused { parts, .. }
                if input_rows(x) > FUSED_MAX_ROWS && !crate::invariant::enabled() =>
            {
                parts.iter().map(|p| p.forward(x)).collect()
            }
            LinearGroup::Fused { linear, sizes, .. } => {
                let y = linear.forward(x)?;
                let mut stop = y.shape();
                let last = stop.len().saturating_sub(1);
                let mut begin = vec![0; stop.len()];
                let mut out = Vec::with_capacity(sizes.len());
                for &n in sizes {
                    stop[last] = begin[last] + n;
                    out.push(y.slice(&begin, &stop)?);
                    begin[last] = stop[last];
                }
                Ok(out)
            }
        }
    }

    /// Every tensor of the group.
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            LinearGroup::Fused { linear, .. } => linear.arrays(),
            LinearGroup::Separate(parts) => parts.iter().flat_map(Linear::arrays).collect(),
        }
    }
}

/// Rows of `x` `[..., in]`: the product of every dimension but the last.
fn input_rows(x: &Array) -> i32 {
    let shape = x.shape();
    shape.iter().take(shape.len().saturating_sub(1)).product()
}

/// Token embedding table `[vocab, hidden]`, also usable as a tied LM head.
#[derive(Debug, Clone)]
pub struct Embedding {
    pub table: Matrix,
    dtype: Dtype,
}

impl Embedding {
    /// Loads `{path}.weight` (+ quantization tensors).
    pub fn load(ctx: &mut LoadContext<'_>, path: &str) -> Result<Self, ModelError> {
        Ok(Embedding {
            table: Matrix::load(ctx, path)?,
            dtype: ctx.dtype,
        })
    }

    /// Token ids `[batch, seq]` (uint32) -> `[batch, seq, hidden]`.
    pub fn forward(&self, ids: &Array) -> Result<Array, ModelError> {
        let shape = ids.shape();
        let flat = ids.reshape(&[-1])?;
        let rows = self.table.rows(&flat, self.dtype)?;
        let hidden = rows.dim(-1)?;
        let mut out_shape = shape;
        out_shape.push(hidden);
        Ok(rows.reshape(&out_shape)?)
    }

    /// Tied LM head: `[..., hidden] -> [..., vocab]` logits.
    pub fn as_linear(&self, x: &Array) -> Result<Array, ModelError> {
        self.table.apply(x)
    }
}

/// RMSNorm (Zhang & Sennrich 2019) with a learned scale `[hidden]`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Array,
    pub eps: f32,
}

impl RmsNorm {
    /// Loads `{path}.weight`.
    pub fn load(ctx: &mut LoadContext<'_>, path: &str, eps: f32) -> Result<Self, ModelError> {
        Ok(RmsNorm {
            weight: ctx.float(&format!("{path}.weight"))?,
            eps,
        })
    }

    /// Loads `{path}.weight` + `offset`: Gemma's norms scale by
    /// `1 + weight` (offset 1), folded into the weight once here.
    pub fn load_with_offset(
        ctx: &mut LoadContext<'_>,
        path: &str,
        eps: f32,
        offset: f32,
    ) -> Result<Self, ModelError> {
        let norm = RmsNorm::load(ctx, path, eps)?;
        if offset == 0.0 {
            return Ok(norm);
        }
        let dtype = norm.weight.dtype();
        let shift = Array::scalar(offset)?.astype(dtype)?;
        Ok(RmsNorm {
            weight: norm.weight.add(&shift)?,
            eps,
        })
    }

    /// Normalizes the last axis.
    pub fn forward(&self, x: &Array) -> Result<Array, ModelError> {
        Ok(x.rms_norm(&self.weight, self.eps)?)
    }
}

/// The activation of a gated MLP's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// SiLU: SwiGLU (Llama, Qwen, Mistral, ...).
    #[default]
    Silu,
    /// GELU, tanh approximation: GeGLU (Gemma).
    GeluTanh,
}

/// The gated MLP of Llama (SwiGLU, Shazeer 2020):
/// `down(act(gate(x)) · up(x))`, `act` SiLU or (Gemma) GELU.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// The gate and up projections, in that order (fused when they can be,
    /// see [`LinearGroup`]).
    pub gate_up: LinearGroup,
    pub down_proj: Linear,
    /// The gate's activation.
    pub activation: Activation,
}

impl Mlp {
    /// Loads `{path}.gate_proj`, `{path}.up_proj`, `{path}.down_proj`.
    /// Under tensor parallelism (`ctx.shard`), gate and up keep this
    /// rank's intermediate columns and down the matching input columns.
    pub fn load(ctx: &mut LoadContext<'_>, path: &str, bias: bool) -> Result<Self, ModelError> {
        let tp = ctx.shard;
        Ok(Mlp {
            gate_up: LinearGroup::new(vec![
                Linear::load(ctx, &format!("{path}.gate_proj"), bias)?
                    .shard_if(ShardAxis::Output, tp)?,
                Linear::load(ctx, &format!("{path}.up_proj"), bias)?
                    .shard_if(ShardAxis::Output, tp)?,
            ])?,
            down_proj: Linear::load(ctx, &format!("{path}.down_proj"), bias)?
                .shard_if(ShardAxis::Input, tp)?,
            activation: Activation::Silu,
        })
    }

    /// The same MLP with the gate's activation `activation`.
    pub fn with_activation(self, activation: Activation) -> Self {
        Mlp { activation, ..self }
    }

    /// Loads a fused `{path}.gate_up_proj` (gate rows, then up rows) and
    /// `{path}.down_proj` (Phi-3).
    pub fn load_fused(
        ctx: &mut LoadContext<'_>,
        path: &str,
        bias: bool,
        intermediate: usize,
    ) -> Result<Self, ModelError> {
        Self::load_fused_named(
            ctx,
            &format!("{path}.gate_up_proj"),
            &format!("{path}.down_proj"),
            bias,
            intermediate,
        )
    }

    /// Loads a fused gate-and-up projection `gate_up` (gate rows, then up
    /// rows, `intermediate` each) and the down projection `down`, both
    /// full tensor paths (Granite 4's `shared_mlp.input_linear` and
    /// `shared_mlp.output_linear`).
    pub fn load_fused_named(
        ctx: &mut LoadContext<'_>,
        gate_up: &str,
        down: &str,
        bias: bool,
        intermediate: usize,
    ) -> Result<Self, ModelError> {
        let tp = ctx.shard;
        Ok(Mlp {
            gate_up: LinearGroup::load_fused(ctx, gate_up, bias, &[intermediate, intermediate])?,
            down_proj: Linear::load(ctx, down, bias)?.shard_if(ShardAxis::Input, tp)?,
            activation: Activation::Silu,
        })
    }

    /// Every tensor of the MLP (gate, up, down).
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.gate_up.arrays();
        v.extend(self.down_proj.arrays());
        v
    }

    /// `[..., hidden] -> [..., hidden]`.
    pub fn forward(&self, x: &Array) -> Result<Array, ModelError> {
        let [g, u] = <[Array; 2]>::try_from(self.gate_up.forward(x)?)
            .map_err(|_| ModelError::Weights("an MLP without gate and up".into()))?;
        let h = match self.activation {
            Activation::Silu => mlxcel_mlx::swiglu(&g, &u)?,
            Activation::GeluTanh => mlxcel_mlx::geglu_tanh(&g, &u)?,
        };
        self.down_proj.forward(&h)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A deterministic `[rows, cols]` matrix with values in [-1, 1).
    /// `[rows, cols]` float32 of deterministic values in [-1, 1).
    pub(crate) fn matrix(rows: usize, cols: usize, seed: u32) -> Array {
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761) >> 8;
                (h % 2000) as f32 / 1000.0 - 1.0
            })
            .collect();
        Array::from_f32(&data, &[rows as i32, cols as i32]).unwrap()
    }

    fn dense(rows: usize, cols: usize, seed: u32, bias: bool) -> Linear {
        Linear {
            weight: Matrix::Dense(matrix(rows, cols, seed)),
            bias: bias.then(|| matrix(1, rows, seed + 7).reshape(&[rows as i32]).unwrap()),
            all_sum: false,
        }
    }

    fn quantized(rows: usize, cols: usize, seed: u32, bits: i32) -> Linear {
        let (weight, scales, biases) = matrix(rows, cols, seed).quantize(64, bits).unwrap();
        Linear {
            weight: Matrix::Quantized(QuantizedMatrix {
                weight,
                scales,
                biases,
                spec: QuantSpec {
                    group_size: 64,
                    bits,
                },
            }),
            bias: None,
            all_sum: false,
        }
    }

    /// The largest `|a - b|` over two outputs of the same shape.
    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// Each part's output of `group` against the part run alone, over a
    /// decode-sized input (the one fused matmul) and a prefill-sized one
    /// (the per-part products on row views).
    fn assert_same_as_parts(group: &LinearGroup, parts: &[Linear]) {
        for tokens in [3, FUSED_MAX_ROWS as usize + 6] {
            let x = matrix(tokens, 128, 99)
                .reshape(&[1, tokens as i32, 128])
                .unwrap();
            let outs = group.forward(&x).unwrap();
            assert_eq!(outs.len(), parts.len());
            for (out, part) in outs.iter().zip(parts) {
                let want = part.forward(&x).unwrap();
                assert_eq!(out.shape(), want.shape());
                let (got, want) = (out.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
                let worst = max_abs_diff(&got, &want);
                assert!(
                    worst <= 1e-4,
                    "{tokens} tokens: fused output off by {worst}"
                );
            }
        }
    }

    /// q, k and v with biases (Qwen 2) fuse into one matmul whose slices
    /// are what each projection computes alone.
    #[test]
    fn dense_projections_fuse_into_one_matmul() {
        let parts = vec![
            dense(64, 128, 1, true),
            dense(32, 128, 2, true),
            dense(32, 128, 3, true),
        ];
        let group = LinearGroup::new(parts.clone()).unwrap();
        match &group {
            LinearGroup::Fused { sizes, linear, .. } => {
                assert_eq!(sizes, &[64, 32, 32]);
                assert_eq!(linear.bias.as_ref().map(Array::shape), Some(vec![128]));
            }
            LinearGroup::Separate(_) => panic!("dense parts with biases did not fuse"),
        }
        assert_same_as_parts(&group, &parts);
    }

    /// Quantized gate and up of one spec fuse (packed rows, scales and
    /// biases concatenated); parts of different bit widths (mlx_lm's
    /// per-module quantization) or with and without a bias stay apart and
    /// still compute the same.
    #[test]
    fn quantized_projections_fuse_only_under_one_spec() {
        let parts = vec![quantized(96, 128, 4, 4), quantized(96, 128, 5, 4)];
        let group = LinearGroup::new(parts.clone()).unwrap();
        assert!(matches!(group, LinearGroup::Fused { .. }));
        assert_same_as_parts(&group, &parts);

        let mixed = vec![quantized(96, 128, 4, 4), quantized(96, 128, 5, 8)];
        let group = LinearGroup::new(mixed.clone()).unwrap();
        assert!(matches!(group, LinearGroup::Separate(_)));
        assert_same_as_parts(&group, &mixed);

        let half_biased = vec![dense(16, 128, 6, true), dense(16, 128, 7, false)];
        let group = LinearGroup::new(half_biased.clone()).unwrap();
        assert!(matches!(group, LinearGroup::Separate(_)));
        assert_same_as_parts(&group, &half_biased);
    }

    /// A quantized product over at least `dequantized_matmul_rows` rows is
    /// the dense product with the dequantized matrix (bit for bit), and
    /// agrees with the quantized kernel's within rounding; below the
    /// threshold, and with it unset, the quantized kernel runs.
    #[test]
    fn many_rows_multiply_the_dequantized_matrix() {
        let linear = quantized(96, 128, 8, 4);
        let Matrix::Quantized(q) = &linear.weight else {
            unreachable!()
        };
        let dense = q.dequantize(Dtype::Float32).unwrap();
        let x = matrix(40, 128, 21).reshape(&[1, 40, 128]).unwrap();
        let by_kernel = x
            .quantized_matmul(&q.weight, &q.scales, &q.biases, true, 64, 4)
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let by_dense = x.matmul(&dense.t().unwrap()).unwrap().to_vec_f32().unwrap();
        assert_ne!(
            by_kernel, by_dense,
            "the two products round alike here: the test can't tell them apart"
        );
        let worst = max_abs_diff(&by_kernel, &by_dense);
        assert!(worst < 1e-3, "dense product off by {worst}");

        let run = |rows: Option<usize>| {
            set_dequantized_matmul_rows(rows);
            let y = linear.forward(&x).unwrap().to_vec_f32().unwrap();
            set_dequantized_matmul_rows(None);
            y
        };
        assert_eq!(run(Some(40)), by_dense, "40 rows at a threshold of 40");
        assert_eq!(run(Some(41)), by_kernel, "40 rows under a threshold of 41");
        assert_eq!(run(Some(0)), by_kernel, "a threshold of 0 is off");
        assert_eq!(run(None), by_kernel, "no threshold");

        // The weights floor: this matrix has 96 x 128 = 12,288 weights.
        assert_eq!(q.weights(), 96 * 128);
        let floored = |weights: usize| {
            set_dequantized_matmul_min_weights(weights);
            let y = run(Some(40));
            set_dequantized_matmul_min_weights(0);
            y
        };
        assert_eq!(floored(96 * 128), by_dense, "a matrix at the floor");
        assert_eq!(floored(96 * 128 + 1), by_kernel, "a matrix under the floor");

        // An LM head's product keeps the quantized kernel, and the
        // threshold comes back after it.
        set_dequantized_matmul_rows(Some(40));
        let head = with_quantized_matmul(|| linear.forward(&x).unwrap().to_vec_f32().unwrap());
        let kept = dequantized_matmul_rows();
        set_dequantized_matmul_rows(None);
        assert_eq!(head, by_kernel, "with_quantized_matmul ran dense");
        assert_eq!(kept, Some(40));
    }

    /// Under batch-invariant chunking, a row's output is bit for bit the
    /// same alone and beside other rows whatever the threshold: every
    /// chunk takes one kernel (dense only when even a chunk of `pad_to`
    /// rows reaches the threshold), never one chosen by its own row count.
    #[test]
    fn chunked_rows_take_one_kernel_whatever_their_chunk() {
        let linear = quantized(96, 128, 9, 4);
        let chunking = crate::invariant::Chunking { rows: 8, pad_to: 2 };
        let x = matrix(21, 128, 23);
        let alone = x.slice(&[0, 0], &[3, 128]).unwrap();
        let first_rows = |y: Array| y.slice(&[0, 0], &[3, 96]).unwrap().to_vec_f32().unwrap();
        let mut outs = Vec::new();
        for threshold in [Some(2), Some(5), None] {
            set_dequantized_matmul_rows(threshold);
            crate::invariant::set(Some(chunking));
            let batched = first_rows(linear.forward(&x).unwrap());
            let single = first_rows(linear.forward(&alone).unwrap());
            crate::invariant::set(None);
            set_dequantized_matmul_rows(None);
            assert_eq!(batched, single, "threshold {threshold:?}: alone != batched");
            outs.push(single);
        }
        // A threshold of 5 lies inside the chunk sizes (3, 5 and 8 rows
        // here): the quantized kernel everywhere, as with none; 2 is
        // reached by every chunk: dense everywhere.
        assert_eq!(outs[1], outs[2]);
        assert_ne!(outs[0], outs[2], "the dense path was not taken");
    }
}
