//! Qwen2 and Qwen2.5 (Yang et al. 2024): Llama's wiring with biases on the
//! q, k and v projections (never on the output one), and a sliding window
//! only when `use_sliding_window` is true. Reference: mlx_lm's
//! `models/qwen2.py`.

use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::gguf::arch::{keep_tensor, no_extra_config, LLAMA_LAYER_TENSORS};
use mlxcel_model::gguf::GgufArch;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use serde::Deserialize;

use crate::decoder::{Decoder, DecoderSpec};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "qwen2",
    model_types: &["qwen2"],
    configure,
    load,
    gguf: &[GGUF],
};

/// llama.cpp's `qwen2` GGUF architecture: llama's tensor names, q/k rows
/// in the checkpoint's order (llama.cpp's RoPE for Qwen rotates halves, as
/// the checkpoint's does).
const GGUF: GgufArch = GgufArch {
    name: "qwen2",
    model_type: "qwen2",
    layer_tensors: &[LLAMA_LAYER_TENSORS],
    extra_config: no_extra_config,
    fix_tensor: keep_tensor,
};

/// What Qwen2 reads that the shared config does not.
#[derive(Deserialize)]
struct Qwen2Keys {
    #[serde(default)]
    use_sliding_window: bool,
}

pub(crate) fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    // Qwen2 configs name a window they do not use unless told to.
    let keys: Qwen2Keys = crate::own_keys(config)?;
    if !keys.use_sliding_window {
        config.sliding_window = None;
    }
    Ok(())
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let attention = AttentionSpec {
        qkv_bias: true,
        o_bias: false,
        ..AttentionSpec::from_config(&config)
    };
    let spec = DecoderSpec::uniform(attention, config.num_hidden_layers);
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
