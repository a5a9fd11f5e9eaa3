//! Phi-3 and Phi-4-mini (Microsoft): Llama's wiring with fused projections
//! (`qkv_proj`: q, k then v rows; `mlp.gate_up_proj`: gate then up rows),
//! kept fused ([`mlxcel_model::layers::LinearGroup`]), heads of
//! `hidden_size / num_attention_heads` features,
//! and RoPE over the first `partial_rotary_factor` of each head. The
//! `longrope` / `su` scalings of the 128k-context checkpoints are refused
//! by the shared config reader (unsupported `rope_scaling`). Reference:
//! mlx_lm's `models/phi3.py`.

use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use serde::Deserialize;

use crate::decoder::{Decoder, DecoderSpec};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "phi3",
    model_types: &["phi3"],
    configure,
    load,
    gguf: &[],
};

/// What Phi-3 reads that the shared config does not.
#[derive(Deserialize)]
struct Phi3Keys {
    #[serde(default = "whole")]
    partial_rotary_factor: f32,
}

fn whole() -> f32 {
    1.0
}

fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    // Phi-3's heads are always hidden / heads wide.
    config.head_dim = config.hidden_size / config.num_attention_heads;
    Ok(())
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let keys: Phi3Keys = crate::own_keys(&config)?;
    let mut attention = AttentionSpec {
        fused_qkv: true,
        ..AttentionSpec::from_config(&config)
    };
    attention.rope.dims = (config.head_dim as f32 * keys.partial_rotary_factor) as usize;
    let spec = DecoderSpec {
        fused_gate_up: true,
        ..DecoderSpec::uniform(attention, config.num_hidden_layers)
    };
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
