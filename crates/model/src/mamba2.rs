//! Mamba2, the state-space token mixer of Granite 4's hybrid layers (Dao
//! and Gu 2024, "Transformers are SSMs: Generalized Models and Efficient
//! Algorithms Through Structured State Space Duality"). Reference
//! implementation: mlx_lm's `models/granitemoehybrid.py`
//! (`GraniteMoeHybridMamba2Mixer`) and `models/ssm.py`.
//!
//! Per token: one projection `in_proj` to a gate `[inner]`, the
//! convolution's input `[inner + 2 · groups · state_dim]` and a step size
//! per head `[heads]`; a depthwise causal convolution over time (kernel
//! `conv_kernel`, bias, SiLU) whose output splits into `x` `[heads,
//! head_dim]`, `B` and `C` `[groups, state_dim]`; the selective scan
//! ([`mlxcel_mlx::ssm_scan`]) on a state `[heads, head_dim, state_dim]`;
//! then `y · SiLU(gate)`, an RMSNorm over `inner` and `out_proj`. What a
//! sequence keeps between steps is fixed-size: the convolution's last
//! `conv_kernel - 1` inputs and the scan's state (float32), through the
//! KV view as [`crate::gated_delta`]'s layers keep theirs.

use mlxcel_kv::AttentionKv;
use mlxcel_mlx::{Array, Dtype};

use crate::layers::{Linear, LoadContext};
use crate::recurrent;
use crate::step::Step;
use crate::ModelError;

/// A Mamba2 layer's sizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mamba2Spec {
    /// Heads of the scan, `mamba_n_heads`.
    pub heads: usize,
    /// Features per head, `mamba_d_head`.
    pub head_dim: usize,
    /// State features per head feature, `mamba_d_state`.
    pub state_dim: usize,
    /// Groups sharing `B` and `C` (`heads` a multiple), `mamba_n_groups`.
    pub groups: usize,
    /// The convolution's kernel, `mamba_d_conv`.
    pub conv_kernel: usize,
    /// The convolution has a bias, `mamba_conv_bias`.
    pub conv_bias: bool,
    /// `in_proj` and `out_proj` have biases, `mamba_proj_bias`.
    pub proj_bias: bool,
    /// The step size's clip range, `time_step_limit`.
    pub dt_limit: (f32, f32),
    /// The output norm's epsilon.
    pub eps: f32,
}

impl Mamba2Spec {
    /// Features of the scan's input and output, `heads · head_dim`.
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Channels of the convolution: `x`, `B` and `C` together.
    pub fn conv_channels(&self) -> usize {
        self.inner() + 2 * self.groups * self.state_dim
    }

    /// The state one sequence keeps: the convolution's last inputs
    /// `[conv_kernel - 1, channels]` and the scan's state `[heads,
    /// head_dim, state_dim]`.
    pub fn state_shapes(&self) -> Vec<Vec<usize>> {
        vec![
            vec![self.conv_kernel - 1, self.conv_channels()],
            vec![self.heads, self.head_dim, self.state_dim],
        ]
    }
}

/// One Mamba2 layer.
#[derive(Debug)]
pub struct Mamba2 {
    spec: Mamba2Spec,
    in_proj: Linear,
    /// `[channels, conv_kernel, 1]` (MLX's depthwise `Conv1d` layout).
    conv_weight: Array,
    conv_bias: Option<Array>,
    /// `[heads]` each.
    dt_bias: Array,
    a_log: Array,
    d: Array,
    /// The output norm's weight `[inner]`.
    norm_weight: Array,
    out_proj: Linear,
    dtype: Dtype,
}

impl Mamba2 {
    /// Loads `{path}.{in_proj,conv1d,dt_bias,A_log,D,norm,out_proj}`. A
    /// convolution stored `[channels, 1, kernel]` (Hugging Face's layout)
    /// is transposed to MLX's.
    ///
    /// # Errors
    /// Missing tensors; tensors whose shapes disagree with `spec`; sizes
    /// that cannot be (`heads` not a multiple of `groups`, a kernel under
    /// 2); tensor parallelism (not split yet).
    pub fn load(
        ctx: &mut LoadContext<'_>,
        path: &str,
        spec: &Mamba2Spec,
    ) -> Result<Self, ModelError> {
        if ctx.shard.is_some() {
            return Err(ModelError::Config(
                "tensor parallelism does not split Mamba2 layers yet".into(),
            ));
        }
        if spec.groups == 0
            || spec.heads == 0
            || !spec.heads.is_multiple_of(spec.groups)
            || spec.conv_kernel < 2
            || spec.head_dim == 0
            || spec.state_dim == 0
        {
            return Err(ModelError::Config(format!(
                "{path}: mamba_n_heads {} must be a multiple of mamba_n_groups {}, head and state \
                 sizes positive, and the convolution kernel at least 2 (is {})",
                spec.heads, spec.groups, spec.conv_kernel
            )));
        }
        let conv_weight =
            recurrent::load_conv_weight(ctx, path, spec.conv_channels(), spec.conv_kernel)?;
        let conv_bias = match spec.conv_bias {
            true => Some(ctx.float(&format!("{path}.conv1d.bias"))?),
            false => None,
        };
        let float32 = |ctx: &mut LoadContext<'_>, name: &str| -> Result<Array, ModelError> {
            Ok(ctx
                .weights
                .take(&format!("{path}.{name}"))?
                .astype(Dtype::Float32)?)
        };
        let layer = Mamba2 {
            spec: *spec,
            in_proj: Linear::load(ctx, &format!("{path}.in_proj"), spec.proj_bias)?,
            conv_weight,
            conv_bias,
            dt_bias: float32(ctx, "dt_bias")?,
            a_log: float32(ctx, "A_log")?,
            d: float32(ctx, "D")?,
            norm_weight: ctx.float(&format!("{path}.norm.weight"))?,
            out_proj: Linear::load(ctx, &format!("{path}.out_proj"), spec.proj_bias)?,
            dtype: ctx.dtype,
        };
        let heads = vec![spec.heads as i32];
        let mut checks = vec![
            ("dt_bias", &layer.dt_bias, heads.clone()),
            ("A_log", &layer.a_log, heads.clone()),
            ("D", &layer.d, heads),
            ("norm.weight", &layer.norm_weight, vec![spec.inner() as i32]),
        ];
        if let Some(b) = &layer.conv_bias {
            checks.push(("conv1d.bias", b, vec![spec.conv_channels() as i32]));
        }
        recurrent::check_shapes(path, &checks)?;
        Ok(layer)
    }

    /// The layer's sizes.
    pub fn spec(&self) -> &Mamba2Spec {
        &self.spec
    }

    /// `x` `[1, tokens, hidden]` (a step's rows packed) -> `[1, tokens,
    /// hidden]`. Each row starts from its state in `kv` (zero at position
    /// 0) and writes the state after its real tokens; its pad tokens get a
    /// zero output and change nothing. The leading one-token rows (decode)
    /// run as one batch, every other row alone.
    ///
    /// # Errors
    /// The KV view's errors (a missing state); MLX errors.
    pub fn forward(
        &self,
        x: &Array,
        layer: usize,
        kv: &mut dyn AttentionKv,
        step: &Step,
    ) -> Result<Array, ModelError> {
        let s = &self.spec;
        let t = step.tokens as i32;
        let (inner, channels) = (s.inner() as i32, s.conv_channels() as i32);
        let proj = self.in_proj.forward(x)?;
        let gate = proj.slice(&[0, 0, 0], &[1, t, inner])?;
        let conv_in = proj.slice(&[0, 0, inner], &[1, t, inner + channels])?;
        let dt = proj.slice(
            &[0, 0, inner + channels],
            &[1, t, inner + channels + s.heads as i32],
        )?;
        let y = recurrent::run_rows(step, kv, &[inner], self.dtype, |kv, rows, start, len| {
            self.run(&conv_in, &dt, rows, start, len, layer, kv)
        })?;
        let y = y
            .reshape(&[1, t, inner])?
            .multiply(&gate.silu()?)?
            .rms_norm(&self.norm_weight, s.eps)?;
        self.out_proj.forward(&y)
    }

    /// Rows `rows` (consecutive in the packed step from `start`, `len`
    /// tokens each) through the convolution and the scan, from their
    /// states in `kv`; writes their new states. Returns `[rows · len,
    /// inner]`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        conv_in: &Array,
        dt: &Array,
        rows: &[usize],
        start: usize,
        len: usize,
        layer: usize,
        kv: &mut dyn AttentionKv,
    ) -> Result<Array, ModelError> {
        let s = &self.spec;
        let (n, l) = (rows.len() as i32, len as i32);
        let (heads, head_dim) = (s.heads as i32, s.head_dim as i32);
        let (groups, state_dim) = (s.groups as i32, s.state_dim as i32);
        let (inner, channels) = (s.inner() as i32, s.conv_channels() as i32);
        let span = |x: &Array| recurrent::rows_span(x, start, rows.len(), len);
        let (conv_in, dt) = (span(conv_in)?, span(dt)?);
        let [conv, state] = recurrent::read_states(kv, layer, rows, || {
            Ok([
                mlxcel_mlx::zeros(&[1, s.conv_kernel as i32 - 1, channels], self.dtype)?,
                mlxcel_mlx::zeros(&[1, heads, head_dim, state_dim], Dtype::Float32)?,
            ])
        })?;
        let (conv_out, conv_state) =
            recurrent::causal_conv(&conv, &conv_in, &self.conv_weight, self.conv_bias.as_ref())?;
        let bc = groups * state_dim;
        let part = |from: i32, width: i32, shape: &[i32]| -> Result<Array, ModelError> {
            Ok(conv_out
                .slice(&[0, 0, from], &[n, l, from + width])?
                .reshape(shape)?)
        };
        let xs = part(0, inner, &[n, l, heads, head_dim])?;
        let b = part(inner, bc, &[n, l, groups, state_dim])?;
        let c = part(inner + bc, bc, &[n, l, groups, state_dim])?;
        let (y, state) = mlxcel_mlx::ssm_scan(
            &xs,
            &dt,
            &b,
            &c,
            &self.a_log,
            &self.d,
            &self.dt_bias,
            s.dt_limit,
            &state,
        )?;
        recurrent::write_states(kv, layer, rows, &[conv_state, state])?;
        Ok(y.reshape(&[n * l, inner])?)
    }

    /// Every tensor of the layer.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v: Vec<&Array> = [&self.in_proj, &self.out_proj]
            .into_iter()
            .flat_map(Linear::arrays)
            .collect();
        v.extend([
            &self.conv_weight,
            &self.dt_bias,
            &self.a_log,
            &self.d,
            &self.norm_weight,
        ]);
        v.extend(self.conv_bias.as_ref());
        v
    }
}
