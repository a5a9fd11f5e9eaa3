//! Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5
//! (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks: Improving
//! Mamba2 with Delta Rule"). Reference implementation: mlx_lm's
//! `models/qwen3_5.py` (`GatedDeltaNet`) and `models/gated_delta.py`.
//!
//! Per token: a projection to q, k, v (one `in_proj_qkv`), a depthwise
//! causal convolution over time (kernel `conv_kernel`, SiLU), then the
//! gated delta rule on a state `[v_heads, v_dim, k_dim]`; the output is
//! RMS-normalized, gated by SiLU(`in_proj_z`) and projected back. What a
//! sequence keeps between steps is fixed-size: the convolution's last
//! `conv_kernel - 1` inputs `[conv_kernel - 1, channels]` and the state
//! (float32), read and written through the KV view
//! ([`AttentionKv::read_state`], [`AttentionKv::write_state`]).

use mlxcel_kv::AttentionKv;
use mlxcel_mlx::{Array, Dtype};

use crate::layers::{Linear, LoadContext};
use crate::recurrent;
use crate::step::Step;
use crate::ModelError;

/// A Gated DeltaNet layer's sizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GatedDeltaSpec {
    /// Key (and query) heads, `linear_num_key_heads`.
    pub k_heads: usize,
    /// Value heads, `linear_num_value_heads` (a multiple of `k_heads`).
    pub v_heads: usize,
    /// Features per key head, `linear_key_head_dim`.
    pub k_dim: usize,
    /// Features per value head, `linear_value_head_dim`.
    pub v_dim: usize,
    /// The convolution's kernel, `linear_conv_kernel_dim`.
    pub conv_kernel: usize,
    /// The output norm's epsilon.
    pub eps: f32,
}

impl GatedDeltaSpec {
    /// Channels of the convolution: q, k and v together.
    pub fn conv_channels(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// The state one sequence keeps: the convolution's last inputs
    /// `[conv_kernel - 1, channels]` and the recurrent state `[v_heads,
    /// v_dim, k_dim]`.
    pub fn state_shapes(&self) -> Vec<Vec<usize>> {
        vec![
            vec![self.conv_kernel - 1, self.conv_channels()],
            vec![self.v_heads, self.v_dim, self.k_dim],
        ]
    }
}

/// One Gated DeltaNet layer.
#[derive(Debug)]
pub struct GatedDeltaNet {
    spec: GatedDeltaSpec,
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    /// `[channels, conv_kernel, 1]` (MLX's depthwise `Conv1d` layout).
    conv_weight: Array,
    /// `[v_heads]`, compute dtype.
    dt_bias: Array,
    /// `[v_heads]`, float32.
    a_log: Array,
    /// The gated output norm's weight `[v_dim]`.
    norm_weight: Array,
    out_proj: Linear,
    dtype: Dtype,
}

impl GatedDeltaNet {
    /// Loads `{path}.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,conv1d,
    /// dt_bias,A_log,norm,out_proj}`. A convolution stored `[channels, 1,
    /// kernel]` (Hugging Face's layout) is transposed to MLX's.
    ///
    /// # Errors
    /// Missing tensors; tensors whose shapes disagree with `spec`; tensor
    /// parallelism (not split yet).
    pub fn load(
        ctx: &mut LoadContext<'_>,
        path: &str,
        spec: &GatedDeltaSpec,
    ) -> Result<Self, ModelError> {
        if ctx.shard.is_some() {
            return Err(ModelError::Config(
                "tensor parallelism does not split Gated DeltaNet layers yet".into(),
            ));
        }
        if spec.k_heads == 0 || !spec.v_heads.is_multiple_of(spec.k_heads) || spec.conv_kernel < 2 {
            return Err(ModelError::Config(format!(
                "{path}: linear_num_value_heads {} must be a multiple of linear_num_key_heads {}, \
                 and the convolution kernel at least 2 (is {})",
                spec.v_heads, spec.k_heads, spec.conv_kernel
            )));
        }
        let linear = |ctx: &mut LoadContext<'_>, name: &str| {
            Linear::load(ctx, &format!("{path}.{name}"), false)
        };
        let conv_weight =
            recurrent::load_conv_weight(ctx, path, spec.conv_channels(), spec.conv_kernel)?;
        let layer = GatedDeltaNet {
            spec: *spec,
            in_proj_qkv: linear(ctx, "in_proj_qkv")?,
            in_proj_z: linear(ctx, "in_proj_z")?,
            in_proj_b: linear(ctx, "in_proj_b")?,
            in_proj_a: linear(ctx, "in_proj_a")?,
            conv_weight,
            dt_bias: ctx.float(&format!("{path}.dt_bias"))?,
            a_log: ctx
                .weights
                .take(&format!("{path}.A_log"))?
                .astype(Dtype::Float32)?,
            norm_weight: ctx.float(&format!("{path}.norm.weight"))?,
            out_proj: linear(ctx, "out_proj")?,
            dtype: ctx.dtype,
        };
        let hv = spec.v_heads as i32;
        recurrent::check_shapes(
            path,
            &[
                ("dt_bias", &layer.dt_bias, vec![hv]),
                ("A_log", &layer.a_log, vec![hv]),
                ("norm.weight", &layer.norm_weight, vec![spec.v_dim as i32]),
            ],
        )?;
        Ok(layer)
    }

    /// The layer's sizes.
    pub fn spec(&self) -> &GatedDeltaSpec {
        &self.spec
    }

    /// `x` `[1, tokens, hidden]` (a step's rows packed) -> `[1, tokens,
    /// hidden]`. Each row starts from its state in `kv` (zero at position
    /// 0) and writes the state after its real tokens; its pad tokens get a
    /// zero output and change nothing. The leading one-token rows (decode)
    /// run as one batch, every other row alone.
    pub fn forward(
        &self,
        x: &Array,
        layer: usize,
        kv: &mut dyn AttentionKv,
        step: &Step,
    ) -> Result<Array, ModelError> {
        let s = &self.spec;
        let t = step.tokens as i32;
        let (hv, dv) = (s.v_heads as i32, s.v_dim as i32);
        let qkv = self.in_proj_qkv.forward(x)?;
        let z = self.in_proj_z.forward(x)?.reshape(&[t, hv, dv])?;
        let b = self.in_proj_b.forward(x)?;
        let a = self.in_proj_a.forward(x)?;
        let y = recurrent::run_rows(step, kv, &[hv, dv], self.dtype, |kv, rows, start, len| {
            self.run(&qkv, &a, &b, rows, start, len, layer, kv)
        })?;
        let out = y
            .gated_rms_norm(&z, &self.norm_weight, s.eps)?
            .reshape(&[1, t, hv * dv])?;
        self.out_proj.forward(&out)
    }

    /// Rows `rows` (consecutive in the packed step from `start`, `len`
    /// tokens each) through the convolution and the recurrence, from
    /// their states in `kv`; writes their new states. Returns `[rows ·
    /// len, v_heads, v_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        rows: &[usize],
        start: usize,
        len: usize,
        layer: usize,
        kv: &mut dyn AttentionKv,
    ) -> Result<Array, ModelError> {
        let s = &self.spec;
        let (n, l) = (rows.len() as i32, len as i32);
        let (c, k1) = (s.conv_channels() as i32, s.conv_kernel as i32 - 1);
        let (hk, dk) = (s.k_heads as i32, s.k_dim as i32);
        let (hv, dv) = (s.v_heads as i32, s.v_dim as i32);
        let span = |x: &Array| recurrent::rows_span(x, start, rows.len(), len);
        let (qkv, a, b) = (span(qkv)?, span(a)?, span(b)?);
        let [conv, state] = recurrent::read_states(kv, layer, rows, || {
            Ok([
                mlxcel_mlx::zeros(&[1, k1, c], self.dtype)?,
                mlxcel_mlx::zeros(&[1, hv, dv, dk], Dtype::Float32)?,
            ])
        })?;
        let (conv_out, conv_state) = recurrent::causal_conv(&conv, &qkv, &self.conv_weight, None)?;
        let part = |from: i32, width: i32, heads: i32, dim: i32| -> Result<Array, ModelError> {
            Ok(conv_out
                .slice(&[0, 0, from], &[n, l, from + width])?
                .reshape(&[n, l, heads, dim])?)
        };
        let key = hk * dk;
        let q = part(0, key, hk, dk)?;
        let k = part(key, key, hk, dk)?;
        let v = part(2 * key, hv * dv, hv, dv)?;
        let (y, state) =
            mlxcel_mlx::gated_delta(&q, &k, &v, &a, &b, &self.a_log, &self.dt_bias, &state)?;
        recurrent::write_states(kv, layer, rows, &[conv_state, state])?;
        Ok(y.reshape(&[n * l, hv, dv])?)
    }

    /// Every tensor of the layer.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v: Vec<&Array> = [
            &self.in_proj_qkv,
            &self.in_proj_z,
            &self.in_proj_b,
            &self.in_proj_a,
            &self.out_proj,
        ]
        .into_iter()
        .flat_map(Linear::arrays)
        .collect();
        v.extend([
            &self.conv_weight,
            &self.dt_bias,
            &self.a_log,
            &self.norm_weight,
        ]);
        v
    }
}
