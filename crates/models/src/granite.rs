//! Granite 3 (IBM): Llama's wiring with four multipliers from
//! `config.json`: embeddings times `embedding_multiplier`, attention scores
//! scaled by `attention_multiplier` (instead of `head_dim^-0.5`), each
//! residual branch times `residual_multiplier`, logits divided by
//! `logits_scaling`. Reference: mlx_lm's `models/granite.py`.

use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use serde::Deserialize;

use crate::decoder::{Decoder, DecoderSpec};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "granite",
    model_types: &["granite"],
    configure: crate::keep,
    load,
    gguf: &[],
};

/// Granite's multipliers.
#[derive(Deserialize)]
struct GraniteKeys {
    embedding_multiplier: f32,
    attention_multiplier: f32,
    residual_multiplier: f32,
    logits_scaling: f32,
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let keys: GraniteKeys = crate::own_keys(&config)?;
    let attention = AttentionSpec {
        scale: keys.attention_multiplier,
        ..AttentionSpec::from_config(&config)
    };
    let spec = DecoderSpec {
        embedding_scale: keys.embedding_multiplier,
        residual_scale: keys.residual_multiplier,
        logits_divisor: keys.logits_scaling,
        ..DecoderSpec::uniform(attention, config.num_hidden_layers)
    };
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
