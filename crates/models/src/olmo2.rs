//! OLMo 2 (AI2): Llama's wiring with the norms after each branch instead
//! of before (`post_attention_layernorm` on the attention output,
//! `post_feedforward_layernorm` on the MLP output, no `input_layernorm`)
//! and RMSNorms over the whole query and key projections before RoPE.
//! Reference: mlx_lm's `models/olmo2.py`.

use mlxcel_model::attention::{AttentionSpec, QkNorm};
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};

use crate::decoder::{Decoder, DecoderSpec, NormPlacement};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "olmo2",
    model_types: &["olmo2"],
    configure: crate::keep,
    load,
    gguf: &[],
};

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let attention = AttentionSpec {
        qk_norm: Some(QkNorm {
            eps: config.rms_norm_eps,
            per_head: false,
            weight_offset: 0.0,
        }),
        ..AttentionSpec::from_config(&config)
    };
    let spec = DecoderSpec {
        norms: NormPlacement::Post,
        ..DecoderSpec::uniform(attention, config.num_hidden_layers)
    };
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
