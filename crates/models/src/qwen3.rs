//! Qwen3 (dense): Qwen2's wiring without q/k/v biases (`attention_bias`,
//! default false, on all four projections) and with an RMSNorm over each
//! query and key head before RoPE (`q_norm`, `k_norm`). Reference: mlx_lm's
//! `models/qwen3.py`.

use mlxcel_model::attention::{AttentionSpec, QkNorm};
use mlxcel_model::gguf::arch::{
    keep_tensor, no_extra_config, LLAMA_LAYER_TENSORS, QK_NORM_LAYER_TENSORS,
};
use mlxcel_model::gguf::GgufArch;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};

use crate::decoder::{Decoder, DecoderSpec};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "qwen3",
    model_types: &["qwen3"],
    configure: crate::qwen2::configure,
    load,
    gguf: &[GGUF],
};

/// llama.cpp's `qwen3` GGUF architecture.
const GGUF: GgufArch = GgufArch {
    name: "qwen3",
    model_type: "qwen3",
    // Llama's tensors plus per-head RMSNorms of q and k (llama.cpp leaves
    // Qwen's q/k rows in the checkpoint's order: its RoPE for Qwen rotates
    // halves, as the checkpoint's does).
    layer_tensors: &[LLAMA_LAYER_TENSORS, QK_NORM_LAYER_TENSORS],
    extra_config: no_extra_config,
    fix_tensor: keep_tensor,
};

/// Qwen3's attention: the shared one with per-head q/k RMSNorms (also
/// Qwen3-MoE's).
pub(crate) fn attention(config: &ModelConfig) -> AttentionSpec {
    AttentionSpec {
        qk_norm: Some(QkNorm {
            eps: config.rms_norm_eps,
            per_head: true,
            weight_offset: 0.0,
        }),
        ..AttentionSpec::from_config(config)
    }
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let attention = attention(&config);
    let spec = DecoderSpec::uniform(attention, config.num_hidden_layers);
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
