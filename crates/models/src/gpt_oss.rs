//! gpt-oss (OpenAI 2025, gpt-oss-20b and -120b): every layer a sparse MoE
//! block and an attention with a learned sink per head
//! ([`AttentionSpec::sinks`]) and biases on q, k, v and o; layers alternate
//! between a sliding window of `sliding_window` keys and full attention
//! (`layer_types`, else sliding first, then full, as mlx_lm reads it);
//! RoPE with YaRN scaling. The MoE block (`mlp`): the router `mlp.router`
//! (with a bias) picks the `num_experts_per_tok` experts of largest logit,
//! weighted by a softmax over those alone; the experts
//! (`mlp.experts.{gate,up,down}_proj`, stacked, with biases) combine gate
//! and up through the clamped SwiGLU ([`ExpertGlu::ClampedSwiglu`], alpha
//! 1.702, limit `swiglu_limit`). Reference: mlx_lm's `models/gpt_oss.py`.
//!
//! Checkpoints are read in mlx_lm's layout (what `mlx_lm convert` writes:
//! `gate_up_proj` already split into `gate_proj` and `up_proj`). MXFP4
//! experts (`"mode": "mxfp4"`, OpenAI's release and mlx-community's
//! MXFP4 conversions) are refused at load: only affine quantization is
//! read; a bfloat16 or affine-quantized conversion serves.

use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::moe::{ExpertGlu, ExpertLayout, ExpertNames, MoeSpec, Routing};
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use serde::Deserialize;

use crate::decoder::{Decoder, DecoderSpec, SparseLayers};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "gpt_oss",
    model_types: &["gpt_oss"],
    configure,
    load,
    gguf: &[],
};

/// What gpt-oss reads that the shared config does not (defaults: mlx_lm's
/// and Hugging Face's).
#[derive(Deserialize)]
struct GptOssKeys {
    #[serde(default = "experts")]
    num_local_experts: usize,
    #[serde(default = "top_k")]
    num_experts_per_tok: usize,
    #[serde(default = "window")]
    sliding_window: usize,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default = "limit")]
    swiglu_limit: f32,
}

fn experts() -> usize {
    128
}
fn top_k() -> usize {
    4
}
fn window() -> usize {
    128
}
fn limit() -> f32 {
    7.0
}

/// gpt-oss's SwiGLU slope (OpenAI's reference; not in the config).
const SWIGLU_ALPHA: f32 = 1.702;

impl GptOssKeys {
    /// Which layers attend within the window: `layer_types`, else
    /// alternating, sliding first (mlx_lm's default).
    fn sliding(&self, layers: usize) -> Result<Vec<bool>, ModelError> {
        match &self.layer_types {
            Some(types) => crate::sliding_layers(Some(types), layers, 2),
            None => Ok((0..layers).map(|i| i % 2 == 0).collect()),
        }
    }
}

/// The windows are per layer; an untied head and RoPE base 150000 unless
/// the config says otherwise; the keys are checked.
fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    let keys: GptOssKeys = crate::own_keys(config)?;
    keys.sliding(config.num_hidden_layers)?;
    if keys.sliding_window == 0 {
        return Err(ModelError::Config("gpt_oss: sliding_window is 0".into()));
    }
    config.sliding_window = None;
    crate::untied_unless_said(config, Some(150_000.0));
    Ok(())
}

fn load(
    mut config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let keys: GptOssKeys = crate::own_keys(&config)?;
    // mlx_lm's gpt-oss always has its own head: `lm_head` when present is
    // the head, whatever `tie_word_embeddings` says.
    config.tie_word_embeddings = !weights.contains("lm_head.weight");
    let full = AttentionSpec {
        qkv_bias: true,
        o_bias: true,
        sinks: true,
        window: None,
        ..AttentionSpec::from_config(&config)
    };
    let sliding = AttentionSpec {
        window: Some(keys.sliding_window),
        ..full.clone()
    };
    let moe = SparseLayers {
        spec: MoeSpec {
            experts: keys.num_local_experts,
            top_k: keys.num_experts_per_tok,
            expert_hidden: config.intermediate_size,
            routing: Routing::TopKSoftmax,
            per_expert_names: ExpertNames::PROJ,
            shared_expert: None,
            activation: Default::default(),
            glu: ExpertGlu::ClampedSwiglu {
                alpha: SWIGLU_ALPHA,
                limit: keys.swiglu_limit,
            },
            layout: ExpertLayout {
                router: "router",
                router_bias: true,
                stacked: "experts",
                bias: true,
            },
        },
        layers: vec![true; config.num_hidden_layers],
        path: "mlp",
    };
    let spec = DecoderSpec {
        layers: keys
            .sliding(config.num_hidden_layers)?
            .into_iter()
            .map(|s| if s { sliding.clone() } else { full.clone() })
            .collect(),
        moe: Some(moe),
        ..DecoderSpec::uniform(full.clone(), config.num_hidden_layers)
    };
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
