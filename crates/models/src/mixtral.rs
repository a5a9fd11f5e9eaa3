//! Mixtral (Jiang et al. 2024, "Mixtral of Experts"): Llama's attention and
//! on every layer a sparse MoE block (`block_sparse_moe`):
//! `num_local_experts` SwiGLU experts of `intermediate_size`; each token
//! goes to the `num_experts_per_tok` experts of largest router logit,
//! weighted by a softmax over those alone. Hugging Face checkpoints name
//! each expert's projections `w1` (gate), `w3` (up), `w2` (down). As in
//! mlx_lm, a `sliding_window` in the config is not applied. Reference:
//! mlx_lm's `models/mixtral.py`.

use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::moe::{ExpertNames, MoeSpec, Routing};
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use serde::Deserialize;

use crate::decoder::{Decoder, DecoderSpec, SparseLayers};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "mixtral",
    model_types: &["mixtral"],
    configure,
    load,
    gguf: &[],
};

/// What Mixtral reads that the shared config does not.
#[derive(Deserialize)]
struct MixtralKeys {
    #[serde(default = "eight")]
    num_local_experts: usize,
    #[serde(default = "two")]
    num_experts_per_tok: usize,
}

fn eight() -> usize {
    8
}

fn two() -> usize {
    2
}

/// Mixtral's window is not applied (mlx_lm's reading); an untied head and
/// RoPE base 10^6 unless the config says otherwise (mlx_lm's defaults).
fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    config.sliding_window = None;
    crate::untied_unless_said(config, Some(1_000_000.0));
    Ok(())
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let keys: MixtralKeys = crate::own_keys(&config)?;
    let moe = SparseLayers {
        spec: MoeSpec {
            experts: keys.num_local_experts,
            top_k: keys.num_experts_per_tok,
            expert_hidden: config.intermediate_size,
            routing: Routing::TopKSoftmax,
            per_expert_names: ExpertNames::MIXTRAL,
            shared_expert: None,
            activation: Default::default(),
            glu: Default::default(),
            layout: Default::default(),
        },
        layers: vec![true; config.num_hidden_layers],
        path: "block_sparse_moe",
    };
    let spec = DecoderSpec {
        moe: Some(moe),
        ..DecoderSpec::uniform(
            AttentionSpec::from_config(&config),
            config.num_hidden_layers,
        )
    };
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
