//! Granite 4 (IBM; `granitemoehybrid`): a hybrid decoder of Mamba2 layers
//! (`mlxcel_model::mamba2`) and attention layers, as `layer_types` lists
//! them, with Granite 3's four multipliers (embeddings, attention scale,
//! residual branches, logits; see `granite.rs`). Attention layers use
//! RoPE, or none when `position_embedding_type` is `nope` (the `-h`
//! models). The feed-forward of every layer is a dense gated MLP
//! (`shared_mlp`, gate and up fused in `input_linear`) and, when the
//! config has `num_local_experts`, a sparse block beside it
//! (`block_sparse_moe`: router `router.layer`, softmax over the top-k
//! logits) whose output is added. Reference: mlx_lm's
//! `models/granitemoehybrid.py`.
//!
//! Checkpoints: mlx_lm's (experts stacked under `switch_mlp`, convolution
//! `[channels, kernel, 1]`, a dense model's MLP as `mlp.gate_proj` ...)
//! and Hugging Face's (convolution `[channels, 1, kernel]`, the dense MLP
//! as `shared_mlp`). Hugging Face's fused expert stacks
//! (`block_sparse_moe.input_linear`) need `mlx_lm.convert` first.

use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::config::RopeScaling;
use mlxcel_model::mamba2::Mamba2Spec;
use mlxcel_model::moe::{ExpertLayout, ExpertNames, MoeSpec, Routing};
use mlxcel_model::rope::RopeSpec;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use serde::Deserialize;

use crate::decoder::{Decoder, DecoderSpec, LinearLayers, LinearMixer, SparseLayers};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "granitemoehybrid",
    model_types: &["granitemoehybrid"],
    configure,
    load,
    gguf: &[],
};

/// Granite 4's own keys (Hugging Face's names; mlx_lm's defaults).
#[derive(Deserialize)]
struct GraniteHybridKeys {
    embedding_multiplier: f32,
    attention_multiplier: f32,
    residual_multiplier: f32,
    logits_scaling: f32,
    layer_types: Vec<String>,
    #[serde(default)]
    num_local_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    shared_intermediate_size: Option<usize>,
    #[serde(default)]
    mamba_n_heads: Option<usize>,
    #[serde(default)]
    mamba_d_head: Option<usize>,
    #[serde(default)]
    mamba_d_state: Option<usize>,
    #[serde(default)]
    mamba_d_conv: Option<usize>,
    #[serde(default)]
    mamba_n_groups: Option<usize>,
    #[serde(default)]
    mamba_conv_bias: Option<bool>,
    #[serde(default)]
    mamba_proj_bias: Option<bool>,
    #[serde(default = "rope")]
    position_embedding_type: String,
    #[serde(default = "time_step_limit")]
    time_step_limit: (f32, f32),
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
}

#[derive(Deserialize)]
struct RopeParameters {
    #[serde(default)]
    rope_theta: Option<f32>,
}

fn rope() -> String {
    "rope".into()
}

fn time_step_limit() -> (f32, f32) {
    (0.001, 100.0)
}

/// RoPE base from `rope_parameters` when the config nests it there
/// (newer Hugging Face configs); no window.
fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    let keys: GraniteHybridKeys = crate::own_keys(config)?;
    if let Some(theta) = keys.rope_parameters.as_ref().and_then(|r| r.rope_theta) {
        config.rope_theta = theta;
    }
    config.sliding_window = None;
    Ok(())
}

/// A Mamba key the config must have when it lists a Mamba layer.
fn need(value: Option<usize>, key: &str) -> Result<usize, ModelError> {
    value.ok_or_else(|| {
        ModelError::Config(format!("layer_types lists mamba layers, {key} is missing"))
    })
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let keys: GraniteHybridKeys = crate::own_keys(&config)?;
    let layers = config.num_hidden_layers;
    if keys.layer_types.len() != layers {
        return Err(ModelError::Config(format!(
            "layer_types lists {} layers, num_hidden_layers is {layers}",
            keys.layer_types.len()
        )));
    }
    let mamba: Vec<bool> = keys
        .layer_types
        .iter()
        .map(|t| match t.as_str() {
            "mamba" => Ok(true),
            "attention" => Ok(false),
            other => Err(ModelError::Config(format!("layer_types: unknown {other}"))),
        })
        .collect::<Result<_, _>>()?;
    let linear = if mamba.iter().any(|&m| m) {
        Some(LinearLayers {
            spec: LinearMixer::Mamba2(Mamba2Spec {
                heads: need(keys.mamba_n_heads, "mamba_n_heads")?,
                head_dim: need(keys.mamba_d_head, "mamba_d_head")?,
                state_dim: need(keys.mamba_d_state, "mamba_d_state")?,
                groups: need(keys.mamba_n_groups, "mamba_n_groups")?,
                conv_kernel: need(keys.mamba_d_conv, "mamba_d_conv")?,
                // Hugging Face's default; mlx_lm's leaves it unset (no
                // bias), but the published configs state it.
                conv_bias: keys.mamba_conv_bias.unwrap_or(true),
                proj_bias: keys.mamba_proj_bias.unwrap_or(false),
                dt_limit: keys.time_step_limit,
                eps: config.rms_norm_eps,
            }),
            layers: mamba,
        })
    } else {
        None
    };
    let moe = match keys.num_local_experts {
        Some(experts) if experts > 0 => {
            if weights.contains("model.layers.0.block_sparse_moe.input_linear.weight") {
                return Err(ModelError::Unsupported(
                    "Hugging Face's fused expert stacks (block_sparse_moe.input_linear): \
                     convert the checkpoint with mlx_lm.convert first"
                        .into(),
                ));
            }
            Some(SparseLayers {
                spec: MoeSpec {
                    experts,
                    top_k: keys.num_experts_per_tok.unwrap_or(0),
                    expert_hidden: config.intermediate_size,
                    routing: Routing::TopKSoftmax,
                    per_expert_names: ExpertNames::PROJ,
                    shared_expert: None,
                    activation: Default::default(),
                    glu: Default::default(),
                    layout: ExpertLayout {
                        router: "router.layer",
                        ..Default::default()
                    },
                },
                layers: vec![true; layers],
                path: "block_sparse_moe",
            })
        }
        _ => None,
    };
    let shared_mlp = match (&moe, keys.shared_intermediate_size) {
        (Some(_), Some(size)) => Some(size),
        (Some(_), None) => {
            return Err(ModelError::Config(
                "num_local_experts without shared_intermediate_size".into(),
            ))
        }
        // A dense model's MLP may be named `shared_mlp` (Hugging Face).
        (None, size) => Some(size.unwrap_or(config.intermediate_size)),
    };
    let attention = AttentionSpec {
        scale: keys.attention_multiplier,
        rope: match keys.position_embedding_type.as_str() {
            "nope" => RopeSpec {
                dims: 0,
                traditional: false,
                scaling: RopeScaling::None,
                ..RopeSpec::from_config(&config)
            },
            // mlx_lm applies no rope_scaling here.
            _ => RopeSpec {
                traditional: false,
                scaling: RopeScaling::None,
                ..RopeSpec::from_config(&config)
            },
        },
        window: None,
        ..AttentionSpec::from_config(&config)
    };
    let spec = DecoderSpec {
        embedding_scale: keys.embedding_multiplier,
        residual_scale: keys.residual_multiplier,
        logits_divisor: keys.logits_scaling,
        moe,
        linear,
        shared_mlp,
        ..DecoderSpec::uniform(attention, layers)
    };
    if config.tie_word_embeddings {
        // Some checkpoints ship an unused head beside tied embeddings.
        weights.rename(|n| (n != "lm_head.weight").then(|| n.to_string()));
    }
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
