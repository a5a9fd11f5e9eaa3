//! The decoder stack most families share: token embedding, layers of
//! (RMSNorm, attention, residual, RMSNorm, gated MLP, residual; the norms
//! before or after each branch), final
//! RMSNorm and the LM head (tied or not). A family describes each layer's
//! attention ([`AttentionSpec`]) and loads a [`Decoder`]; the forward, its
//! tail (final norm, head at the wanted positions) and the weight walk are
//! written once here.
//!
//! Reference implementations: Meta's `llama/model.py`, mlx_lm's
//! `mlx_lm/models/llama.py`, `qwen2.py`, `qwen3.py`. Weight paths are the
//! checkpoint's (`model.layers.{i}.self_attn.q_proj`, ...).

use mlxcel_kv::AttentionKv;
use mlxcel_kv::LayerState;
use mlxcel_mlx::{Array, Dtype};
use mlxcel_model::attention::{Attention, AttentionSpec};
use mlxcel_model::gated_delta::{GatedDeltaNet, GatedDeltaSpec};
use mlxcel_model::layers::{
    with_quantized_matmul, Activation, Embedding, Linear, LoadContext, Mlp, RmsNorm,
};
use mlxcel_model::mamba2::{Mamba2, Mamba2Spec};
use mlxcel_model::moe::{MoeSpec, SparseMoe};
use mlxcel_model::profile::{self, mark};
use mlxcel_model::{
    AttentionPath, LoadOptions, Model, ModelConfig, ModelError, RowInput, Step, StepGraph,
    StepMismatch, StepRow, Weights,
};

/// What a family's decoder is, beyond the shared config.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderSpec {
    /// Each layer's attention, in order (one per `num_hidden_layers`).
    pub layers: Vec<AttentionSpec>,
    /// Embeddings are multiplied by this (Granite's
    /// `embedding_multiplier`); 1 for most families.
    pub embedding_scale: f32,
    /// Each residual branch (attention, MLP) is multiplied by this before
    /// it is added (Granite's `residual_multiplier`); 1 for most families.
    pub residual_scale: f32,
    /// Logits are divided by this (Granite's `logits_scaling`); 1 for most.
    pub logits_divisor: f32,
    /// The MLP's gate and up projections are one fused `gate_up_proj`
    /// (Phi-3).
    pub fused_gate_up: bool,
    /// Where each layer normalizes.
    pub norms: NormPlacement,
    /// Added to every RMSNorm weight at load (layers and final norm): 1
    /// for Gemma's `1 + weight` norms, else 0.
    pub norm_weight_offset: f32,
    /// The MLP gate's activation.
    pub activation: Activation,
    /// The mixture-of-experts layers: which layers are sparse and what
    /// their block is; `None` for a dense model.
    pub moe: Option<SparseLayers>,
    /// The layers whose token mixer is recurrent (Gated DeltaNet, Mamba2)
    /// instead of attention (their [`DecoderSpec::layers`] entry is
    /// unused); `None` for a model of attention layers only.
    pub linear: Option<LinearLayers>,
    /// Granite 4's dense MLP beside the experts: `shared_mlp`, a fused
    /// `input_linear` (gate rows, then up rows, this many each) and
    /// `output_linear`, on every layer; its output is added to the sparse
    /// block's. On a dense layer whose checkpoint names it so (Hugging
    /// Face's), it is the layer's MLP. `None` for other families.
    pub shared_mlp: Option<usize>,
}

/// Which layers of a hybrid decoder mix tokens with a recurrent layer
/// (Qwen3.5: three of every four; Granite 4: most) instead of attention.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearLayers {
    /// The recurrent layer and its sizes.
    pub spec: LinearMixer,
    /// Per layer, whether it is a recurrent layer.
    pub layers: Vec<bool>,
}

/// A hybrid decoder's recurrent token mixer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LinearMixer {
    /// Gated DeltaNet (Qwen3.5), under `linear_attn`.
    GatedDelta(GatedDeltaSpec),
    /// Mamba2 (Granite 4), under `mamba`.
    Mamba2(Mamba2Spec),
}

/// A layer's token mixer.
enum Mixer {
    Attention(Box<Attention>),
    GatedDelta(Box<GatedDeltaNet>),
    Mamba2(Box<Mamba2>),
}

impl Mixer {
    fn forward(
        &self,
        x: &Array,
        index: usize,
        kv: &mut dyn AttentionKv,
        step: &Step,
    ) -> Result<Array, ModelError> {
        match self {
            Mixer::Attention(a) => a.forward(x, index, kv, step),
            Mixer::GatedDelta(g) => g.forward(x, index, kv, step),
            Mixer::Mamba2(m) => m.forward(x, index, kv, step),
        }
    }

    fn arrays(&self) -> Vec<&Array> {
        match self {
            Mixer::Attention(a) => a.arrays(),
            Mixer::GatedDelta(g) => g.arrays(),
            Mixer::Mamba2(m) => m.arrays(),
        }
    }

    fn state(&self) -> LayerState {
        match self {
            Mixer::Attention(a) => LayerState::Attention { window: a.window() },
            Mixer::GatedDelta(g) => LayerState::Recurrent {
                shapes: g.spec().state_shapes(),
            },
            Mixer::Mamba2(m) => LayerState::Recurrent {
                shapes: m.spec().state_shapes(),
            },
        }
    }
}

/// Which layers of a decoder are sparse mixture-of-experts blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseLayers {
    /// The block of every sparse layer.
    pub spec: MoeSpec,
    /// Per layer, whether its feed-forward is the sparse block (the others
    /// keep a dense MLP of `intermediate_size`).
    pub layers: Vec<bool>,
    /// The block's name under the layer (`mlp`; Mixtral's
    /// `block_sparse_moe`).
    pub path: &'static str,
}

/// A layer's feed-forward: a dense gated MLP, a sparse MoE block, or
/// both added (Granite 4's experts and shared MLP).
enum FeedForward {
    Dense(Mlp),
    Sparse(Box<SparseMoe>),
    SparseAndDense(Box<SparseMoe>, Mlp),
}

impl FeedForward {
    fn forward(&self, x: &Array) -> Result<Array, ModelError> {
        match self {
            FeedForward::Dense(m) => m.forward(x),
            FeedForward::Sparse(m) => m.forward(x),
            FeedForward::SparseAndDense(s, d) => Ok(s.forward(x)?.add(&d.forward(x)?)?),
        }
    }

    fn arrays(&self) -> Vec<&Array> {
        match self {
            FeedForward::Dense(m) => m.arrays(),
            FeedForward::Sparse(m) => m.arrays(),
            FeedForward::SparseAndDense(s, d) => {
                let mut v = s.arrays();
                v.extend(d.arrays());
                v
            }
        }
    }
}

/// Where a layer's RMSNorms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormPlacement {
    /// Before attention (`input_layernorm`) and before the MLP
    /// (`post_attention_layernorm`): Llama.
    #[default]
    Pre,
    /// After attention (`post_attention_layernorm`) and after the MLP
    /// (`post_feedforward_layernorm`), on the branch before the residual
    /// add: OLMo 2.
    Post,
    /// Both: `input_layernorm` before attention and
    /// `post_attention_layernorm` after it, `pre_feedforward_layernorm`
    /// before the MLP and `post_feedforward_layernorm` after it: Gemma 2
    /// and 3.
    Sandwich,
}

impl DecoderSpec {
    /// Every layer with `attention`, no multipliers.
    pub fn uniform(attention: AttentionSpec, layers: usize) -> Self {
        DecoderSpec {
            layers: vec![attention; layers],
            embedding_scale: 1.0,
            residual_scale: 1.0,
            logits_divisor: 1.0,
            fused_gate_up: false,
            norms: NormPlacement::Pre,
            norm_weight_offset: 0.0,
            activation: Activation::Silu,
            moe: None,
            linear: None,
            shared_mlp: None,
        }
    }
}

/// `v` as a scalar array of `dtype`, or `None` when it is 1 (no op).
fn factor(v: f32, dtype: Dtype) -> Result<Option<Array>, ModelError> {
    if v == 1.0 {
        return Ok(None);
    }
    Ok(Some(Array::scalar(v)?.astype(dtype)?))
}

/// `x * factor`, or `x` without one.
fn scaled(x: Array, factor: &Option<Array>) -> Result<Array, ModelError> {
    Ok(match factor {
        Some(f) => x.multiply(f)?,
        None => x,
    })
}

/// Granite 4's `{path}.shared_mlp` (see [`DecoderSpec::shared_mlp`]).
fn shared_mlp(ctx: &mut LoadContext<'_>, path: &str, size: usize) -> Result<Mlp, ModelError> {
    Mlp::load_fused_named(
        ctx,
        &format!("{path}.shared_mlp.input_linear"),
        &format!("{path}.shared_mlp.output_linear"),
        false,
        size,
    )
}

/// One transformer layer: attention and MLP, each a residual branch with
/// its norms where [`NormPlacement`] puts them.
struct DecoderLayer {
    /// The norm before attention (pre-norm, sandwich), or after it
    /// (post-norm).
    attn_norm: RmsNorm,
    self_attn: Mixer,
    /// The norm before the MLP (pre-norm, sandwich), or after it
    /// (post-norm).
    mlp_norm: RmsNorm,
    mlp: FeedForward,
    /// Sandwich: the norms after attention and after the MLP.
    post_norms: Option<(RmsNorm, RmsNorm)>,
    norms: NormPlacement,
}

impl DecoderLayer {
    fn load(
        ctx: &mut LoadContext<'_>,
        index: usize,
        c: &ModelConfig,
        attention: &AttentionSpec,
        spec: &DecoderSpec,
    ) -> Result<Self, ModelError> {
        let path = &format!("model.layers.{index}");
        let (attn_norm, mlp_norm) = match spec.norms {
            NormPlacement::Pre => ("input_layernorm", "post_attention_layernorm"),
            NormPlacement::Post => ("post_attention_layernorm", "post_feedforward_layernorm"),
            NormPlacement::Sandwich => ("input_layernorm", "pre_feedforward_layernorm"),
        };
        let norm = |ctx: &mut LoadContext<'_>, name: &str| {
            RmsNorm::load_with_offset(
                ctx,
                &format!("{path}.{name}"),
                c.rms_norm_eps,
                spec.norm_weight_offset,
            )
        };
        Ok(DecoderLayer {
            attn_norm: norm(ctx, attn_norm)?,
            self_attn: match &spec.linear {
                Some(lin) if lin.layers.get(index).copied().unwrap_or(false) => {
                    match &lin.spec {
                        LinearMixer::GatedDelta(g) => Mixer::GatedDelta(Box::new(
                            GatedDeltaNet::load(ctx, &format!("{path}.linear_attn"), g)?,
                        )),
                        LinearMixer::Mamba2(m) => {
                            Mixer::Mamba2(Box::new(Mamba2::load(ctx, &format!("{path}.mamba"), m)?))
                        }
                    }
                }
                _ => Mixer::Attention(Box::new(Attention::load(
                    ctx,
                    &format!("{path}.self_attn"),
                    attention,
                )?)),
            },
            mlp_norm: norm(ctx, mlp_norm)?,
            mlp: match &spec.moe {
                Some(moe) if moe.layers.get(index).copied().unwrap_or(false) => {
                    let sparse = Box::new(SparseMoe::load(
                        ctx,
                        &format!("{path}.{}", moe.path),
                        &moe.spec,
                    )?);
                    match spec.shared_mlp {
                        Some(size) => {
                            FeedForward::SparseAndDense(sparse, shared_mlp(ctx, path, size)?)
                        }
                        None => FeedForward::Sparse(sparse),
                    }
                }
                _ if spec.shared_mlp.is_some()
                    && ctx
                        .weights
                        .contains(&format!("{path}.shared_mlp.input_linear.weight")) =>
                {
                    let size = spec.shared_mlp.unwrap_or(c.intermediate_size);
                    FeedForward::Dense(shared_mlp(ctx, path, size)?)
                }
                _ if spec.fused_gate_up => FeedForward::Dense(
                    Mlp::load_fused(ctx, &format!("{path}.mlp"), c.mlp_bias, c.intermediate_size)?
                        .with_activation(spec.activation),
                ),
                _ => FeedForward::Dense(
                    Mlp::load(ctx, &format!("{path}.mlp"), c.mlp_bias)?
                        .with_activation(spec.activation),
                ),
            },
            post_norms: match spec.norms {
                NormPlacement::Sandwich => Some((
                    norm(ctx, "post_attention_layernorm")?,
                    norm(ctx, "post_feedforward_layernorm")?,
                )),
                NormPlacement::Pre | NormPlacement::Post => None,
            },
            norms: spec.norms,
        })
    }

    fn forward(
        &self,
        x: &Array,
        index: usize,
        kv: &mut dyn AttentionKv,
        step: &Step,
        residual_scale: &Option<Array>,
    ) -> Result<Array, ModelError> {
        let pre = self.norms != NormPlacement::Post;
        // Residual branch `f` around `x`, normalized before or after (or,
        // sandwich, before by `norm` and after by `post`).
        let branch = |x: &Array,
                      norm: &RmsNorm,
                      post: Option<&RmsNorm>,
                      f: &mut dyn FnMut(&Array) -> Result<Array, ModelError>|
         -> Result<Array, ModelError> {
            let mut r = if pre {
                let n = norm.forward(x)?;
                mark("norm", &[&n])?;
                f(&n)?
            } else {
                norm.forward(&f(x)?)?
            };
            if let Some(post) = post {
                r = post.forward(&r)?;
            }
            Ok(x.add(&scaled(r, residual_scale)?)?)
        };
        let (attn_post, mlp_post) = match &self.post_norms {
            Some((a, m)) => (Some(a), Some(m)),
            None => (None, None),
        };
        let h = branch(x, &self.attn_norm, attn_post, &mut |n| {
            self.self_attn.forward(n, index, kv, step)
        })?;
        let out = branch(&h, &self.mlp_norm, mlp_post, &mut |n| self.mlp.forward(n))?;
        mark("mlp", &[&out])?;
        Ok(out)
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.attn_norm.weight, &self.mlp_norm.weight];
        if let Some((a, m)) = &self.post_norms {
            v.extend([&a.weight, &m.weight]);
        }
        v.extend(self.self_attn.arrays());
        v.extend(self.mlp.arrays());
        v
    }
}

/// A decoder-only causal LM.
pub struct Decoder {
    config: ModelConfig,
    dtype: Dtype,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<Linear>,
    /// [`DecoderSpec`]'s multipliers (`None` for 1).
    embedding_scale: Option<Array>,
    residual_scale: Option<Array>,
    /// `1 / logits_divisor`, float32.
    logits_scale: Option<Array>,
}

impl Decoder {
    /// Loads the model `spec` describes from an opened checkpoint and
    /// evaluates its weights, layer by layer.
    ///
    /// # Errors
    /// A spec without one attention per layer, missing tensors, shape
    /// errors.
    pub fn load(
        config: ModelConfig,
        spec: &DecoderSpec,
        weights: &mut Weights,
        options: LoadOptions,
    ) -> Result<Self, ModelError> {
        if let Some(moe) = &spec.moe {
            if moe.layers.len() != config.num_hidden_layers {
                return Err(ModelError::Config(format!(
                    "{} sparse-layer flags for {} layers",
                    moe.layers.len(),
                    config.num_hidden_layers
                )));
            }
        }
        if let Some(lin) = &spec.linear {
            if lin.layers.len() != config.num_hidden_layers {
                return Err(ModelError::Config(format!(
                    "{} linear-attention flags for {} layers",
                    lin.layers.len(),
                    config.num_hidden_layers
                )));
            }
        }
        if spec.layers.len() != config.num_hidden_layers {
            return Err(ModelError::Config(format!(
                "{} attention specs for {} layers",
                spec.layers.len(),
                config.num_hidden_layers
            )));
        }
        if let Some(tp) = config.tensor_parallel {
            tp.check(&config)?;
        }
        let mut ctx = LoadContext {
            weights,
            quantization: &config.quantization,
            dtype: options.dtype,
            mode: options.weight_mode,
            shard: config.tensor_parallel,
        };
        let embed_tokens = Embedding::load(&mut ctx, "model.embed_tokens")?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let layer = DecoderLayer::load(&mut ctx, i, &config, &spec.layers[i], spec)?;
            // Materialize layer by layer so load shows progress and peaks low.
            mlxcel_mlx::eval(&layer.arrays())?;
            // Drawn as a bar by the binaries (see `src/progress.rs`).
            tracing::debug!(
                target: "mlxcel::progress",
                stage = "loading weights",
                done = i + 1,
                total = config.num_hidden_layers + 1
            );
            layers.push(layer);
        }
        let norm = RmsNorm::load_with_offset(
            &mut ctx,
            "model.norm",
            config.rms_norm_eps,
            spec.norm_weight_offset,
        )?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(Linear::load(&mut ctx, "lm_head", false)?)
        };
        let mut rest: Vec<&Array> = embed_tokens.table.arrays();
        rest.push(&norm.weight);
        if let Some(h) = &lm_head {
            rest.extend(h.arrays());
        }
        mlxcel_mlx::eval(&rest)?;
        // The embedding, final norm and head: the last step of the bar.
        tracing::debug!(
            target: "mlxcel::progress",
            stage = "loading weights",
            done = config.num_hidden_layers + 1,
            total = config.num_hidden_layers + 1
        );
        let unused: Vec<String> = weights
            .remaining()
            .into_iter()
            .filter(|n| !n.contains("rotary_emb.inv_freq"))
            .collect();
        if !unused.is_empty() {
            tracing::warn!(count = unused.len(), first = %unused[0], "unused tensors in checkpoint");
        }
        Ok(Decoder {
            embedding_scale: factor(spec.embedding_scale, options.dtype)?,
            residual_scale: factor(spec.residual_scale, options.dtype)?,
            logits_scale: factor(1.0 / spec.logits_divisor, Dtype::Float32)?,
            dtype: options.dtype,
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }
}

impl Decoder {
    /// The step's input hidden states `[1, tokens, hidden]`: token rows
    /// through the (scaled) token embedding, embedding rows as given.
    /// `ids` (pipelined decode) replaces every row's host tokens.
    fn embed_rows(
        &self,
        rows: &[StepRow<'_>],
        ids: Option<&Array>,
        step: &Step,
    ) -> Result<Array, ModelError> {
        let embed = |ids: &Array| -> Result<Array, ModelError> {
            scaled(self.embed_tokens.forward(ids)?, &self.embedding_scale)
        };
        if let Some(ids) = ids {
            return embed(&ids.reshape(&[1, step.tokens as i32])?);
        }
        if Step::all_tokens(rows) {
            let tokens: Vec<u32> = rows
                .iter()
                .flat_map(|r| match r.input {
                    RowInput::Tokens(t) => t.iter().copied(),
                    RowInput::Embeddings(_) => [].iter().copied(),
                })
                .collect();
            return embed(&Array::from_u32(&tokens, &[1, step.tokens as i32])?);
        }
        let hidden = self.config.hidden_size;
        let mut parts = Vec::with_capacity(rows.len());
        for (r, row) in rows.iter().enumerate() {
            let part = match row.input {
                RowInput::Tokens(t) => embed(&Array::from_u32(t, &[1, t.len() as i32])?)?,
                RowInput::Embeddings(e) => {
                    let shape = e.shape();
                    if shape.len() != 2 || shape[1] as usize != hidden {
                        return Err(StepMismatch::Embeddings {
                            row: r,
                            shape,
                            hidden,
                        }
                        .into());
                    }
                    e.astype(self.dtype)?.reshape(&[1, shape[0], shape[1]])?
                }
            };
            parts.push(part);
        }
        let parts: Vec<&Array> = parts.iter().collect();
        Ok(mlxcel_mlx::concatenate(&parts, 1)?)
    }
}

impl Model for Decoder {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn layer_windows(&self) -> Vec<Option<usize>> {
        self.layers
            .iter()
            .map(|l| l.self_attn.state().window())
            .collect()
    }

    fn layer_states(&self) -> Vec<LayerState> {
        self.layers.iter().map(|l| l.self_attn.state()).collect()
    }

    fn embed_tokens(&self, ids: &[u32]) -> Result<Array, ModelError> {
        let vocab = self.config.vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(StepMismatch::TokenOutOfRange { id, vocab }.into());
        }
        let ids = Array::from_u32(ids, &[ids.len() as i32])?;
        scaled(self.embed_tokens.forward(&ids)?, &self.embedding_scale)
    }

    fn build_step(
        &self,
        rows: &[StepRow<'_>],
        ids: Option<&Array>,
        kv: &mut dyn AttentionKv,
        path: AttentionPath,
    ) -> Result<StepGraph, ModelError> {
        let built = std::time::Instant::now();
        profile::restart_clock();
        let step = Step::new(rows, kv, path)?;
        let mut h = self.embed_rows(rows, ids, &step)?;
        mark("embed", &[&h, &step.positions])?;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h, i, kv, &step, &self.residual_scale)?;
        }
        // Only the wanted positions go through the final norm (and the
        // head, for logits).
        let hidden = self.final_hidden(&h, &step.hidden_indices(rows))?;
        let wanted = step.logit_indices(rows);
        if wanted.is_empty() {
            // Nothing samples (a prefill chunk before the last, an
            // embedding row): the graph is the cache's writes (and any
            // hidden states) alone.
            let logits = mlxcel_mlx::zeros(&[0, self.config.vocab_size as i32], Dtype::Float32)?;
            return Ok(StepGraph { logits, hidden });
        }
        let idx = Array::from_i32(&wanted, &[wanted.len() as i32])?;
        let last = self.norm.forward(&h.take(&idx, 1)?)?;
        let logits = with_quantized_matmul(|| match &self.lm_head {
            Some(head) => head.forward(&last),
            None => self.embed_tokens.as_linear(&last),
        })?;
        let logits = logits
            .reshape(&[wanted.len() as i32, -1])?
            .astype(Dtype::Float32)?;
        let logits = scaled(logits, &self.logits_scale)?;
        mark("head", &[&logits])?;
        if profile::mode() == profile::ProfileMode::Steps {
            profile::record("model.build", built);
        }
        Ok(StepGraph { logits, hidden })
    }
}

impl Decoder {
    /// The final hidden states (after the final norm) of the packed
    /// positions `idx` of the last layer's output `h` `[1, tokens,
    /// hidden]`: float32 `[idx.len(), hidden]`, `None` for no position.
    fn final_hidden(&self, h: &Array, idx: &[i32]) -> Result<Option<Array>, ModelError> {
        if idx.is_empty() {
            return Ok(None);
        }
        let at = Array::from_i32(idx, &[idx.len() as i32])?;
        let normed = self.norm.forward(&h.take(&at, 1)?)?;
        Ok(Some(
            normed
                .reshape(&[idx.len() as i32, -1])?
                .astype(Dtype::Float32)?,
        ))
    }
}
