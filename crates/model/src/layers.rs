//! Shared layers: linear (dense or affine-quantized, fused ones split at
//! load), embedding, RMSNorm, the gated SiLU MLP. Each has `load(ctx, path)` with `path` mirroring the
//! checkpoint's tensor names, and `forward`.

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

    /// `x @ selfᵀ`: `[..., in] -> [..., out]`.
    pub fn apply(&self, x: &Array) -> Result<Array, ModelError> {
        Ok(match self {
            Matrix::Dense(w) => x.matmul(&w.t()?)?,
            Matrix::Quantized(q) => x.quantized_matmul(
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
    pub gate_proj: Linear,
    pub up_proj: Linear,
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
            gate_proj: Linear::load(ctx, &format!("{path}.gate_proj"), bias)?
                .shard_if(ShardAxis::Output, tp)?,
            up_proj: Linear::load(ctx, &format!("{path}.up_proj"), bias)?
                .shard_if(ShardAxis::Output, tp)?,
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
        let path = gate_up;
        let mut gate_up = Linear::load_split(ctx, gate_up, bias, &[intermediate, intermediate])?;
        let tp = ctx.shard;
        let up_proj = gate_up.pop();
        let gate_proj = gate_up.pop();
        match (gate_proj, up_proj) {
            (Some(gate_proj), Some(up_proj)) => Ok(Mlp {
                gate_proj: gate_proj.shard_if(ShardAxis::Output, tp)?,
                up_proj: up_proj.shard_if(ShardAxis::Output, tp)?,
                down_proj: Linear::load(ctx, down, bias)?.shard_if(ShardAxis::Input, tp)?,
                activation: Activation::Silu,
            }),
            _ => Err(ModelError::Weights(format!("{path}: no split"))),
        }
    }

    /// Every tensor of the MLP (gate, up, down).
    pub fn arrays(&self) -> Vec<&Array> {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .into_iter()
            .flat_map(Linear::arrays)
            .collect()
    }

    /// `[..., hidden] -> [..., hidden]`.
    pub fn forward(&self, x: &Array) -> Result<Array, ModelError> {
        let g = self.gate_proj.forward(x)?;
        let g = match self.activation {
            Activation::Silu => g.silu()?,
            Activation::GeluTanh => g.gelu_tanh()?,
        };
        let u = self.up_proj.forward(x)?;
        self.down_proj.forward(&g.multiply(&u)?)
    }
}
