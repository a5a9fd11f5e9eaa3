//! Multi-head attention with grouped-query K/V (Ainslie et al. 2023), the one
//! attention layer that talks to the KV view. The mask is built here, from
//! the number of live keys the view returns (docs/architecture.md invariant 3).

use crate::layers::{Linear, LinearGroup, LoadContext, RmsNorm, ShardAxis};
use crate::profile::mark;
use crate::rope::{Rope, RopeSpec};
use crate::step::{Step, StepMismatch};
use crate::{ModelConfig, ModelError};

/// What one layer's attention is: head counts, projections' biases, q/k
/// norms, RoPE, window and query scale. Families build one per layer.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionSpec {
    /// Query heads.
    pub heads: usize,
    /// K/V heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// RMSNorms of queries and keys before RoPE (`{path}.q_norm`,
    /// `{path}.k_norm`).
    pub qk_norm: Option<QkNorm>,
    pub rope: RopeSpec,
    /// Sliding window in keys (a query sees at most this many, itself
    /// included); `None` for global attention.
    pub window: Option<usize>,
    /// Query scale (`head_dim^-0.5` unless the family says otherwise).
    pub scale: f32,
    /// The q, k and v projections are one fused `{path}.qkv_proj` (q rows,
    /// then k, then v; Phi-3), kept as one [`LinearGroup`].
    pub fused_qkv: bool,
    /// A learned attention sink per query head, `{path}.sinks` `[heads]`
    /// (gpt-oss): one more logit in each query's softmax, with no value.
    pub sinks: bool,
    /// The query projection also gives a gate per head (`[heads, 2 *
    /// head_dim]` rows, each head's queries then its gate): the attention
    /// output is multiplied by `sigmoid(gate)` before `o_proj` (Qwen3-Next,
    /// Qwen3.5).
    pub output_gate: bool,
    /// Values get an RMSNorm without a learned scale over each head (eps
    /// of `qk_norm`, else 1e-6) before they are stored (Gemma 4's
    /// `v_norm`).
    pub v_norm: bool,
    /// The layer has no k/v projections (nor `k_norm`): it attends over
    /// the K/V an earlier layer wrote, which the KV view returns for it
    /// (`mlxcel_kv::LayerState::SharedAttention`), and writes none
    /// (Gemma 4's KV sharing).
    pub shared_kv: bool,
    /// Features per head of the stored K/V when the KV cache is laid out
    /// wider than `head_dim` (a model whose layers have different head
    /// sizes: Gemma 4's sliding 256 and global 512): keys, values and
    /// queries are padded with zeros to it, which changes no score, and
    /// the padding is cut from the output. `None`: `head_dim`.
    pub stored_head_dim: Option<usize>,
    /// K/V heads of the stored K/V when the KV cache holds more than
    /// `kv_heads` (Gemma 4's full layers with `num_global_key_value_heads`):
    /// each head is repeated `stored / kv_heads` times, which grouped-query
    /// attention reads as the same head. `None`: `kv_heads`.
    pub stored_kv_heads: Option<usize>,
    /// No v projection: the values are the key projection, before
    /// `k_norm` and RoPE (Gemma 4's `attention_k_eq_v`).
    pub values_from_keys: bool,
}

/// Where a family normalizes queries and keys.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QkNorm {
    pub eps: f32,
    /// Over each head (`[head_dim]` weights, Qwen3), or over the whole
    /// projection (`[heads * head_dim]` weights, OLMo 2).
    pub per_head: bool,
    /// Added to the weights at load: 1 where the norm scales by
    /// `1 + weight` (Gemma), else 0.
    pub weight_offset: f32,
}

impl AttentionSpec {
    /// Llama's attention as `config` describes it: `attention_bias` on all
    /// four projections, no q/k norms, the model's RoPE and window.
    pub fn from_config(config: &ModelConfig) -> Self {
        AttentionSpec {
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            qkv_bias: config.attention_bias,
            o_bias: config.attention_bias,
            qk_norm: None,
            rope: RopeSpec::from_config(config),
            window: config.sliding_window,
            scale: (config.head_dim as f32).powf(-0.5),
            fused_qkv: false,
            sinks: false,
            output_gate: false,
            v_norm: false,
            shared_kv: false,
            stored_head_dim: None,
            stored_kv_heads: None,
            values_from_keys: false,
        }
    }
}
use mlxcel_kv::AttentionKv;
use mlxcel_mlx::{
    scaled_dot_product_attention, scaled_dot_product_attention_with_sinks, Array, AttentionMask,
    Dtype,
};

/// Self-attention of one transformer layer.
#[derive(Debug, Clone)]
pub struct Attention {
    /// The q, k and v projections in that order, one matmul when they
    /// can be fused ([`LinearGroup`]): q alone on a layer that reads
    /// another's K/V ([`AttentionSpec::shared_kv`]; it has no `k_norm`
    /// either), q and k when values are the keys
    /// ([`AttentionSpec::values_from_keys`]).
    pub qkv: LinearGroup,
    pub o_proj: Linear,
    /// Per-head RMSNorms of queries and keys (before RoPE).
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    /// Whether `q_norm`/`k_norm` run over each head (else over the whole
    /// projection).
    qk_norm_per_head: bool,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    /// `scale` as a float32 `[1]` array (the paged kernel's input).
    scale_array: Array,
    /// Sliding window (Mistral-style): a query sees at most this many keys,
    /// itself included.
    window: Option<usize>,
    /// Attention sinks `[heads]`: in the compute dtype (MLX's attention) and
    /// as float32 (the paged kernel's input), the same values.
    sinks: Option<Sinks>,
    /// See [`AttentionSpec::output_gate`].
    output_gate: bool,
    /// [`AttentionSpec::v_norm`]: ones `[head_dim]` and eps.
    v_norm: Option<(Array, f32)>,
    /// Features per head of the stored K/V and of the attention
    /// ([`AttentionSpec::stored_head_dim`]; `head_dim` unless wider).
    attn_dim: i32,
    /// Stored K/V heads ([`AttentionSpec::stored_kv_heads`]).
    stored_kv_heads: i32,
}

/// A layer's attention sinks, `[heads]` (this rank's heads).
#[derive(Debug, Clone)]
struct Sinks {
    compute: Array,
    float32: Array,
}

impl Attention {
    /// The layer's sliding window in keys (a query sees at most this many,
    /// itself included); `None`: full attention.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// Loads `{path}.{q,k,v,o}_proj` (and `{path}.{q,k}_norm`) as `spec`
    /// describes. Under tensor parallelism (`ctx.shard`) it keeps this
    /// rank's query and K/V heads (q/k/v output rows, o input columns).
    ///
    /// # Errors
    /// Missing tensors; head counts that do not divide by the world size;
    /// q/k norms over the whole projection (OLMo 2) or attention sinks under
    /// tensor parallelism (not split yet); sinks that are not `[heads]`.
    pub fn load(
        ctx: &mut LoadContext<'_>,
        path: &str,
        spec: &AttentionSpec,
    ) -> Result<Self, ModelError> {
        let tp = ctx.shard;
        let ranks = tp.map_or(1, |t| t.size);
        if let Some(t) = tp {
            t.part(spec.heads, "num_attention_heads")?;
            t.part(spec.kv_heads, "num_key_value_heads")?;
            if spec.qk_norm.is_some_and(|n| !n.per_head) {
                return Err(ModelError::Unsupported(
                    "tensor parallelism with q/k norms over the whole projection (OLMo 2)".into(),
                ));
            }
            if spec.sinks {
                return Err(ModelError::Unsupported(
                    "tensor parallelism with attention sinks (not split across ranks yet)".into(),
                ));
            }
            if spec.output_gate {
                return Err(ModelError::Unsupported(
                    "tensor parallelism with gated attention output (not split yet)".into(),
                ));
            }
        }
        let sinks = if spec.sinks {
            let name = format!("{path}.sinks");
            let compute = ctx.float(&name)?;
            if compute.shape() != [spec.heads as i32] {
                return Err(ModelError::Weights(format!(
                    "{name}: shape {:?}, want [{}] (one per query head)",
                    compute.shape(),
                    spec.heads
                )));
            }
            let float32 = compute.astype(Dtype::Float32)?;
            Some(Sinks { compute, float32 })
        } else {
            None
        };
        let norm = |ctx: &mut LoadContext<'_>, name: &str| {
            spec.qk_norm
                .map(|n| {
                    RmsNorm::load_with_offset(
                        ctx,
                        &format!("{path}.{name}"),
                        n.eps,
                        n.weight_offset,
                    )
                })
                .transpose()
        };
        if spec.shared_kv && spec.fused_qkv {
            return Err(ModelError::Unsupported(format!(
                "{path}: a fused qkv_proj on a layer that reads another's K/V"
            )));
        }
        let stored = spec.stored_head_dim.unwrap_or(spec.head_dim);
        if stored < spec.head_dim {
            return Err(ModelError::Config(format!(
                "{path}: K/V stored at {stored} features per head, fewer than its {}",
                spec.head_dim
            )));
        }
        let stored_kv = spec.stored_kv_heads.unwrap_or(spec.kv_heads);
        if spec.kv_heads == 0
            || !stored_kv.is_multiple_of(spec.kv_heads)
            || !spec.heads.is_multiple_of(stored_kv)
        {
            return Err(ModelError::Config(format!(
                "{path}: {} K/V heads stored as {stored_kv} under {} query heads (each must \
                 divide the next)",
                spec.kv_heads, spec.heads
            )));
        }
        if stored_kv != spec.kv_heads && tp.is_some() {
            return Err(ModelError::Unsupported(
                "tensor parallelism with repeated K/V heads (not split yet)".into(),
            ));
        }
        if spec.values_from_keys && spec.fused_qkv {
            return Err(ModelError::Unsupported(format!(
                "{path}: a fused qkv_proj with values from the keys"
            )));
        }
        let separate = |ctx: &mut LoadContext<'_>, names: &[&str]| {
            let parts = names
                .iter()
                .map(|name| {
                    Linear::load(ctx, &format!("{path}.{name}"), spec.qkv_bias)?
                        .shard_if(ShardAxis::Output, tp)
                })
                .collect::<Result<Vec<_>, ModelError>>()?;
            LinearGroup::new(parts)
        };
        let qkv = if spec.shared_kv {
            separate(ctx, &["q_proj"])?
        } else if spec.fused_qkv {
            let (q, kv) = (spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim);
            LinearGroup::load_fused(
                ctx,
                &format!("{path}.qkv_proj"),
                spec.qkv_bias,
                &[q, kv, kv],
            )?
        } else if spec.values_from_keys {
            separate(ctx, &["q_proj", "k_proj"])?
        } else {
            separate(ctx, &["q_proj", "k_proj", "v_proj"])?
        };
        let v_norm = if spec.v_norm {
            let eps = spec.qk_norm.map_or(1e-6, |n| n.eps);
            let ones = Array::from_f32(&vec![1.0; spec.head_dim], &[spec.head_dim as i32])?
                .astype(ctx.dtype)?;
            Some((ones, eps))
        } else {
            None
        };
        let mut rope = Rope::new(&spec.rope)?;
        // YaRN's factor on queries and keys is its square on the scores
        // when whole heads rotate.
        let scale = if spec.rope.dims == spec.head_dim {
            spec.scale * rope.take_input_scale().powi(2)
        } else {
            spec.scale
        };
        Ok(Attention {
            qkv,
            o_proj: Linear::load(ctx, &format!("{path}.o_proj"), spec.o_bias)?
                .shard_if(ShardAxis::Input, tp)?,
            q_norm: norm(ctx, "q_norm")?,
            k_norm: if spec.shared_kv {
                None
            } else {
                norm(ctx, "k_norm")?
            },
            qk_norm_per_head: spec.qk_norm.is_some_and(|n| n.per_head),
            rope,
            heads: (spec.heads / ranks) as i32,
            kv_heads: (spec.kv_heads / ranks) as i32,
            head_dim: spec.head_dim as i32,
            scale,
            scale_array: Array::from_f32(&[scale], &[1])?,
            window: spec.window,
            output_gate: spec.output_gate,
            sinks,
            v_norm,
            attn_dim: stored as i32,
            // This rank's share, as `kv_heads` (repeated heads are
            // refused under tensor parallelism above).
            stored_kv_heads: (stored_kv / ranks) as i32,
        })
    }

    /// `x` `[1, tokens, hidden]` (a step's rows packed, see [`Step`]) ->
    /// `[1, tokens, hidden]`. Each row's new K/V are written to layer
    /// `layer` of `kv`; each row attends to its own live keys.
    pub fn forward(
        &self,
        x: &Array,
        layer: usize,
        kv: &mut dyn AttentionKv,
        step: &Step,
    ) -> Result<Array, ModelError> {
        let t = step.tokens as i32;
        let (h, d) = (self.heads, self.head_dim);
        let (q, gate, new_kv) = match self.project_joint(x, step)? {
            Some((q, k, v)) => (q, None, Some((k, v))),
            None => self.project(x, step)?,
        };
        if let Some((k, v)) = new_kv {
            kv.write(layer, &k, &v)?;
            mark("kv.write", &kv.storage())?;
        }
        let mut parts = Vec::with_capacity(step.rows.len());
        if let Some(every) = self.attend_every_query(&q, layer, kv, step)? {
            parts.push(every);
        } else if step.every_query {
            for (row, span) in step.rows.iter().enumerate() {
                parts.push(self.attend_row_per_query(&q, layer, kv, row, span)?);
            }
        } else {
            let batched = step.batched_decode_rows;
            if batched > 0 {
                parts.push(self.attend_batched(&q, layer, kv, step)?);
            }
            for (row, span) in step.rows.iter().enumerate().skip(batched) {
                parts.push(self.attend_row(&q, layer, kv, row, span)?);
            }
        }
        // One part (a decode batch, or a single row) needs no copy.
        let a = self.attn_dim;
        let o = match parts.as_slice() {
            [one] => one.reshape(&[1, t, h * a])?,
            _ => {
                let parts: Vec<&Array> = parts.iter().collect();
                mlxcel_mlx::concatenate(&parts, 0)?.reshape(&[1, t, h * a])?
            }
        };
        // Stored wider than the heads: the padding's outputs are zeros.
        let o = if a > d {
            o.reshape(&[t, h, a])?
                .slice(&[0, 0, 0], &[t, h, d])?
                .reshape(&[1, t, h * d])?
        } else {
            o
        };
        mark("attn.concat", &[&o])?;
        let o = match gate {
            Some(g) => o.multiply(&g.sigmoid()?)?,
            None => o,
        };
        let o = self.o_proj.forward(&o)?;
        mark("attn.o_proj", &[&o])?;
        Ok(o)
    }

    /// The step's queries `[tokens, heads, 1, attn_dim]` (rotated), the
    /// output gate `[1, tokens, heads * head_dim]` of a gated layer, and
    /// the new K/V `[tokens, stored_kv_heads, attn_dim]` to write (none on
    /// a layer that reads another's).
    #[allow(clippy::type_complexity)]
    fn project(
        &self,
        x: &Array,
        step: &Step,
    ) -> Result<(Array, Option<Array>, Option<(Array, Array)>), ModelError> {
        let t = step.tokens as i32;
        let (h, kvh, d) = (self.heads, self.kv_heads, self.head_dim);
        // Packed per token: [tokens, heads, 1, head_dim], rotated at each
        // token's own absolute position.
        let mut projected = self.qkv.forward(x)?.into_iter();
        let Some(mut q) = projected.next() else {
            return Err(ModelError::Weights(
                "attention without a q projection".into(),
            ));
        };
        let gate = if self.output_gate {
            let both = q.reshape(&[t, h, 2 * d])?;
            q = both.slice(&[0, 0, 0], &[t, h, d])?;
            Some(
                both.slice(&[0, 0, d], &[t, h, 2 * d])?
                    .reshape(&[1, t, h * d])?,
            )
        } else {
            None
        };
        // Norms over the whole projection (OLMo 2) come before the heads
        // split, per-head ones after.
        let whole = |n: &Option<RmsNorm>, x: Array| -> Result<Array, ModelError> {
            match n {
                Some(n) if !self.qk_norm_per_head => n.forward(&x),
                _ => Ok(x),
            }
        };
        let per_head = |n: &Option<RmsNorm>, x: Array| -> Result<Array, ModelError> {
            match n {
                Some(n) if self.qk_norm_per_head => n.forward(&x),
                _ => Ok(x),
            }
        };
        let q = whole(&self.q_norm, q)?.reshape(&[t, h, 1, d])?;
        let q = per_head(&self.q_norm, q)?;
        let q = self.rope.apply_at(&q, &step.positions)?;
        let q = self.pad_heads(q)?;
        if let Some(k) = projected.next() {
            let v = match projected.next() {
                Some(v) => v,
                None => k.clone(),
            }
            .reshape(&[t, kvh, d])?;
            let k = whole(&self.k_norm, k)?.reshape(&[t, kvh, 1, d])?;
            mark("attn.qkv_proj", &[&q, &k, &v])?;
            let k = per_head(&self.k_norm, k)?;
            let v = match &self.v_norm {
                Some((ones, eps)) => v.rms_norm(ones, *eps)?,
                None => v,
            };
            let k = self.rope.apply_at(&k, &step.positions)?;
            mark("attn.rope", &[&q, &k])?;
            let k = self.repeat_kv(self.pad_heads(k.reshape(&[t, kvh, d])?)?)?;
            let v = self.repeat_kv(self.pad_heads(v)?)?;
            return Ok((q, gate, Some((k, v))));
        }
        Ok((q, gate, None))
    }

    /// [`Attention::project`] of a single-token step (one-row decode) on a
    /// plain layer (fused q/k/v, no q/k/v norms, no output gate, heads
    /// stored as computed): the queries and keys are adjacent heads of the
    /// one fused product, so one RoPE kernel rotates both (RoPE is per
    /// head and position, the same values as two calls), and every output
    /// is a view of the product or of the rotation. Host-bound decode pays
    /// per kernel (`docs/performance.md`). `None` where it doesn't apply.
    #[allow(clippy::type_complexity)]
    fn project_joint(
        &self,
        x: &Array,
        step: &Step,
    ) -> Result<Option<(Array, Array, Array)>, ModelError> {
        let (h, kvh, d) = (self.heads, self.kv_heads, self.head_dim);
        let plain = step.tokens == 1
            && !self.output_gate
            && self.q_norm.is_none()
            && self.k_norm.is_none()
            && self.v_norm.is_none()
            && self.attn_dim == d
            && self.stored_kv_heads == kvh
            && self.qkv.fused_sizes() == Some(&[h * d, kvh * d, kvh * d][..]);
        if !plain {
            return Ok(None);
        }
        let Some(y) = self.qkv.forward_whole(x)? else {
            return Ok(None);
        };
        let all = h + 2 * kvh;
        let y = y.reshape(&[1, all, 1, d])?;
        let qk = y.slice(&[0, 0, 0, 0], &[1, h + kvh, 1, d])?;
        let v = y
            .slice(&[0, h + kvh, 0, 0], &[1, all, 1, d])?
            .reshape(&[1, kvh, d])?;
        mark("attn.qkv_proj", &[&qk, &v])?;
        let qk = self.rope.apply_at(&qk, &step.positions)?;
        let q = qk.slice(&[0, 0, 0, 0], &[1, h, 1, d])?;
        let k = qk
            .slice(&[0, h, 0, 0], &[1, h + kvh, 1, d])?
            .reshape(&[1, kvh, d])?;
        mark("attn.rope", &[&q, &k])?;
        Ok(Some((q, k, v)))
    }

    /// One row's queries `[n, heads, 1, head_dim]` (packed at `span.start`)
    /// over its live keys, causal -> `[n, heads * head_dim]`.
    fn attend_row(
        &self,
        q: &Array,
        layer: usize,
        kv: &mut dyn AttentionKv,
        row: usize,
        span: &std::ops::Range<usize>,
    ) -> Result<Array, ModelError> {
        let (h, d) = (self.heads, self.attn_dim);
        let (a, n) = (span.start as i32, span.len() as i32);
        let q = q
            .slice(&[a, 0, 0, 0], &[a + n, h, 1, d])?
            .reshape(&[1, n, h, d])?
            .transpose(&[0, 2, 1, 3])?;
        let (keys, values) = kv.read(layer, row)?;
        mark("kv.read", &[&q, &keys, &values])?;
        let live = keys.dim(2)?;
        let mask = match self.window {
            Some(w) => windowed_causal_mask(n, live, w, q.dtype())?,
            None => causal_mask(n, live)?,
        };
        let o = self.sdpa(&q, &keys, &values, &mask)?;
        mark("attn.sdpa", &[&o])?;
        Ok(o.transpose(&[0, 2, 1, 3])?.reshape(&[n, h * d])?)
    }

    /// Batch-invariant execution without the paged kernel
    /// ([`Step::every_query`]): each query of row `row` (packed at `span`)
    /// as an attention of one query over exactly its own live keys (the
    /// last `window` of them on a windowed layer), no mask: a prefilled
    /// query runs the very operation it would run decoded, whatever the
    /// chunk or the batch -> `[n, heads * head_dim]`.
    fn attend_row_per_query(
        &self,
        q: &Array,
        layer: usize,
        kv: &mut dyn AttentionKv,
        row: usize,
        span: &std::ops::Range<usize>,
    ) -> Result<Array, ModelError> {
        let (h, d) = (self.heads, self.attn_dim);
        let (keys, values) = kv.read(layer, row)?;
        mark("kv.read", &[q, &keys, &values])?;
        let (kvh, live) = (keys.dim(1)?, keys.dim(2)?);
        let n = span.len() as i32;
        if n > live {
            return Err(StepMismatch::QueriesOverKeys {
                queries: n,
                keys: live,
            }
            .into());
        }
        let mut outs = Vec::with_capacity(span.len());
        for (i, at) in span.clone().enumerate() {
            let end = live - (n - 1 - i as i32);
            let start = self.window.map_or(0, |w| (end - w as i32).max(0));
            let qi = q
                .slice(&[at as i32, 0, 0, 0], &[at as i32 + 1, h, 1, d])?
                .reshape(&[1, h, 1, d])?;
            let ki = keys.slice(&[0, 0, start, 0], &[1, kvh, end, d])?;
            let vi = values.slice(&[0, 0, start, 0], &[1, kvh, end, d])?;
            outs.push(
                self.sdpa(&qi, &ki, &vi, &AttentionMask::None)?
                    .reshape(&[1, h * d])?,
            );
        }
        mark("attn.sdpa", &outs.iter().collect::<Vec<_>>())?;
        let refs: Vec<&Array> = outs.iter().collect();
        Ok(mlxcel_mlx::concatenate(&refs, 0)?)
    }

    /// Batch-invariant execution on a GPU ([`Step::query_rows`]): each of
    /// the step's `tokens` queries `[tokens, heads, 1, head_dim]` as a row
    /// of its own of the paged-attention kernel, over its own live keys
    /// (its row's block table, the keys up to itself), so that a query's
    /// attention is the same walk over the same keys whether it is decoded,
    /// prefilled in any chunk, or batched with anything ->
    /// `[tokens, heads * head_dim]`. `None` when the step has no
    /// [`Step::query_rows`] (neither batch-invariant nor of short rows) or the
    /// kernel can't read this layer's pool (dense storage, a head size the
    /// kernel doesn't take, a pool stored in another dtype).
    fn attend_every_query(
        &self,
        q: &Array,
        layer: usize,
        kv: &mut dyn AttentionKv,
        step: &Step,
    ) -> Result<Option<Array>, ModelError> {
        let Some((owner, after)) = &step.query_rows else {
            return Ok(None);
        };
        let (h, d) = (self.heads, self.attn_dim);
        if !mlxcel_mlx::paged_attention_head_dim_fits(d as usize) {
            return Ok(None);
        }
        let ids: Vec<usize> = (0..step.rows.len()).collect();
        let Some(pool) = kv.read_paged(layer, &ids)?.filter(|p| match &p.quantized {
            Some(qz) => qz.key_scales.dtype() == q.dtype(),
            None => p.keys.dtype() == q.dtype(),
        }) else {
            return Ok(None);
        };
        let tables = pool.tables.take(owner, 0)?;
        let meta = pool.meta.take(owner, 0)?.subtract(after)?;
        let t = step.tokens as i32;
        let o = self.paged(&q.reshape(&[t, h, d])?, &pool, &tables, &meta)?;
        mark("attn.paged_kernel", &[&o])?;
        Ok(Some(o.reshape(&[t, h * d])?))
    }

    /// The paged-attention kernel of `q` `[rows, heads, head_dim]` over
    /// `pool`, each row through its block table `tables` `[rows,
    /// max_blocks]` and `meta` `[rows, 2]` -> `[rows, heads, head_dim]`.
    fn paged(
        &self,
        q: &Array,
        pool: &mlxcel_kv::PagedKv<'_>,
        tables: &Array,
        meta: &Array,
    ) -> Result<Array, ModelError> {
        let (scale, bs) = (&self.scale_array, pool.block_size as i32);
        let sinks = self.sinks.as_ref().map(|s| &s.float32);
        Ok(match &pool.quantized {
            None => mlxcel_mlx::paged_decode_attention(
                q,
                pool.keys,
                pool.values,
                tables,
                meta,
                scale,
                bs,
                self.window,
                sinks,
            )?,
            Some(qz) => mlxcel_mlx::paged_decode_attention_quantized(
                q,
                pool.keys,
                pool.values,
                mlxcel_mlx::PagedQuantArrays {
                    key_scales: qz.key_scales,
                    key_biases: qz.key_biases,
                    value_scales: qz.value_scales,
                    value_biases: qz.value_biases,
                    group_size: qz.group_size as i32,
                    bits: qz.bits as i32,
                },
                tables,
                meta,
                scale,
                bs,
                self.window,
                sinks,
            )?,
        })
    }

    /// The step's first `step.batched_decode_rows` rows, one query each
    /// (decode), attended together: by the paged-attention kernel straight
    /// from the pool, or over their keys gathered and padded to the longest
    /// with a mask that hides each row's padding (built once per step).
    /// Falls back to row by row when the view can do neither.
    fn attend_batched(
        &self,
        q: &Array,
        layer: usize,
        kv: &mut dyn AttentionKv,
        step: &Step,
    ) -> Result<Array, ModelError> {
        let rows = step.batched_decode_rows;
        let (h, d) = (self.heads, self.attn_dim);
        let ids: Vec<usize> = (0..rows).collect();
        let q = q.slice(&[0, 0, 0, 0], &[rows as i32, h, 1, d])?;
        // Windowed layers too: the kernel attends to each row's last
        // `window` live keys.
        if step.paged_kernel && mlxcel_mlx::paged_attention_head_dim_fits(d as usize) {
            // Float pools are read as they are when stored in the compute
            // dtype (a cast pool is gathered and cast back instead);
            // quantized ones are dequantized by the kernel as it reads.
            if let Some(pool) = kv.read_paged(layer, &ids)?.filter(|p| match &p.quantized {
                Some(qz) => qz.key_scales.dtype() == q.dtype(),
                None => p.keys.dtype() == q.dtype(),
            }) {
                let q = q.reshape(&[rows as i32, h, d])?;
                let o = self.paged(&q, &pool, pool.tables, pool.meta)?;
                mark("attn.paged_kernel", &[&o])?;
                return Ok(o.reshape(&[rows as i32, h * d])?);
            }
        }
        let Some((keys, values, lens)) = kv.read_padded(layer, &ids)? else {
            let parts = (0..rows)
                .map(|r| self.attend_row(&q, layer, kv, r, &(r..r + 1)))
                .collect::<Result<Vec<_>, _>>()?;
            let parts: Vec<&Array> = parts.iter().collect();
            return Ok(mlxcel_mlx::concatenate(&parts, 0)?);
        };
        mark("kv.read", &[&q, &keys, &values])?;
        let built = step
            .batched_masks
            .borrow()
            .iter()
            .find(|m| m.lens == lens && m.window == self.window)
            .map(|m| m.mask.clone());
        let mask = match built {
            Some(m) => m,
            None => {
                let m = padding_mask(&lens, keys.dim(2)?, self.window, q.dtype())?;
                if let AttentionMask::Array(a) = &m {
                    mark("attn.mask", &[a])?;
                }
                step.batched_masks
                    .borrow_mut()
                    .push(crate::step::BatchedMask {
                        lens,
                        window: self.window,
                        mask: m.clone(),
                    });
                m
            }
        };
        let o = self.sdpa(&q, &keys, &values, &mask)?;
        mark("attn.sdpa", &[&o])?;
        Ok(o.reshape(&[rows as i32, h * d])?)
    }

    /// `x` `[..., head_dim]` padded with zeros to the stored head size
    /// ([`AttentionSpec::stored_head_dim`]); unchanged when they agree.
    fn pad_heads(&self, x: Array) -> Result<Array, ModelError> {
        if self.attn_dim == self.head_dim {
            return Ok(x);
        }
        let mut shape = x.shape();
        if let Some(last) = shape.last_mut() {
            *last = self.attn_dim - self.head_dim;
        }
        let zeros = mlxcel_mlx::zeros(&shape, x.dtype())?;
        Ok(mlxcel_mlx::concatenate(
            &[&x, &zeros],
            shape.len() as i32 - 1,
        )?)
    }

    /// `x` `[tokens, kv_heads, dim]` with each head repeated to the stored
    /// K/V heads ([`AttentionSpec::stored_kv_heads`]); unchanged when they
    /// agree.
    fn repeat_kv(&self, x: Array) -> Result<Array, ModelError> {
        if self.stored_kv_heads == self.kv_heads {
            return Ok(x);
        }
        let (t, a) = (x.dim(0)?, x.dim(2)?);
        let r = self.stored_kv_heads / self.kv_heads;
        let one = x.reshape(&[t, self.kv_heads, 1, a])?;
        let copies: Vec<&Array> = (0..r).map(|_| &one).collect();
        Ok(mlxcel_mlx::concatenate(&copies, 2)?.reshape(&[t, self.stored_kv_heads, a])?)
    }

    /// MLX's fused attention of `q` over `keys`/`values` under `mask`, with
    /// the layer's sinks when it has them.
    fn sdpa(
        &self,
        q: &Array,
        keys: &Array,
        values: &Array,
        mask: &AttentionMask,
    ) -> Result<Array, ModelError> {
        Ok(match &self.sinks {
            None => scaled_dot_product_attention(q, keys, values, self.scale, mask)?,
            Some(s) => scaled_dot_product_attention_with_sinks(
                q, keys, values, self.scale, mask, &s.compute,
            )?,
        })
    }

    /// Every tensor of the layer.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.qkv.arrays();
        v.extend(self.o_proj.arrays());
        v.extend(self.v_norm.iter().map(|(ones, _)| ones));
        v.extend(self.q_norm.iter().chain(&self.k_norm).map(|n| &n.weight));
        v.extend(self.sinks.iter().flat_map(|s| [&s.compute, &s.float32]));
        v
    }
}

/// The mask for `q_len` new queries over `k_len` live keys, the new queries
/// being the last `q_len` of them: a single query sees every live key; more
/// than one see keys up to their own position (lower-right causal).
///
/// # Errors
/// `q_len > k_len` (the view must return the new keys too).
pub fn causal_mask(q_len: i32, k_len: i32) -> Result<AttentionMask, ModelError> {
    if q_len > k_len || q_len < 1 {
        return Err(StepMismatch::QueriesOverKeys {
            queries: q_len,
            keys: k_len,
        }
        .into());
    }
    Ok(if q_len == 1 {
        AttentionMask::None
    } else {
        AttentionMask::Causal
    })
}

/// The additive mask `[rows, 1, 1, max_len]` of one query per row over keys
/// padded to `max_len`: row `r` sees its first `lens[r]` keys (its live
/// keys, as the view returned them) and none of the padding; with a sliding
/// `window`, only the last `window` of them.
///
/// # Errors
/// A row with no live key, or one longer than `max_len`.
pub fn padding_mask(
    lens: &[usize],
    max_len: i32,
    window: Option<usize>,
    dtype: Dtype,
) -> Result<AttentionMask, ModelError> {
    let max = max_len as usize;
    if let Some(bad) = lens.iter().find(|&&l| l == 0 || l > max) {
        return Err(StepMismatch::PaddedRow {
            live: *bad,
            padded: max,
        }
        .into());
    }
    let mut m = vec![f32::NEG_INFINITY; lens.len() * max];
    for (row, &len) in lens.iter().enumerate() {
        let first = window.map_or(0, |w| len.saturating_sub(w));
        m[row * max + first..row * max + len].fill(0.0);
    }
    additive_mask(&m, &[lens.len() as i32, 1, 1, max_len], dtype)
}

/// [`causal_mask`] with a sliding window of `window` keys: query `i` of the
/// last `q_len` sees the live keys at distance `0..window` from it, a band
/// once `k_len > window`: a chunk of several queries, or a single query
/// of a pipelined decode step, whose cache also holds the key the step
/// queued before it kept (`KvCache::trim_keeping`). The mask is built on
/// the host once per shape: the thread keeps the last four of them (up to
/// 4 Mi elements each), so every windowed layer of a step shares one
/// upload.
///
/// # Errors
/// As [`causal_mask`].
pub fn windowed_causal_mask(
    q_len: i32,
    k_len: i32,
    window: usize,
    dtype: Dtype,
) -> Result<AttentionMask, ModelError> {
    let plain = causal_mask(q_len, k_len)?;
    if k_len as usize <= window {
        return Ok(plain);
    }
    let key = (q_len, k_len, window, dtype);
    if let Some(hit) = BAND_MASKS.with(|c| {
        c.borrow()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, m)| m.clone())
    }) {
        return Ok(AttentionMask::Array(hit));
    }
    let (q, k) = (q_len as usize, k_len as usize);
    let mut m = vec![f32::NEG_INFINITY; q * k];
    for i in 0..q {
        // Query i sits at key index k - q + i.
        let at = k - q + i;
        let first = (at + 1).saturating_sub(window);
        m[i * k + first..=i * k + at].fill(0.0);
    }
    let mask = additive_mask(&m, &[1, 1, q_len, k_len], dtype)?;
    if let AttentionMask::Array(a) = &mask {
        if q * k <= BAND_MASK_MAX_ELEMENTS {
            BAND_MASKS.with(|c| {
                let mut c = c.borrow_mut();
                if c.len() == BAND_MASKS_KEPT {
                    c.remove(0);
                }
                c.push((key, a.clone()));
            });
        }
    }
    Ok(mask)
}

/// What a band mask is kept by: queries, keys, window, dtype.
type BandKey = (i32, i32, usize, Dtype);

/// Band masks [`windowed_causal_mask`] keeps per thread.
const BAND_MASKS_KEPT: usize = 4;
/// The largest band mask kept, in elements (4 Mi: 8 MiB in bfloat16).
const BAND_MASK_MAX_ELEMENTS: usize = 1 << 22;

thread_local! {
    /// The last band masks built on this thread, by (queries, keys,
    /// window, dtype): every windowed layer of a step attends a row under
    /// the same band, which was built on the host and uploaded once per
    /// layer (on an H100, 15 of Gemma 3 270M's 18 layers each uploaded a
    /// 4 MiB mask for a 1,024-token prefill: 52 of its 74 ms).
    static BAND_MASKS: std::cell::RefCell<Vec<(BandKey, Array)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// An additive mask (0 visible, -inf hidden) of `shape` in the compute dtype.
fn additive_mask(values: &[f32], shape: &[i32], dtype: Dtype) -> Result<AttentionMask, ModelError> {
    let mask = Array::from_f32(values, shape)?;
    Ok(AttentionMask::Array(if dtype == Dtype::Float32 {
        mask
    } else {
        mask.astype(dtype)?
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A band mask's entries, row by row, as 1 (visible) or 0 (hidden).
    fn band(mask: &AttentionMask) -> Vec<u8> {
        let AttentionMask::Array(a) = mask else {
            panic!("a band is an array mask");
        };
        let v = a.astype(Dtype::Float32).unwrap().to_vec_f32().unwrap();
        v.iter().map(|&x| u8::from(x == 0.0)).collect()
    }

    /// The mask's dtype.
    fn dtype(mask: &AttentionMask) -> Dtype {
        let AttentionMask::Array(a) = mask else {
            panic!("a band is an array mask");
        };
        a.dtype()
    }

    #[test]
    fn a_kept_band_mask_is_the_one_built_for_its_shape() {
        // 3 queries (the last 3 of 5 keys, at 2, 3, 4), window 2: query
        // i sees the keys at i+1 and i+2.
        #[rustfmt::skip]
        let want = vec![
            0, 1, 1, 0, 0,
            0, 0, 1, 1, 0,
            0, 0, 0, 1, 1,
        ];
        let first = windowed_causal_mask(3, 5, 2, Dtype::Float32).unwrap();
        assert_eq!(band(&first), want);
        // The same shape in another dtype is its own mask, while the
        // float32 one is kept; asked again, the float32 one is the kept one.
        let bf16 = windowed_causal_mask(3, 5, 2, Dtype::Bfloat16).unwrap();
        assert_eq!(dtype(&bf16), Dtype::Bfloat16);
        assert_eq!(band(&bf16), want);
        let kept = windowed_causal_mask(3, 5, 2, Dtype::Float32).unwrap();
        assert_eq!(dtype(&kept), Dtype::Float32);
        assert_eq!(band(&kept), want);
        // Another window over the same queries and keys is another band.
        let w3 = windowed_causal_mask(3, 5, 3, Dtype::Float32).unwrap();
        assert_eq!(band(&w3), [1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]);
        // More other shapes and windows than are kept: each its own band.
        for (q, k, w) in [(2, 5, 2), (3, 6, 2), (1, 5, 2), (4, 9, 3)] {
            let m = windowed_causal_mask(q, k, w, Dtype::Float32).unwrap();
            assert_eq!(band(&m).len(), (q * k) as usize);
        }
        // Rebuilt after it was dropped.
        let again = windowed_causal_mask(3, 5, 2, Dtype::Float32).unwrap();
        assert_eq!(band(&again), want);
        // Keys within the window: plain causal, nothing kept.
        assert!(matches!(
            windowed_causal_mask(3, 3, 4, Dtype::Float32).unwrap(),
            AttentionMask::Causal
        ));
    }
}
