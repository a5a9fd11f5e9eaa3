//! Operations on [`Array`]s. All are lazy: they build graph nodes; nothing is
//! computed until [`eval`], [`async_eval`] or a `to_vec_*` call.

use crate::ffi::bridge;
use crate::{Array, Dtype, Error, Result};
use cxx::UniquePtr;

fn list(arrays: &[&Array]) -> Result<UniquePtr<bridge::ArrayList>> {
    let mut l = bridge::new_array_list()?;
    for a in arrays {
        let pinned = l.as_mut().ok_or_else(|| Error("null array list".into()))?;
        bridge::array_list_push(pinned, a.raw())?;
    }
    Ok(l)
}

fn list_ref(l: &UniquePtr<bridge::ArrayList>) -> Result<&bridge::ArrayList> {
    l.as_ref().ok_or_else(|| Error("null array list".into()))
}

/// The `N` arrays of `op`'s result list.
fn unpack<const N: usize>(op: &str, l: &UniquePtr<bridge::ArrayList>) -> Result<[Array; N]> {
    let list = list_ref(l)?;
    let len = bridge::array_list_len(list);
    if len != N {
        return Err(Error(format!("{op} returned {len} arrays, not {N}")));
    }
    let arrays = (0..N)
        .map(|i| Array::wrap(bridge::array_list_get(list, i)))
        .collect::<Result<Vec<_>>>()?;
    arrays
        .try_into()
        .map_err(|_| Error(format!("{op}: {N} arrays expected")))
}

/// Evaluates all `arrays` (one graph evaluation).
pub fn eval(arrays: &[&Array]) -> Result<()> {
    let l = list(arrays)?;
    crate::count(&crate::EVALS);
    Ok(bridge::eval_many(list_ref(&l)?)?)
}

/// Starts evaluating `arrays` without waiting; a later [`eval`] or read waits.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    let l = list(arrays)?;
    crate::count(&crate::EVALS);
    Ok(bridge::async_eval_many(list_ref(&l)?)?)
}

/// Concatenates `arrays` along `axis`.
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    let l = list(arrays)?;
    Array::wrap(bridge::concatenate(list_ref(&l)?, axis))
}

/// An array of zeros.
pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
    Array::wrap(bridge::zeros(shape, dtype as i32))
}

/// `softmax(q kᵀ · scale + mask) v`, MLX's fused attention.
///
/// Shapes: `q` `[batch, heads, q_len, head_dim]`, `k`/`v`
/// `[batch, kv_heads, k_len, head_dim]` (grouped-query: `heads` is a multiple
/// of `kv_heads`). `mask`: [`AttentionMask::None`], [`AttentionMask::Causal`]
/// (lower-right aligned: query `i` sees keys `..= k_len - q_len + i`), or an
/// additive/boolean array broadcastable to `[batch, heads, q_len, k_len]`.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &AttentionMask,
) -> Result<Array> {
    match mask {
        AttentionMask::None => Array::wrap(bridge::sdpa(q.raw(), k.raw(), v.raw(), scale, "")),
        AttentionMask::Causal => {
            Array::wrap(bridge::sdpa(q.raw(), k.raw(), v.raw(), scale, "causal"))
        }
        AttentionMask::Array(m) => Array::wrap(bridge::sdpa_masked(
            q.raw(),
            k.raw(),
            v.raw(),
            scale,
            m.raw(),
        )),
    }
}

/// SwiGLU's product of a gated MLP (Shazeer 2020, "GLU Variants Improve
/// Transformer"): `silu(gate) · up`, `gate` and `up` of one shape and
/// dtype (`[..., intermediate]`). One fused kernel on a GPU (MLX's
/// `compile`, shapeless, as mlx_lm compiles its `swiglu`) instead of three;
/// the same ops unfused on the CPU. Bit for bit the separate ops' result
/// wherever MLX's fused kernel rounds each op as the unfused kernels do.
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array> {
    Array::wrap(bridge::swiglu(gate.raw(), up.raw()))
}

/// GeGLU's product (Gemma's MLP): `gelu_tanh(gate) · up` with the tanh
/// approximation of [`Array::gelu_tanh`], same shapes as [`swiglu`]. One
/// fused kernel on a GPU (thirteen separate ones otherwise), the same ops
/// unfused on the CPU.
pub fn geglu_tanh(gate: &Array, up: &Array) -> Result<Array> {
    Array::wrap(bridge::geglu_tanh(gate.raw(), up.raw()))
}

/// gpt-oss's clamped SwiGLU of an expert's gate and up projections (same
/// shape and dtype), each plus its bias when `biases` are given (same
/// shape): with `g = min(gate, limit)` and `u = clip(up, -limit, limit)`,
/// `(u + 1) · g · σ(alpha · g)` (OpenAI's gpt-oss reference; mlx_lm's
/// `swiglu_oai`). One fused kernel on a GPU (MLX's `compile`, shapeless),
/// plain ops on the CPU.
pub fn clamped_swiglu(
    gate: &Array,
    up: &Array,
    biases: Option<(&Array, &Array)>,
    alpha: f32,
    limit: f32,
) -> Result<Array> {
    let zero;
    let (bg, bu) = match biases {
        Some(b) => b,
        None => {
            zero = Array::scalar(0.0)?.astype(gate.dtype())?;
            (&zero, &zero)
        }
    };
    Array::wrap(bridge::clamped_swiglu(
        gate.raw(),
        up.raw(),
        bg.raw(),
        bu.raw(),
        alpha,
        limit,
    ))
}

/// [`scaled_dot_product_attention`] with attention sinks (gpt-oss; Xiao et
/// al. 2023, "Efficient Streaming Language Models with Attention Sinks"):
/// `sinks` float `[heads]` is one more logit per head in each query's
/// softmax, with no value: `softmax([q kᵀ · scale + mask, sink])[..k_len] v`.
pub fn scaled_dot_product_attention_with_sinks(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &AttentionMask,
    sinks: &Array,
) -> Result<Array> {
    let (q, k, v, s) = (q.raw(), k.raw(), v.raw(), sinks.raw());
    match mask {
        AttentionMask::None => Array::wrap(bridge::sdpa_sinks(q, k, v, scale, "", s)),
        AttentionMask::Causal => Array::wrap(bridge::sdpa_sinks(q, k, v, scale, "causal", s)),
        AttentionMask::Array(m) => {
            Array::wrap(bridge::sdpa_masked_sinks(q, k, v, scale, m.raw(), s))
        }
    }
}

/// The mask argument of [`scaled_dot_product_attention`].
#[derive(Debug, Clone)]
pub enum AttentionMask {
    /// Every query sees every key.
    None,
    /// Causal, aligned to the last key.
    Causal,
    /// An explicit mask: boolean (true = visible) or additive float.
    Array(Array),
}

/// A tensor file loaded lazily from disk.
pub struct SafeTensors(UniquePtr<bridge::TensorMap>);

// SAFETY: the map is only touched through `&mut self` or `&self` reads of
// the key set; the arrays it hands out are `Send` (see `Array`).
unsafe impl Send for SafeTensors {}

impl SafeTensors {
    /// Loads a `.safetensors` file (tensors stay lazy until evaluated).
    ///
    /// # Errors
    /// Missing or malformed file.
    pub fn load(path: &std::path::Path) -> Result<SafeTensors> {
        let p = path
            .to_str()
            .ok_or_else(|| Error(format!("non-UTF-8 path {}", path.display())))?;
        let m = bridge::load_safetensors(p)?;
        Ok(SafeTensors(m))
    }

    /// Loads the tensors of a GGUF file with MLX's reader (read eagerly):
    /// Q4_0, Q4_1, Q4_K and Q8_0 tensors become MLX affine quantized
    /// triples `{name}` (uint32 packed), `{prefix}.scales` and
    /// `{prefix}.biases` (float16, group size 32; `prefix` is `name` without
    /// `.weight`); F32, F16, I8, I16 and I32 tensors keep their type; MLX
    /// dequantizes other types to float16. Shapes are row-major (GGUF's
    /// dimension order reversed).
    ///
    /// The caller must have checked the file first (mlxcel-model's GGUF
    /// reader): MLX's C reader trusts the header's offsets and tensor
    /// types.
    ///
    /// # Errors
    /// Missing or malformed file, a tensor type MLX cannot read.
    pub fn load_gguf(path: &std::path::Path) -> Result<SafeTensors> {
        let p = path
            .to_str()
            .ok_or_else(|| Error(format!("non-UTF-8 path {}", path.display())))?;
        Ok(SafeTensors(bridge::load_gguf_tensors(p)?))
    }

    /// Names of the tensors not yet taken.
    pub fn names(&self) -> Vec<String> {
        self.0
            .as_ref()
            .and_then(|m| bridge::tensor_names(m).ok())
            .unwrap_or_default()
    }

    /// Removes and returns the tensor `name`.
    ///
    /// # Errors
    /// No tensor of that name.
    pub fn take(&mut self, name: &str) -> Result<Array> {
        let m = self
            .0
            .as_mut()
            .ok_or_else(|| Error("null tensor map".into()))?;
        Array::wrap(bridge::tensor_take(m, name))
    }
}

/// Saves named arrays to a `.safetensors` file.
pub fn save_safetensors(path: &std::path::Path, tensors: &[(String, &Array)]) -> Result<()> {
    let p = path
        .to_str()
        .ok_or_else(|| Error(format!("non-UTF-8 path {}", path.display())))?;
    let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
    let arrays: Vec<&Array> = tensors.iter().map(|(_, a)| *a).collect();
    let l = list(&arrays)?;
    Ok(bridge::save_safetensors(p, &names, list_ref(&l)?)?)
}

impl Array {
    /// Element type conversion.
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        Array::wrap(bridge::astype(self.raw(), dtype as i32))
    }

    /// Elementwise `self + other` with broadcasting.
    pub fn add(&self, other: &Array) -> Result<Array> {
        Array::wrap(bridge::add(self.raw(), other.raw()))
    }

    /// Elementwise `self - other` with broadcasting.
    pub fn subtract(&self, other: &Array) -> Result<Array> {
        Array::wrap(bridge::subtract(self.raw(), other.raw()))
    }

    /// Elementwise `self * other` with broadcasting.
    pub fn multiply(&self, other: &Array) -> Result<Array> {
        Array::wrap(bridge::multiply(self.raw(), other.raw()))
    }

    /// Elementwise `self / other` with broadcasting.
    pub fn divide(&self, other: &Array) -> Result<Array> {
        Array::wrap(bridge::divide(self.raw(), other.raw()))
    }

    /// Elementwise `min(self, other)` with broadcasting.
    pub fn minimum(&self, other: &Array) -> Result<Array> {
        Array::wrap(bridge::minimum(self.raw(), other.raw()))
    }

    /// Elementwise `max(self, other)` with broadcasting.
    pub fn maximum(&self, other: &Array) -> Result<Array> {
        Array::wrap(bridge::maximum(self.raw(), other.raw()))
    }

    /// Elementwise logistic sigmoid.
    pub fn sigmoid(&self) -> Result<Array> {
        Array::wrap(bridge::sigmoid(self.raw()))
    }

    /// Elementwise hyperbolic tangent.
    pub fn tanh(&self) -> Result<Array> {
        Array::wrap(bridge::tanh(self.raw()))
    }

    /// GELU with the tanh approximation (Hendrycks & Gimpel 2016):
    /// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`, the Gemma MLP
    /// activation (PyTorch's `gelu(approximate="tanh")`, MLX's
    /// `nn.gelu_approx`), computed in `x`'s dtype.
    pub fn gelu_tanh(&self) -> Result<Array> {
        let dtype = self.dtype();
        let c = |v: f32| Array::scalar(v).and_then(|a| a.astype(dtype));
        let cube = self.multiply(self)?.multiply(self)?;
        let inner = self
            .add(&cube.multiply(&c(0.044715)?)?)?
            .multiply(&c((2.0 / std::f32::consts::PI).sqrt())?)?;
        let gate = inner.tanh()?.add(&c(1.0)?)?;
        self.multiply(&c(0.5)?)?.multiply(&gate)
    }

    /// SiLU (`x · sigmoid(x)`), the Llama MLP activation.
    pub fn silu(&self) -> Result<Array> {
        self.multiply(&self.sigmoid()?)
    }

    /// Matrix product over the last two axes, broadcasting the rest.
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        Array::wrap(bridge::matmul(self.raw(), other.raw()))
    }

    /// Same data, new shape (one `-1` is inferred).
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        Array::wrap(bridge::reshape(self.raw(), shape))
    }

    /// Permutes axes.
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        Array::wrap(bridge::transpose(self.raw(), axes))
    }

    /// Swaps the last two axes of a 2-D array (`[a, b] -> [b, a]`).
    pub fn t(&self) -> Result<Array> {
        self.transpose(&[1, 0])
    }

    /// A row-major copy of a strided view (e.g. of a transpose), so later
    /// reads see contiguous memory.
    pub fn contiguous(&self) -> Result<Array> {
        Array::wrap(bridge::contiguous(self.raw()))
    }

    /// Softmax along `axis`, computed in float32 for lower-precision input.
    pub fn softmax(&self, axis: i32) -> Result<Array> {
        Array::wrap(bridge::softmax(self.raw(), axis))
    }

    /// Index of the first maximum along `axis`.
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        Array::wrap(bridge::argmax(self.raw(), axis, keepdims))
    }

    /// Gathers `indices` along `axis` (embedding lookup is `take(ids, 0)`).
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        Array::wrap(bridge::take(self.raw(), indices.raw(), axis))
    }

    /// `self`'s entries at `indices` along `axis`, per position of the
    /// other axes (`indices` int32 or uint32, `self`'s rank, broadcast
    /// against it): the scores of the chosen experts from all of them.
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        Array::wrap(bridge::take_along_axis(self.raw(), indices.raw(), axis))
    }

    /// Indices (uint32) that partition `axis` around its `kth` smallest
    /// element: every index before position `kth` points at an element no
    /// larger, every one after at one no smaller (negative `kth` counts
    /// from the end). The top-k experts are the last `k` of
    /// `argpartition(-k)`; the order within each side is unspecified.
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        Array::wrap(bridge::argpartition(self.raw(), kth, axis))
    }

    /// Indices (uint32) that sort `axis` ascending.
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        Array::wrap(bridge::argsort(self.raw(), axis))
    }

    /// Sum over `axis`, keeping it as size 1 when `keepdims`.
    pub fn sum_axis(&self, axis: i32, keepdims: bool) -> Result<Array> {
        Array::wrap(bridge::sum_axis(self.raw(), axis, keepdims))
    }

    /// Elementwise `floor(self / other)` with broadcasting (integer
    /// division for integer arrays).
    pub fn floor_divide(&self, other: &Array) -> Result<Array> {
        Array::wrap(bridge::floor_divide(self.raw(), other.raw()))
    }

    /// Batched matrix products with a matrix gathered per batch entry
    /// (MLX's `gather_mm`, the mixture-of-experts product): `self`
    /// `[..., M, K]`, `b` `[E, K, N]` (one matrix per expert), `rhs_indices`
    /// (uint32 or int32, broadcast against `self`'s batch axes) picks the
    /// expert of each batch entry; returns `[..., M, N]`. `sorted` tells
    /// MLX the indices are ascending (one contiguous run per expert).
    pub fn gather_mm(&self, b: &Array, rhs_indices: &Array, sorted: bool) -> Result<Array> {
        Array::wrap(bridge::gather_mm(
            self.raw(),
            b.raw(),
            rhs_indices.raw(),
            sorted,
        ))
    }

    /// [`Array::gather_mm`] against affine-quantized expert matrices
    /// (MLX's `gather_qmm`, transposed): `w` `[E, N, K · bits / 32]`
    /// uint32, `scales`/`biases` `[E, N, K / group_size]`; `self`
    /// `[..., M, K]` -> `[..., M, N]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_qmm(
        &self,
        w: &Array,
        scales: &Array,
        biases: &Array,
        rhs_indices: &Array,
        group_size: i32,
        bits: i32,
        sorted: bool,
    ) -> Result<Array> {
        Array::wrap(bridge::gather_qmm(
            self.raw(),
            w.raw(),
            scales.raw(),
            biases.raw(),
            rhs_indices.raw(),
            group_size,
            bits,
            sorted,
        ))
    }

    /// The sub-array `[start, stop)` on every axis.
    pub fn slice(&self, start: &[i32], stop: &[i32]) -> Result<Array> {
        Array::wrap(bridge::slice(self.raw(), start, stop))
    }

    /// `self` with `values` written at `indices` along `axis` (MLX's
    /// `put_along_axis`; `indices` int32 with `self`'s rank, broadcast
    /// against `values`). When `self` has no other holder, MLX updates its
    /// buffer in place (O(values), not O(self)).
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        Array::wrap(bridge::put_along_axis(
            self.raw(),
            indices.raw(),
            values.raw(),
            axis,
        ))
    }

    /// A copy of `self` with `[start, stop)` replaced by `update` (in place
    /// when `self` has no other holder).
    pub fn slice_update(&self, update: &Array, start: &[i32], stop: &[i32]) -> Result<Array> {
        Array::wrap(bridge::slice_update(self.raw(), update.raw(), start, stop))
    }

    /// `self @ dequantize(w)ᵀ` (`transpose = true`) for MLX affine-quantized
    /// `w` (`[out, in · bits / 32]` uint32) with `scales`/`biases`
    /// `[out, in / group_size]`.
    pub fn quantized_matmul(
        &self,
        w: &Array,
        scales: &Array,
        biases: &Array,
        transpose: bool,
        group_size: i32,
        bits: i32,
    ) -> Result<Array> {
        Array::wrap(bridge::quantized_matmul(
            self.raw(),
            w.raw(),
            scales.raw(),
            biases.raw(),
            transpose,
            group_size,
            bits,
        ))
    }

    /// MLX affine quantization of `self` (`[out, in]`, floating point, `in`
    /// a multiple of `group_size`): `(w, scales, biases)` with `w`
    /// `[out, in · bits / 32]` uint32 and `scales`/`biases`
    /// `[out, in / group_size]` in `self`'s dtype, the layout
    /// [`Array::quantized_matmul`] and [`Array::dequantize`] take. Each
    /// group of `group_size` weights maps linearly onto `0..2^bits`
    /// (MLX's `quantize`, mode `affine`).
    ///
    /// # Errors
    /// A group size or bit width MLX does not support (group 32, 64, 128;
    /// bits 2 to 8), or a last dimension that is not a multiple of the group.
    pub fn quantize(&self, group_size: i32, bits: i32) -> Result<(Array, Array, Array)> {
        let parts = bridge::quantize(self.raw(), group_size, bits)?;
        let [w, scales, biases] = unpack("quantize", &parts)?;
        Ok((w, scales, biases))
    }

    /// Dequantizes MLX affine-quantized `self` (see [`Array::quantized_matmul`])
    /// to `[out, in]` in the scales' dtype.
    pub fn dequantize(
        &self,
        scales: &Array,
        biases: &Array,
        group_size: i32,
        bits: i32,
    ) -> Result<Array> {
        Array::wrap(bridge::dequantize(
            self.raw(),
            scales.raw(),
            biases.raw(),
            group_size,
            bits,
        ))
    }

    /// Matrix inverse of a square float32 matrix (on the CPU stream, as MLX
    /// requires). A singular matrix fails inside `eval` (LAPACK's LU), which
    /// is how the tests exercise an error raised during evaluation.
    pub fn linalg_inv(&self) -> Result<Array> {
        Array::wrap(bridge::linalg_inv(self.raw()))
    }

    /// RMSNorm over the last axis: `x / sqrt(mean(x²) + eps) · weight`.
    pub fn rms_norm(&self, weight: &Array, eps: f32) -> Result<Array> {
        Array::wrap(bridge::rms_norm(self.raw(), weight.raw(), eps))
    }

    /// Depthwise causal convolution over time: `self` `[batch, length +
    /// kernel - 1, channels]` (the kernel - 1 earlier inputs first),
    /// `weight` `[channels, kernel, 1]` (one filter per channel, MLX's
    /// `Conv1d` layout) -> `[batch, length, channels]`, no padding.
    pub fn depthwise_conv1d(&self, weight: &Array) -> Result<Array> {
        Array::wrap(bridge::depthwise_conv1d(self.raw(), weight.raw()))
    }

    /// `rms_norm(self, weight, eps) · SiLU(gate)`, computed in float32 and
    /// returned in `self`'s dtype (Qwen3-Next's and Qwen3.5's gated
    /// RMSNorm; mlx_lm's `Qwen3NextRMSNormGated`).
    pub fn gated_rms_norm(&self, gate: &Array, weight: &Array, eps: f32) -> Result<Array> {
        Array::wrap(bridge::gated_rms_norm(
            self.raw(),
            gate.raw(),
            weight.raw(),
            eps,
        ))
    }

    /// Rotary position embedding (RoFormer, Su et al. 2021) over the first
    /// `dims` features of the last axis; `self` is `[batch, heads, seq, head_dim]`
    /// and token `i` of the sequence gets absolute position `offset + i`.
    pub fn rope(
        &self,
        dims: i32,
        traditional: bool,
        base: f32,
        scale: f32,
        offset: i32,
    ) -> Result<Array> {
        Array::wrap(bridge::rope(
            self.raw(),
            dims,
            traditional,
            base,
            scale,
            offset,
        ))
    }

    /// RoPE with a per-row start position: `offsets` is int32 `[batch]`.
    pub fn rope_at(
        &self,
        dims: i32,
        traditional: bool,
        base: f32,
        scale: f32,
        offsets: &Array,
    ) -> Result<Array> {
        Array::wrap(bridge::rope_positions(
            self.raw(),
            dims,
            traditional,
            base,
            scale,
            offsets.raw(),
        ))
    }

    /// RoPE with explicit inverse frequencies `freqs` (`[dims / 2]`), as used
    /// by Llama 3's scaled RoPE.
    pub fn rope_with_freqs(
        &self,
        dims: i32,
        traditional: bool,
        scale: f32,
        offset: i32,
        freqs: &Array,
    ) -> Result<Array> {
        Array::wrap(bridge::rope_freqs(
            self.raw(),
            dims,
            traditional,
            scale,
            offset,
            freqs.raw(),
        ))
    }

    /// [`Array::rope_with_freqs`] with per-row start positions: `offsets` is
    /// int32 `[batch]`.
    pub fn rope_with_freqs_at(
        &self,
        dims: i32,
        traditional: bool,
        scale: f32,
        offsets: &Array,
        freqs: &Array,
    ) -> Result<Array> {
        Array::wrap(bridge::rope_freqs_positions(
            self.raw(),
            dims,
            traditional,
            scale,
            offsets.raw(),
            freqs.raw(),
        ))
    }
}

/// Decode attention over a paged KV pool (`src/paged_attention.cc`): each
/// row's one query attends to its live keys, read from the pool through its
/// block table, with no gather and no mask. The algorithm is vLLM's
/// PagedAttention decode kernel (Kwon et al. 2023) with an online softmax.
///
/// Shapes: `q` `[rows, heads, head_dim]`; `k_pool`/`v_pool` `[slots,
/// kv_heads, head_dim]` (same dtype as `q`); `tables` int32 `[rows,
/// max_blocks]`, each row's block ids in position order; `meta` int32
/// `[rows, 2]`: the offset of the row's first live key inside its first
/// block, and its live key count (at least 1); `scale` float32 `[1]`. Live key
/// `t` of a row is at slot `tables[row][(offset + t) / block_size] *
/// block_size + (offset + t) % block_size`. With a sliding `window` (in
/// keys), each row attends to its last `window` live keys only. `sinks`
/// (float32 `[heads]`, gpt-oss's attention sinks) add one logit per head to
/// each row's softmax, with no value. Returns `[rows, heads, head_dim]`.
///
/// # Errors
/// Mismatched shapes or dtypes (sinks not float32 `[heads]`), `head_dim`
/// not a multiple of 32 (or above 256), and backends without the kernel
/// (see [`paged_attention_available`]).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    q: &Array,
    k_pool: &Array,
    v_pool: &Array,
    tables: &Array,
    meta: &Array,
    scale: &Array,
    block_size: i32,
    window: Option<usize>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (q, k, v, t, m, s) = (
        q.raw(),
        k_pool.raw(),
        v_pool.raw(),
        tables.raw(),
        meta.raw(),
        scale.raw(),
    );
    let w = window_arg(window)?;
    Array::wrap(match sinks {
        None => bridge::paged_decode_attention(q, k, v, t, m, s, block_size, w),
        Some(sinks) => {
            bridge::paged_decode_attention_sinks(q, k, v, t, m, s, block_size, w, sinks.raw())
        }
    })
}

/// The quantization of a paged pool read by
/// [`paged_decode_attention_quantized`]: MLX's affine quantization (see
/// [`Array::quantize`]), one scale and bias per `group_size` elements of a
/// head.
#[derive(Debug, Clone, Copy)]
pub struct PagedQuantArrays<'a> {
    /// `[slots, kv_heads, head_dim / group_size]`, `q`'s dtype.
    pub key_scales: &'a Array,
    /// As `key_scales`.
    pub key_biases: &'a Array,
    /// As `key_scales`.
    pub value_scales: &'a Array,
    /// As `key_scales`.
    pub value_biases: &'a Array,
    /// Elements per scale and bias: 32 or 64.
    pub group_size: i32,
    /// Bits per element: 8 or 4 (`32 / bits` elements per uint32 word).
    pub bits: i32,
}

/// [`paged_decode_attention`] over quantized pools: `k_pool`/`v_pool` are
/// uint32 `[slots, kv_heads, head_dim * bits / 32]` (MLX's packing, the
/// first element in the lowest bits), dequantized as the kernel reads them
/// (`q · scale + bias`, float32 arithmetic). Same tables, meta, window and
/// sinks; returns `[rows, heads, head_dim]`.
///
/// # Errors
/// As [`paged_decode_attention`], and scales or biases of another shape
/// or dtype than `q`'s, bits other than 8 or 4, a group size other than 32
/// or 64 (or not dividing `head_dim`).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_quantized(
    q: &Array,
    k_pool: &Array,
    v_pool: &Array,
    quant: PagedQuantArrays<'_>,
    tables: &Array,
    meta: &Array,
    scale: &Array,
    block_size: i32,
    window: Option<usize>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let w = window_arg(window)?;
    let (ks, kb, vs, vb) = (
        quant.key_scales.raw(),
        quant.key_biases.raw(),
        quant.value_scales.raw(),
        quant.value_biases.raw(),
    );
    let (g, bits) = (quant.group_size, quant.bits);
    let (q, k, v, t, m, s) = (
        q.raw(),
        k_pool.raw(),
        v_pool.raw(),
        tables.raw(),
        meta.raw(),
        scale.raw(),
    );
    Array::wrap(match sinks {
        None => bridge::paged_decode_attention_quantized(
            q, k, ks, kb, v, vs, vb, t, m, s, block_size, w, g, bits,
        ),
        Some(sinks) => bridge::paged_decode_attention_quantized_sinks(
            q,
            k,
            ks,
            kb,
            v,
            vs,
            vb,
            t,
            m,
            s,
            block_size,
            w,
            g,
            bits,
            sinks.raw(),
        ),
    })
}

/// The paged kernel's `WINDOW`: the window in keys, 0 for none.
fn window_arg(window: Option<usize>) -> Result<i32> {
    i32::try_from(window.unwrap_or(0)).map_err(|_| {
        Error(format!(
            "attention window {window:?} does not fit the kernel"
        ))
    })
}

/// Whether [`paged_decode_attention`] has a kernel for the default device:
/// it is a GPU, of MLX's CUDA backend or Metal on macOS (false with the
/// CPU as the default device, on any machine).
pub fn paged_attention_available() -> bool {
    bridge::paged_attention_available().unwrap_or(false)
}

/// Whether the paged-attention kernels take heads of `head_dim`: they
/// split a head over a warp's 32 lanes, up to 256.
pub fn paged_attention_head_dim_fits(head_dim: usize) -> bool {
    head_dim.is_multiple_of(32) && head_dim <= 256
}

/// Lets the paged-attention kernels split a row's keys into parts
/// (flash-decoding, the default) or not. Whether they split depends on
/// the launch (rows x heads, the longest row), so a query's reduction
/// order would depend on its batch-mates; with `false` each (row, head)
/// is one block that walks its keys in one order, whatever the batch
/// (`--deterministic`). For the launches of the calling thread (the
/// engine thread builds the graphs); takes effect at the next launch.
pub fn set_paged_attention_split(split: bool) {
    bridge::set_paged_attention_split(split);
}

/// The gated delta rule (Yang, Kautz and Hatamizadeh 2024, "Gated Delta
/// Networks: Improving Mamba2 with Delta Rule"; mlx_lm's
/// `models/gated_delta.py`), token by token. `q`, `k` `[batch, tokens,
/// k_heads, k_dim]` before normalization (L2-normalized here, q scaled by
/// `k_dim^-1/2`), `v` `[batch, tokens, v_heads, v_dim]`, `a`, `b` `[batch,
/// tokens, v_heads]` (decay input and write strength before their
/// activations), `a_log`, `dt_bias` `[v_heads]`, `state` float32 `[batch,
/// v_heads, v_dim, k_dim]`. Per token: `S = S · exp(-exp(a_log) ·
/// softplus(a + dt_bias))`, `S += k ⊗ (v - S k) · sigmoid(b)`, `y = S q`.
/// Returns `y` `[batch, tokens, v_heads, v_dim]` in `q`'s dtype and the
/// state after the last token.
///
/// # Errors
/// Shapes that do not fit (`v_heads` a multiple of `k_heads`), MLX errors.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta(
    q: &Array,
    k: &Array,
    v: &Array,
    a: &Array,
    b: &Array,
    a_log: &Array,
    dt_bias: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let parts = bridge::gated_delta(
        q.raw(),
        k.raw(),
        v.raw(),
        a.raw(),
        b.raw(),
        a_log.raw(),
        dt_bias.raw(),
        state.raw(),
    )?;
    let [y, state] = unpack("gated_delta", &parts)?;
    Ok((y, state))
}

/// Mamba2's selective state-space recurrence (Dao and Gu 2024,
/// "Transformers are SSMs"; mlx_lm's `models/ssm.py`), token by token.
/// `x` `[batch, tokens, heads, head_dim]`, `dt` `[batch, tokens, heads]`
/// before its activation, `b`, `c` `[batch, tokens, groups, state_dim]`
/// (head `h` reads group `h / (heads / groups)`), `a_log`, `d`, `dt_bias`
/// `[heads]`, `state` float32 `[batch, heads, head_dim, state_dim]`. Per
/// token, with `Δ = clip(softplus(dt + dt_bias), dt_min, dt_max)`: `S =
/// exp(-exp(a_log) · Δ) · S + Δ · x ⊗ b`, `y = S c + d · x`. Returns `y`
/// `[batch, tokens, heads, head_dim]` in `x`'s dtype and the state after
/// the last token. On a GPU one kernel runs every token.
///
/// # Errors
/// Shapes that do not fit (`heads` a multiple of `groups`), MLX errors.
#[allow(clippy::too_many_arguments)]
pub fn ssm_scan(
    x: &Array,
    dt: &Array,
    b: &Array,
    c: &Array,
    a_log: &Array,
    d: &Array,
    dt_bias: &Array,
    dt_limit: (f32, f32),
    state: &Array,
) -> Result<(Array, Array)> {
    let parts = bridge::ssm_scan(
        x.raw(),
        dt.raw(),
        b.raw(),
        c.raw(),
        a_log.raw(),
        d.raw(),
        dt_bias.raw(),
        dt_limit.0,
        dt_limit.1,
        state.raw(),
    )?;
    let [y, state] = unpack("ssm_scan", &parts)?;
    Ok((y, state))
}
