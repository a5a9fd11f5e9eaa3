//! Gemma 4 (text; `model_type` `gemma4_text`, and `gemma4` whose text
//! model's keys sit under `text_config` and weights under
//! `language_model.`). Reference: mlx_lm's `models/gemma4_text.py` and
//! `gemma4.py`, and Google DeepMind's Gemma 4 report.
//!
//! - Layers are sliding (window of `sliding_window` keys, heads of
//!   `head_dim`, `rope_parameters.sliding_attention`) or full (heads of
//!   `global_head_dim`, `rope_parameters.full_attention`, proportional RoPE:
//!   the first `partial_rotary_factor` of each head's frequencies turn, at
//!   periods `base^(2i / head)`, the rest do not), as `layer_types` lists
//!   them or every `sliding_window_pattern`-th layer full.
//! - Queries and keys get a per-head RMSNorm, values one without scale;
//!   attention scores are not scaled (scale 1). Norms scale by `weight`.
//! - KV sharing: the last `num_kv_shared_layers` layers have no k/v
//!   projections and attend over the K/V of the last earlier layer of their
//!   kind (`mlxcel_kv::LayerState::SharedAttention`: the KV cache maps them
//!   to that layer's storage); with `use_double_wide_mlp` their MLP is
//!   twice `intermediate_size`.
//! - Per-layer inputs (`hidden_size_per_layer_input` features per layer):
//!   a second embedding of the tokens (`embed_tokens_per_layer`, times
//!   `sqrt(per-layer size)`) plus a projection of the scaled embedding
//!   (`per_layer_model_projection`, times `hidden^-0.5`, then RMSNorm),
//!   both times `2^-0.5`; each layer, after its MLP, adds
//!   `norm(project(gelu(gate(h)) * input))`.
//! - Sandwich norms around attention and the GeGLU MLP; each layer's output
//!   times its `layer_scalar`; embeddings times `sqrt(hidden_size)`; the
//!   head tied unless the checkpoint has `lm_head`; logits soft-capped:
//!   `cap * tanh(logits / cap)` (`final_logit_softcapping`).
//!
//! The KV cache has one layout: full and sliding layers of different head
//! sizes store their K/V at the larger one, zero-padded
//! (`AttentionSpec::stored_head_dim`), and with the most K/V heads, the
//! others repeated (`AttentionSpec::stored_kv_heads`): E2B's sliding
//! layers (256-wide heads) store 512 features per head, and heads wider
//! than 256 decode through the gathered path, not the paged kernel.
//!
//! - K-equals-V (`attention_k_eq_v`, the 26B and 31B models): full layers
//!   have no v projection (values are the key projection, before its norm
//!   and RoPE) and `num_global_key_value_heads` K/V heads.
//! - Mixture of experts (`enable_moe_block`, the 26B model): beside each
//!   layer's MLP a sparse block (`Experts`); mlx_lm's checkpoint layout
//!   (`experts.switch_glu.*`); Hugging Face's fused `experts.gate_up_proj`
//!   needs `mlx_lm.convert` first.
//!
//! Not served: rows given as embeddings (the per-layer inputs need token
//! ids), tensor parallelism.

use serde::Deserialize;
use serde_json::Value as Json;

use mlxcel_kv::{AttentionKv, KvLayout, LayerState};
use mlxcel_mlx::{Array, Dtype};
use mlxcel_model::attention::{Attention, AttentionSpec, QkNorm};
use mlxcel_model::config::RopeScaling;
use mlxcel_model::layers::{
    with_quantized_matmul, Activation, Embedding, Linear, LoadContext, Mlp, RmsNorm,
};
use mlxcel_model::moe::{ExpertGlu, ExpertLayout, ExpertNames, MoeSpec, Routing, SparseMoe};
use mlxcel_model::profile::mark;
use mlxcel_model::rope::RopeSpec;
use mlxcel_model::{
    AttentionPath, LoadOptions, Model, ModelConfig, ModelError, RowInput, Step, StepGraph, StepRow,
    Weights,
};

use crate::Family;

pub const FAMILY: Family = Family {
    name: "gemma4",
    model_types: &["gemma4", "gemma4_text"],
    configure,
    load,
    gguf: &[],
};

/// Gemma 4's own `config.json` keys (defaults: mlx_lm's).
#[derive(Debug, Deserialize)]
struct Gemma4Keys {
    /// Absent: 512; `null` or 0: `head_dim` (as mlx_lm reads it).
    #[serde(default = "default_global_head_dim")]
    global_head_dim: Option<usize>,
    #[serde(default = "default_window")]
    sliding_window: usize,
    #[serde(default = "default_pattern")]
    sliding_window_pattern: usize,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default = "default_shared")]
    num_kv_shared_layers: usize,
    #[serde(default = "default_per_layer")]
    hidden_size_per_layer_input: usize,
    #[serde(default)]
    vocab_size_per_layer_input: Option<usize>,
    #[serde(default = "default_softcap")]
    final_logit_softcapping: Option<f32>,
    #[serde(default = "yes")]
    use_double_wide_mlp: bool,
    #[serde(default)]
    rope_parameters: Option<Json>,
    #[serde(default)]
    attention_k_eq_v: bool,
    #[serde(default)]
    num_global_key_value_heads: Option<usize>,
    #[serde(default)]
    enable_moe_block: bool,
    #[serde(default)]
    num_experts: Option<usize>,
    #[serde(default)]
    top_k_experts: Option<usize>,
    #[serde(default)]
    moe_intermediate_size: Option<usize>,
}

fn default_global_head_dim() -> Option<usize> {
    Some(512)
}
fn default_window() -> usize {
    512
}
fn default_pattern() -> usize {
    5
}
fn default_shared() -> usize {
    20
}
fn default_per_layer() -> usize {
    256
}
fn default_softcap() -> Option<f32> {
    Some(30.0)
}
fn yes() -> bool {
    true
}

/// One kind of layer's RoPE (`rope_parameters.{kind}`).
#[derive(Debug, Default, Deserialize)]
struct RopeParams {
    #[serde(default)]
    rope_theta: Option<f32>,
    #[serde(default)]
    rope_type: Option<String>,
    #[serde(default)]
    partial_rotary_factor: Option<f32>,
    #[serde(default)]
    factor: Option<f32>,
}

/// The windows are per layer; checks the keys and what is not served.
fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    let keys: Gemma4Keys = crate::own_keys(config)?;
    if keys.enable_moe_block {
        moe_spec(&keys)?.check()?;
    }
    if keys.sliding_window == 0 {
        return Err(ModelError::Config("gemma4: sliding_window is 0".into()));
    }
    crate::sliding_layers(
        keys.layer_types.as_deref(),
        config.num_hidden_layers,
        keys.sliding_window_pattern,
    )?;
    config.sliding_window = None;
    Ok(())
}

/// The sparse block of an `enable_moe_block` model: `num_experts` experts
/// of `moe_intermediate_size`, `top_k_experts` per token (top-k router
/// logits, then softmax), GeGLU; the router at `router.proj`, the stacked
/// experts at `experts.switch_glu` (mlx_lm's names).
fn moe_spec(keys: &Gemma4Keys) -> Result<MoeSpec, ModelError> {
    let need = |v: Option<usize>, field: &str| {
        v.ok_or_else(|| ModelError::Config(format!("gemma4: enable_moe_block without {field}")))
    };
    Ok(MoeSpec {
        experts: need(keys.num_experts, "num_experts")?,
        top_k: need(keys.top_k_experts, "top_k_experts")?,
        expert_hidden: need(keys.moe_intermediate_size, "moe_intermediate_size")?,
        routing: Routing::TopKSoftmax,
        per_expert_names: ExpertNames::PROJ,
        shared_expert: None,
        activation: Activation::GeluTanh,
        glu: ExpertGlu::Gated,
        layout: ExpertLayout {
            router: "router.proj",
            router_bias: false,
            stacked: "experts.switch_glu",
            bias: false,
        },
    })
}

/// The RoPE of `kind` (`sliding_attention`, `full_attention`) for heads of
/// `head_dim`, as mlx_lm's `initialize_rope` reads `rope_parameters`
/// (mlx_lm's defaults when the config has none).
fn rope(
    keys: &Gemma4Keys,
    kind: &str,
    head_dim: usize,
    traditional: bool,
) -> Result<RopeSpec, ModelError> {
    let params: RopeParams = match &keys.rope_parameters {
        None if kind == "full_attention" => RopeParams {
            rope_theta: Some(1_000_000.0),
            rope_type: Some("proportional".into()),
            partial_rotary_factor: Some(0.25),
            factor: None,
        },
        None => RopeParams::default(),
        Some(p) => match p.get(kind) {
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|e| ModelError::Config(format!("rope_parameters.{kind}: {e}")))?,
            None => RopeParams::default(),
        },
    };
    let base = params.rope_theta.unwrap_or(10_000.0);
    let scaling = match params.rope_type.as_deref().unwrap_or("default") {
        "default" => RopeScaling::None,
        "proportional" => {
            // mx.fast.rope's periods: base^(2i / head) times the factor for
            // the rotated pairs; infinite (no turn) for the rest.
            let rotated = (head_dim as f32 * params.partial_rotary_factor.unwrap_or(1.0)) as usize;
            if rotated > head_dim {
                return Err(ModelError::Config(format!(
                    "rope_parameters.{kind}: {rotated} rotated features of {head_dim}"
                )));
            }
            let factor = params.factor.unwrap_or(1.0);
            // mlx_lm's pairs: `arange(0, rotated, 2)` turn.
            let mut divisors = vec![factor; rotated.div_ceil(2)];
            divisors.resize(head_dim / 2, f32::INFINITY);
            RopeScaling::Divisors(divisors)
        }
        other => {
            return Err(ModelError::Unsupported(format!(
                "gemma4: rope_parameters.{kind}.rope_type {other:?}"
            )))
        }
    };
    Ok(RopeSpec {
        dims: head_dim,
        base,
        traditional,
        scaling,
    })
}

/// mlx_lm's reading of a checkpoint's tensor names: the text model under
/// `model.`, its head `lm_head`; vision and audio towers dropped.
fn text_model_name(name: &str) -> Option<String> {
    let bare = name.strip_prefix("model.").unwrap_or(name);
    let towers = [
        "vision_tower",
        "multi_modal_projector",
        "audio_tower",
        "embed_audio",
        "embed_vision",
        "vision_embedder",
    ];
    if towers.iter().any(|t| bare.starts_with(t)) || name.contains("self_attn.rotary_emb") {
        return None;
    }
    Some(crate::text_model_path(name))
}

/// Rows of tensor `name` (its first axis), which must be `want`, or a
/// config error naming `field`.
fn check_rows(
    weights: &mut Weights,
    name: &str,
    want: usize,
    field: &str,
) -> Result<(), ModelError> {
    let rows = weights.shape(name)?.first().copied().unwrap_or(0);
    if rows as usize != want {
        return Err(ModelError::Config(format!(
            "gemma4: {name} has {rows} rows, {field} gives {want}"
        )));
    }
    Ok(())
}

fn load(
    mut config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    if options.dtype == Dtype::Float16 {
        return Err(ModelError::Config(
            "gemma4: float16 overflows its residual stream; use bfloat16 or float32".into(),
        ));
    }
    if config.tensor_parallel.is_some() {
        return Err(ModelError::Unsupported(
            "gemma4 under tensor parallelism".into(),
        ));
    }
    let keys: Gemma4Keys = crate::own_keys(&config)?;
    let n = config.num_hidden_layers;
    let sliding =
        crate::sliding_layers(keys.layer_types.as_deref(), n, keys.sliding_window_pattern)?;
    weights.rename(text_model_name);
    config.tie_word_embeddings = !weights.contains("lm_head.weight");
    // KV sharing: layer j >= first reads the last layer before `first` of
    // its kind.
    let first_shared = n.checked_sub(keys.num_kv_shared_layers).ok_or_else(|| {
        ModelError::Config(format!(
            "gemma4: num_kv_shared_layers {} of {n} layers",
            keys.num_kv_shared_layers
        ))
    })?;
    let source = |j: usize| -> Result<Option<usize>, ModelError> {
        if j < first_shared {
            return Ok(None);
        }
        (0..first_shared)
            .rev()
            .find(|&i| sliding[i] == sliding[j])
            .map(Some)
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "gemma4: num_kv_shared_layers {}: layer {j} has no earlier layer of its \
                     kind to share",
                    keys.num_kv_shared_layers
                ))
            })
    };
    let sources = (0..n).map(source).collect::<Result<Vec<_>, _>>()?;
    // Shared layers drop any k/v tensors (as mlx_lm's sanitize does).
    weights.rename(|name| {
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        let kv = [
            ".self_attn.k_proj",
            ".self_attn.v_proj",
            ".self_attn.k_norm",
        ];
        match layer {
            Some(l) if l >= first_shared && kv.iter().any(|k| name.contains(k)) => None,
            _ => Some(name.to_string()),
        }
    });
    let global_dim = keys
        .global_head_dim
        .filter(|&d| d > 0)
        .unwrap_or(config.head_dim);
    let stored = global_dim.max(config.head_dim);
    // K-equals-V full layers have their own K/V head count; the cache
    // stores the most, the others repeated.
    let global_kv_heads = match keys.num_global_key_value_heads {
        Some(h) if keys.attention_k_eq_v => h,
        _ => config.num_key_value_heads,
    };
    let stored_kv = global_kv_heads.max(config.num_key_value_heads);
    let moe = if keys.enable_moe_block {
        Some(moe_spec(&keys)?)
    } else {
        None
    };
    let traditional = config.rope_traditional;
    let sliding_rope = rope(&keys, "sliding_attention", config.head_dim, traditional)?;
    let full_rope = rope(&keys, "full_attention", global_dim, traditional)?;
    let mut layers = Vec::with_capacity(n);
    let per_layer = keys.hidden_size_per_layer_input;
    // Flags that would leave a part of the checkpoint unused, or expect
    // one it lacks.
    let has_tables = weights.contains("model.embed_tokens_per_layer.weight");
    if (per_layer > 0) != has_tables {
        return Err(ModelError::Config(format!(
            "gemma4: hidden_size_per_layer_input {per_layer} (mlx_lm's default 256 when \
             absent) but the checkpoint {} embed_tokens_per_layer",
            if has_tables { "has" } else { "has no" }
        )));
    }
    let has_router = weights.contains("model.layers.0.router.proj.weight");
    if keys.enable_moe_block != has_router {
        return Err(ModelError::Config(format!(
            "gemma4: enable_moe_block {} but the checkpoint {} model.layers.0.router",
            keys.enable_moe_block,
            if has_router { "has" } else { "has no" }
        )));
    }
    let mut ctx = LoadContext {
        weights,
        quantization: &config.quantization,
        dtype: options.dtype,
        mode: options.weight_mode,
        shard: None,
    };
    for (i, &is_sliding) in sliding.iter().enumerate() {
        let path = format!("model.layers.{i}");
        let src = sources[i];
        let head_dim = if is_sliding {
            config.head_dim
        } else {
            global_dim
        };
        let spec = AttentionSpec {
            head_dim,
            qk_norm: Some(QkNorm {
                eps: config.rms_norm_eps,
                per_head: true,
                weight_offset: 0.0,
            }),
            rope: if is_sliding {
                sliding_rope.clone()
            } else {
                full_rope.clone()
            },
            window: is_sliding.then_some(keys.sliding_window),
            scale: 1.0,
            v_norm: true,
            shared_kv: src.is_some(),
            stored_head_dim: Some(stored),
            kv_heads: if is_sliding {
                config.num_key_value_heads
            } else {
                global_kv_heads
            },
            stored_kv_heads: Some(stored_kv),
            values_from_keys: keys.attention_k_eq_v && !is_sliding,
            ..AttentionSpec::from_config(&config)
        };
        let attn = format!("{path}.self_attn");
        let head_field = if is_sliding {
            "head_dim"
        } else {
            "global_head_dim"
        };
        check_rows(
            ctx.weights,
            &format!("{attn}.q_proj.weight"),
            spec.heads * head_dim,
            &format!("num_attention_heads x {head_field}"),
        )?;
        if src.is_none() && !ctx.weights.contains(&format!("{attn}.k_proj.weight")) {
            return Err(ModelError::Config(format!(
                "gemma4: num_kv_shared_layers {}: layer {i} keeps its own K/V but the \
                 checkpoint has no {attn}.k_proj",
                keys.num_kv_shared_layers
            )));
        }
        let has_v = ctx.weights.contains(&format!("{attn}.v_proj.weight"));
        if src.is_none() && has_v == spec.values_from_keys {
            return Err(ModelError::Config(format!(
                "gemma4: attention_k_eq_v {}: layer {i} ({}) {} {attn}.v_proj",
                keys.attention_k_eq_v,
                if is_sliding { "sliding" } else { "full" },
                if has_v { "has" } else { "has no" },
            )));
        }
        let wide = keys.use_double_wide_mlp && src.is_some() && first_shared > 0;
        let intermediate = config.intermediate_size * if wide { 2 } else { 1 };
        check_rows(
            ctx.weights,
            &format!("{path}.mlp.gate_proj.weight"),
            intermediate,
            if wide {
                "2 x intermediate_size (use_double_wide_mlp, a KV-shared layer)"
            } else {
                "intermediate_size"
            },
        )?;
        let layer = Layer::load(&mut ctx, &path, &config, &spec, per_layer > 0, moe.as_ref())?;
        mlxcel_mlx::eval(&layer.arrays())?;
        tracing::debug!(
            target: "mlxcel::progress",
            stage = "loading weights",
            done = i + 1,
            total = n + 1
        );
        let window = spec.window;
        layers.push((
            layer,
            match src {
                Some(source) => LayerState::SharedAttention { source, window },
                None => LayerState::Attention { window },
            },
        ));
    }
    let per_layer_inputs = if per_layer > 0 {
        let vocab = keys.vocab_size_per_layer_input.unwrap_or(config.vocab_size);
        check_rows(
            ctx.weights,
            "model.embed_tokens_per_layer.weight",
            vocab,
            "vocab_size_per_layer_input",
        )?;
        check_rows(
            ctx.weights,
            "model.per_layer_model_projection.weight",
            n * per_layer,
            "num_hidden_layers x hidden_size_per_layer_input",
        )?;
        Some(PerLayerInputs::load(&mut ctx, &config, per_layer, vocab)?)
    } else {
        None
    };
    let embed_tokens = Embedding::load(&mut ctx, "model.embed_tokens")?;
    let norm = RmsNorm::load(&mut ctx, "model.norm", config.rms_norm_eps)?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(Linear::load(&mut ctx, "lm_head", false)?)
    };
    let mut rest: Vec<&Array> = embed_tokens.table.arrays();
    rest.push(&norm.weight);
    if let Some(p) = &per_layer_inputs {
        rest.extend(p.arrays());
    }
    if let Some(h) = &lm_head {
        rest.extend(h.arrays());
    }
    mlxcel_mlx::eval(&rest)?;
    let unused = ctx.weights.remaining();
    if !unused.is_empty() {
        tracing::warn!(count = unused.len(), first = %unused[0], "unused tensors in checkpoint");
    }
    let scalar =
        |v: f32| -> Result<Array, ModelError> { Ok(Array::scalar(v)?.astype(options.dtype)?) };
    Ok(Box::new(Gemma4 {
        embed_scale: scalar((config.hidden_size as f32).sqrt())?,
        softcap: keys.final_logit_softcapping.filter(|&c| c > 0.0),
        kv_layout: KvLayout {
            layers: n,
            kv_heads: stored_kv,
            head_dim: stored,
            dtype: options.dtype,
            kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
        },
        dtype: options.dtype,
        config,
        embed_tokens,
        per_layer_inputs,
        layers,
        norm,
        lm_head,
    }))
}

/// The per-layer inputs' tables and projection (see the module docs).
struct PerLayerInputs {
    /// `[vocab_per_layer, layers * size]`.
    embed: Embedding,
    /// `sqrt(size)`, in the compute dtype.
    embed_scale: Array,
    /// `[hidden] -> [layers * size]`.
    projection: Linear,
    /// `hidden^-0.5`.
    projection_scale: Array,
    /// RMSNorm over each layer's `size` features.
    projection_norm: RmsNorm,
    /// `2^-0.5`.
    sum_scale: Array,
    /// Features per layer.
    size: usize,
    /// Rows of `embed`.
    vocab: usize,
}

impl PerLayerInputs {
    fn load(
        ctx: &mut LoadContext<'_>,
        c: &ModelConfig,
        size: usize,
        vocab: usize,
    ) -> Result<Self, ModelError> {
        let scalar =
            |v: f32| -> Result<Array, ModelError> { Ok(Array::scalar(v)?.astype(ctx.dtype)?) };
        Ok(PerLayerInputs {
            embed_scale: scalar((size as f32).sqrt())?,
            projection_scale: scalar((c.hidden_size as f32).powf(-0.5))?,
            sum_scale: scalar(0.5f32.sqrt())?,
            embed: Embedding::load(ctx, "model.embed_tokens_per_layer")?,
            projection: Linear::load(ctx, "model.per_layer_model_projection", false)?,
            projection_norm: RmsNorm::load(ctx, "model.per_layer_projection_norm", c.rms_norm_eps)?,
            size,
            vocab,
        })
    }

    /// Every layer's input `[1, tokens, layers, size]` for token `ids`
    /// `[1, tokens]` whose scaled embeddings are `h` `[1, tokens, hidden]`.
    fn forward(&self, ids: &Array, h: &Array, layers: usize) -> Result<Array, ModelError> {
        let t = h.dim(1)?;
        let shape = [1, t, layers as i32, self.size as i32];
        let from_ids = self
            .embed
            .forward(ids)?
            .multiply(&self.embed_scale)?
            .reshape(&shape)?;
        let projected = self
            .projection
            .forward(h)?
            .multiply(&self.projection_scale)?
            .reshape(&shape)?;
        let projected = self.projection_norm.forward(&projected)?;
        Ok(projected.add(&from_ids)?.multiply(&self.sum_scale)?)
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut v = self.embed.table.arrays();
        v.extend(self.projection.arrays());
        v.push(&self.projection_norm.weight);
        v
    }
}

/// One Gemma 4 layer (see the module docs).
struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    pre_mlp_norm: RmsNorm,
    mlp: Mlp,
    post_mlp_norm: RmsNorm,
    /// `per_layer_input_gate` `[hidden] -> [size]`, `per_layer_projection`
    /// `[size] -> [hidden]`, `post_per_layer_input_norm`.
    per_layer: Option<(Linear, Linear, RmsNorm)>,
    /// `layer_scalar` `[1]`.
    scalar: Array,
    /// The sparse block beside the MLP (`enable_moe_block`).
    moe: Option<Box<Experts>>,
}

/// Gemma 4's sparse block: routed from the residual stream (RMSNorm by
/// `router.scale * hidden^-0.5`), the experts on `pre_feedforward_layernorm_2`
/// of it, each chosen expert's weight times `router.per_expert_scale`; its
/// output (after `post_feedforward_layernorm_2`) adds to the MLP's (after
/// `post_feedforward_layernorm_1`).
struct Experts {
    block: SparseMoe,
    /// `router.scale * hidden^-0.5` `[hidden]`.
    router_scale: Array,
    /// `router.per_expert_scale` `[experts]`.
    expert_scale: Array,
    eps: f32,
    pre_norm: RmsNorm,
    post_mlp_norm: RmsNorm,
    post_norm: RmsNorm,
}

impl Experts {
    fn load(
        ctx: &mut LoadContext<'_>,
        path: &str,
        c: &ModelConfig,
        spec: &MoeSpec,
    ) -> Result<Self, ModelError> {
        if ctx
            .weights
            .contains(&format!("{path}.experts.gate_up_proj"))
        {
            return Err(ModelError::Unsupported(format!(
                "gemma4: fused {path}.experts.gate_up_proj (Hugging Face's layout); \
                 convert the checkpoint with mlx_lm first"
            )));
        }
        let eps = c.rms_norm_eps;
        let norm = |ctx: &mut LoadContext<'_>, name: &str| {
            RmsNorm::load(ctx, &format!("{path}.{name}"), eps)
        };
        let root = Array::scalar((c.hidden_size as f32).powf(-0.5))?.astype(ctx.dtype)?;
        Ok(Experts {
            block: SparseMoe::load(ctx, path, spec)?,
            router_scale: ctx
                .float(&format!("{path}.router.scale"))?
                .multiply(&root)?,
            expert_scale: ctx.float(&format!("{path}.router.per_expert_scale"))?,
            eps,
            pre_norm: norm(ctx, "pre_feedforward_layernorm_2")?,
            post_mlp_norm: norm(ctx, "post_feedforward_layernorm_1")?,
            post_norm: norm(ctx, "post_feedforward_layernorm_2")?,
        })
    }

    /// The MLP's output `mlp` `[1, tokens, hidden]` and the sparse block's
    /// of `h`, summed.
    fn forward(&self, h: &Array, mlp: &Array) -> Result<Array, ModelError> {
        let logits = self
            .block
            .router_logits(&h.rms_norm(&self.router_scale, self.eps)?)?;
        let x = self.pre_norm.forward(h)?;
        let e = self
            .block
            .forward_routed(&x, &logits, Some(&self.expert_scale))?;
        Ok(self
            .post_mlp_norm
            .forward(mlp)?
            .add(&self.post_norm.forward(&e)?)?)
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut v = self.block.arrays();
        v.extend([
            &self.router_scale,
            &self.expert_scale,
            &self.pre_norm.weight,
            &self.post_mlp_norm.weight,
            &self.post_norm.weight,
        ]);
        v
    }
}

impl Layer {
    fn load(
        ctx: &mut LoadContext<'_>,
        path: &str,
        c: &ModelConfig,
        spec: &AttentionSpec,
        per_layer: bool,
        moe: Option<&MoeSpec>,
    ) -> Result<Self, ModelError> {
        let eps = c.rms_norm_eps;
        let norm = |ctx: &mut LoadContext<'_>, name: &str| {
            RmsNorm::load(ctx, &format!("{path}.{name}"), eps)
        };
        Ok(Layer {
            input_norm: norm(ctx, "input_layernorm")?,
            attn: Attention::load(ctx, &format!("{path}.self_attn"), spec)?,
            post_attn_norm: norm(ctx, "post_attention_layernorm")?,
            pre_mlp_norm: norm(ctx, "pre_feedforward_layernorm")?,
            mlp: Mlp::load(ctx, &format!("{path}.mlp"), false)?
                .with_activation(Activation::GeluTanh),
            post_mlp_norm: norm(ctx, "post_feedforward_layernorm")?,
            per_layer: if per_layer {
                Some((
                    Linear::load(ctx, &format!("{path}.per_layer_input_gate"), false)?,
                    Linear::load(ctx, &format!("{path}.per_layer_projection"), false)?,
                    norm(ctx, "post_per_layer_input_norm")?,
                ))
            } else {
                None
            },
            scalar: ctx.float(&format!("{path}.layer_scalar"))?,
            moe: match moe {
                Some(spec) => Some(Box::new(Experts::load(ctx, path, c, spec)?)),
                None => None,
            },
        })
    }

    /// `x` `[1, tokens, hidden]` -> the same; `input` this layer's per-layer
    /// input `[1, tokens, size]`.
    fn forward(
        &self,
        x: &Array,
        input: Option<&Array>,
        index: usize,
        kv: &mut dyn AttentionKv,
        step: &Step,
    ) -> Result<Array, ModelError> {
        let a = self
            .attn
            .forward(&self.input_norm.forward(x)?, index, kv, step)?;
        let h = x.add(&self.post_attn_norm.forward(&a)?)?;
        let mut m = self.mlp.forward(&self.pre_mlp_norm.forward(&h)?)?;
        if let Some(moe) = &self.moe {
            m = moe.forward(&h, &m)?;
        }
        let mut h = h.add(&self.post_mlp_norm.forward(&m)?)?;
        if let (Some((gate, proj, norm)), Some(input)) = (&self.per_layer, input) {
            let g = gate.forward(&h)?.gelu_tanh()?.multiply(input)?;
            h = h.add(&norm.forward(&proj.forward(&g)?)?)?;
        }
        mark("mlp", &[&h])?;
        Ok(h.multiply(&self.scalar)?)
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![
            &self.input_norm.weight,
            &self.post_attn_norm.weight,
            &self.pre_mlp_norm.weight,
            &self.post_mlp_norm.weight,
            &self.scalar,
        ];
        v.extend(self.attn.arrays());
        v.extend(self.mlp.arrays());
        if let Some((g, p, n)) = &self.per_layer {
            v.extend(g.arrays());
            v.extend(p.arrays());
            v.push(&n.weight);
        }
        if let Some(moe) = &self.moe {
            v.extend(moe.arrays());
        }
        v
    }
}

/// A Gemma 4 text model.
struct Gemma4 {
    config: ModelConfig,
    dtype: Dtype,
    kv_layout: KvLayout,
    embed_tokens: Embedding,
    /// `sqrt(hidden_size)`, in the compute dtype.
    embed_scale: Array,
    per_layer_inputs: Option<PerLayerInputs>,
    /// Each layer and what it keeps in the KV cache.
    layers: Vec<(Layer, LayerState)>,
    norm: RmsNorm,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<Linear>,
    /// `final_logit_softcapping`.
    softcap: Option<f32>,
}

impl Gemma4 {
    /// The step's token ids `[1, tokens]`: `ids` when given, else the
    /// rows' tokens (rows of embeddings are refused: the per-layer inputs
    /// need ids).
    fn step_ids(
        &self,
        rows: &[StepRow<'_>],
        ids: Option<&Array>,
        step: &Step,
    ) -> Result<Array, ModelError> {
        if let Some(ids) = ids {
            return Ok(ids.reshape(&[1, step.tokens as i32])?);
        }
        let mut tokens = Vec::with_capacity(step.tokens);
        for row in rows {
            match row.input {
                RowInput::Tokens(t) => tokens.extend_from_slice(t),
                RowInput::Embeddings(_) => {
                    return Err(ModelError::Unsupported(
                        "gemma4: rows of embeddings (its per-layer inputs need token ids)".into(),
                    ))
                }
            }
        }
        let vocab = self.config.vocab_size;
        let limit = self
            .per_layer_inputs
            .as_ref()
            .map_or(vocab, |p| p.vocab.min(vocab));
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= limit) {
            return Err(mlxcel_model::StepMismatch::TokenOutOfRange { id, vocab: limit }.into());
        }
        Ok(Array::from_u32(&tokens, &[1, tokens.len() as i32])?)
    }
}

impl Model for Gemma4 {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn kv_layout(&self) -> KvLayout {
        self.kv_layout
    }

    fn layer_windows(&self) -> Vec<Option<usize>> {
        self.layers.iter().map(|(_, s)| s.window()).collect()
    }

    fn layer_states(&self) -> Vec<LayerState> {
        self.layers.iter().map(|(_, s)| s.clone()).collect()
    }

    fn embed_tokens(&self, ids: &[u32]) -> Result<Array, ModelError> {
        let vocab = self.config.vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(mlxcel_model::StepMismatch::TokenOutOfRange { id, vocab }.into());
        }
        let ids = Array::from_u32(ids, &[ids.len() as i32])?;
        Ok(self
            .embed_tokens
            .forward(&ids)?
            .multiply(&self.embed_scale)?)
    }

    fn build_step(
        &self,
        rows: &[StepRow<'_>],
        ids: Option<&Array>,
        kv: &mut dyn AttentionKv,
        path: AttentionPath,
    ) -> Result<StepGraph, ModelError> {
        let step = Step::new(rows, kv, path)?;
        let ids = self.step_ids(rows, ids, &step)?;
        let mut h = self
            .embed_tokens
            .forward(&ids)?
            .multiply(&self.embed_scale)?;
        mark("embed", &[&h, &step.positions])?;
        let n = self.layers.len();
        let inputs = match &self.per_layer_inputs {
            Some(p) => Some(p.forward(&ids, &h, n)?),
            None => None,
        };
        let t = step.tokens as i32;
        for (i, (layer, _)) in self.layers.iter().enumerate() {
            let input = match (&inputs, &self.per_layer_inputs) {
                (Some(all), Some(p)) => {
                    let s = p.size as i32;
                    Some(
                        all.slice(&[0, 0, i as i32, 0], &[1, t, i as i32 + 1, s])?
                            .reshape(&[1, t, s])?,
                    )
                }
                _ => None,
            };
            h = layer.forward(&h, input.as_ref(), i, kv, &step)?;
        }
        let hidden_at = step.hidden_indices(rows);
        let hidden = if hidden_at.is_empty() {
            None
        } else {
            let at = Array::from_i32(&hidden_at, &[hidden_at.len() as i32])?;
            let normed = self.norm.forward(&h.take(&at, 1)?)?;
            Some(
                normed
                    .reshape(&[hidden_at.len() as i32, -1])?
                    .astype(Dtype::Float32)?,
            )
        };
        let wanted = step.logit_indices(rows);
        if wanted.is_empty() {
            let logits = mlxcel_mlx::zeros(&[0, self.config.vocab_size as i32], Dtype::Float32)?;
            return Ok(StepGraph { logits, hidden });
        }
        let idx = Array::from_i32(&wanted, &[wanted.len() as i32])?;
        let last = self.norm.forward(&h.take(&idx, 1)?)?;
        let mut logits = with_quantized_matmul(|| match &self.lm_head {
            Some(head) => head.forward(&last),
            None => self.embed_tokens.as_linear(&last),
        })?;
        if let Some(cap) = self.softcap {
            let cap = Array::scalar(cap)?.astype(logits.dtype())?;
            logits = logits.divide(&cap)?.tanh()?.multiply(&cap)?;
        }
        let logits = logits
            .reshape(&[wanted.len() as i32, -1])?
            .astype(Dtype::Float32)?;
        mark("head", &[&logits])?;
        Ok(StepGraph { logits, hidden })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 4 E2B's text config as its checkpoints nest it (sizes of
    /// the published model; `layer_types` by the pattern).
    const E2B: &str = r#"{
        "model_type": "gemma4",
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144,
            "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
            "global_head_dim": 512, "vocab_size": 262144,
            "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
            "num_kv_shared_layers": 20, "sliding_window": 512, "rms_norm_eps": 1e-6,
            "final_logit_softcapping": 30.0, "max_position_embeddings": 131072,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                   "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}
            }
        },
        "vision_config": {"hidden_size": 768},
        "audio_config": {"hidden_size": 1536}
    }"#;

    #[test]
    fn an_e2b_config_reads_as_mlx_lm_reads_it() {
        let mut config = ModelConfig::from_json_str(E2B).expect("config");
        configure(&mut config).expect("configure");
        assert_eq!(config.model_type, "gemma4");
        assert_eq!((config.hidden_size, config.head_dim), (1536, 256));
        assert_eq!(config.sliding_window, None, "windows are per layer");
        let keys: Gemma4Keys = crate::own_keys(&config).expect("keys");
        let sliding = crate::sliding_layers(None, 35, keys.sliding_window_pattern).unwrap();
        // Every 5th layer full: 7 of 35.
        assert_eq!(sliding.iter().filter(|&&s| !s).count(), 7);
        assert!(!sliding[4] && sliding[3]);
        let full = rope(&keys, "full_attention", 512, false).expect("rope");
        assert_eq!((full.dims, full.base), (512, 1_000_000.0));
        let RopeScaling::Divisors(d) = full.scaling else {
            panic!("proportional RoPE: {:?}", full.scaling)
        };
        // A quarter of 512 rotates: 64 pairs turn, 192 do not.
        assert_eq!(d.len(), 256);
        assert!(d[..64].iter().all(|&x| x == 1.0));
        assert!(d[64..].iter().all(|x| x.is_infinite()));
        let local = rope(&keys, "sliding_attention", 256, false).expect("rope");
        assert_eq!((local.dims, local.base), (256, 10_000.0));
        assert_eq!(local.scaling, RopeScaling::None);
    }

    #[test]
    fn unknown_rope_types_and_wide_rotations_are_config_errors() {
        let keys = |p: Json| -> Gemma4Keys {
            serde_json::from_value(serde_json::json!({ "rope_parameters": p })).unwrap()
        };
        let yarn = keys(serde_json::json!({"full_attention": {"rope_type": "yarn"}}));
        let err = rope(&yarn, "full_attention", 64, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("rope_type \"yarn\""), "{err}");
        let wide = keys(serde_json::json!({"full_attention": {
            "rope_type": "proportional", "partial_rotary_factor": 1.5}}));
        let err = rope(&wide, "full_attention", 64, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("96 rotated features of 64"), "{err}");
        // An odd count turns as mlx_lm's `arange(0, 7, 2)`: 4 pairs.
        let odd = keys(serde_json::json!({"full_attention": {
            "rope_type": "proportional", "partial_rotary_factor": 0.11}}));
        let RopeScaling::Divisors(d) = rope(&odd, "full_attention", 64, false).unwrap().scaling
        else {
            panic!("proportional")
        };
        assert_eq!(d.iter().filter(|x| x.is_finite()).count(), 4);
        assert_eq!(d.len(), 32);
    }

    #[test]
    fn checkpoint_names_map_onto_the_text_model() {
        let name = |n: &str| text_model_name(n);
        assert_eq!(
            name("model.language_model.layers.0.self_attn.q_proj.weight").as_deref(),
            Some("model.layers.0.self_attn.q_proj.weight")
        );
        assert_eq!(
            name("language_model.model.embed_tokens_per_layer.weight").as_deref(),
            Some("model.embed_tokens_per_layer.weight")
        );
        assert_eq!(
            name("language_model.lm_head.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(name("model.vision_tower.encoder.weight"), None);
        assert_eq!(name("model.embed_audio.weight"), None);
        assert_eq!(
            name("model.norm.weight").as_deref(),
            Some("model.norm.weight")
        );
    }
}
