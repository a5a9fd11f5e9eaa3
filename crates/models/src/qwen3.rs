//! Qwen3 (dense): Qwen2's wiring without q/k/v biases (`attention_bias`,
//! default false, on all four projections) and with an RMSNorm over each
//! query and key head before RoPE (`q_norm`, `k_norm`). Reference: mlx_lm's
//! `models/qwen3.py`.

use mlxcel_model::attention::{AttentionSpec, QkNorm};
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};

use crate::decoder::{Decoder, DecoderSpec};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "qwen3",
    model_types: &["qwen3"],
    configure: crate::qwen2::configure,
    load,
};

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let attention = AttentionSpec {
        qk_norm: Some(QkNorm {
            eps: config.rms_norm_eps,
            per_head: true,
            weight_offset: 0.0,
        }),
        ..AttentionSpec::from_config(&config)
    };
    let spec = DecoderSpec::uniform(attention, config.num_hidden_layers);
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
