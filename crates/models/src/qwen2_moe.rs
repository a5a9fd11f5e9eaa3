//! Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v
//! biases) and a sparse MoE block on every `decoder_sparse_step`-th layer
//! not in `mlp_only_layers` (every layer by default; mlx_lm reads neither
//! key): `num_experts` SwiGLU experts of `moe_intermediate_size`, softmax
//! routing to the top `num_experts_per_tok` (renormalised only with
//! `norm_topk_prob`, default false), plus a shared expert of
//! `shared_expert_intermediate_size` that every token runs through,
//! weighted by a sigmoid gate. Reference: mlx_lm's `models/qwen2_moe.py`.

use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use serde::Deserialize;

use crate::decoder::{Decoder, DecoderSpec};
use crate::qwen3_moe::QwenMoeKeys;
use crate::Family;

pub const FAMILY: Family = Family {
    name: "qwen2_moe",
    model_types: &["qwen2_moe"],
    configure,
    load,
    gguf: &[],
};

/// What Qwen2-MoE reads beyond the shared Qwen MoE keys.
#[derive(Deserialize)]
struct SharedExpertKeys {
    shared_expert_intermediate_size: usize,
}

/// Qwen2's reading, an untied head and RoPE base 10^6 unless the config
/// says otherwise (mlx_lm's defaults).
fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    crate::qwen2::configure(config)?;
    crate::untied_unless_said(config, Some(1_000_000.0));
    Ok(())
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let keys: QwenMoeKeys = crate::own_keys(&config)?;
    let shared: SharedExpertKeys = crate::own_keys(&config)?;
    let attention = AttentionSpec {
        qkv_bias: true,
        o_bias: false,
        ..AttentionSpec::from_config(&config)
    };
    let moe = keys.sparse_layers(
        config.num_hidden_layers,
        Some(shared.shared_expert_intermediate_size),
    )?;
    let spec = DecoderSpec {
        moe: Some(moe),
        ..DecoderSpec::uniform(attention, config.num_hidden_layers)
    };
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
