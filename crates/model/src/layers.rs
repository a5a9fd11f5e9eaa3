//! Shared layers: linear (dense or affine-quantized, fused ones split at
//! load), embedding, RMSNorm, the gated SiLU MLP. Each has `load(ctx, path)` with `path` mirroring the
//! checkpoint's tensor names, and `forward`.

use crate::{config::QuantSpec, ModelError, Weights};
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
    /// skinny GEMM of `mlxcel-mlx` for 2-8 decode rows, which reads every
    /// weight row once).
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
        Ok(Linear { weight, bias })
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
            parts.push(Linear { weight, bias });
            start += len;
        }
        Ok(parts)
    }

    /// `[..., in] -> [..., out]`.
    pub fn forward(&self, x: &Array) -> Result<Array, ModelError> {
        let y = self.weight.apply(x)?;
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
    pub fn load(ctx: &mut LoadContext<'_>, path: &str, bias: bool) -> Result<Self, ModelError> {
        Ok(Mlp {
            gate_proj: Linear::load(ctx, &format!("{path}.gate_proj"), bias)?,
            up_proj: Linear::load(ctx, &format!("{path}.up_proj"), bias)?,
            down_proj: Linear::load(ctx, &format!("{path}.down_proj"), bias)?,
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
        let mut gate_up = Linear::load_split(
            ctx,
            &format!("{path}.gate_up_proj"),
            bias,
            &[intermediate, intermediate],
        )?;
        let up_proj = gate_up.pop();
        let gate_proj = gate_up.pop();
        match (gate_proj, up_proj) {
            (Some(gate_proj), Some(up_proj)) => Ok(Mlp {
                gate_proj,
                up_proj,
                down_proj: Linear::load(ctx, &format!("{path}.down_proj"), bias)?,
                activation: Activation::Silu,
            }),
            _ => Err(ModelError::Weights(format!(
                "{path}.gate_up_proj: no split"
            ))),
        }
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
