//! Llama 2/3 (Touvron et al. 2023; Llama 3.1 RoPE scaling), SmolLM, and
//! Mistral (its sliding window, when `config.json` sets one, on every
//! layer). Reference: mlx_lm's `models/llama.py`.

use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};

use crate::decoder::{Decoder, DecoderSpec};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "llama",
    model_types: &["llama", "mistral"],
    configure: crate::keep,
    load,
};

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let spec = DecoderSpec::uniform(
        AttentionSpec::from_config(&config),
        config.num_hidden_layers,
    );
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
