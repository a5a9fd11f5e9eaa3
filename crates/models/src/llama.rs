//! Llama 2/3 (Touvron et al. 2023; Llama 3.1 RoPE scaling), SmolLM, and
//! Mistral. Reference: mlx_lm's `models/llama.py`.
//!
//! Windows: with `layer_types` in `config.json`, the layers it marks
//! `sliding_attention` attend within `sliding_window` keys and the
//! `full_attention` ones globally (as mlx_lm does). Without it, a
//! `sliding_window` applies to every layer (Mistral 7B v0.1, as Hugging
//! Face's Mistral does; mlx_lm ignores the window then).
//!
//! Each layer's window goes into its `AttentionSpec` (`Model::layer_windows`);
//! the KV cache keeps each window's layers in their own KV group, which
//! holds only that window's keys (docs/architecture.md, "KV windows and KV
//! groups"). The config's `sliding_window` stays only when every layer has
//! that window.

use serde::Deserialize;

use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};

use crate::decoder::{Decoder, DecoderSpec};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "llama",
    model_types: &["llama", "mistral"],
    configure,
    load,
};

#[derive(Debug, Deserialize)]
struct LlamaKeys {
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    sliding_window: Option<usize>,
}

/// Each layer's window, `None` for global layers.
///
/// # Errors
/// A `layer_types` list of the wrong length or with an unknown kind, or a
/// sliding layer without `sliding_window`.
fn layer_windows(keys: &LlamaKeys, config: &ModelConfig) -> Result<Vec<Option<usize>>, ModelError> {
    let layers = config.num_hidden_layers;
    let Some(types) = &keys.layer_types else {
        return Ok(vec![config.sliding_window; layers]);
    };
    let sliding = crate::sliding_layers(Some(types), layers, usize::MAX)?;
    if sliding.iter().any(|&s| s) && keys.sliding_window.is_none() {
        return Err(ModelError::Config(
            "sliding_attention without sliding_window".into(),
        ));
    }
    Ok(sliding
        .into_iter()
        .map(|s| if s { keys.sliding_window } else { None })
        .collect())
}

/// Keeps `sliding_window` only when every layer has that window.
fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    let keys: LlamaKeys = crate::own_keys(config)?;
    let windows = layer_windows(&keys, config)?;
    config.sliding_window = match windows.first() {
        Some(&first) if windows.iter().all(|&w| w == first) => first,
        _ => None,
    };
    Ok(())
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let keys: LlamaKeys = crate::own_keys(&config)?;
    let attention = AttentionSpec::from_config(&config);
    let mut spec = DecoderSpec::uniform(attention.clone(), config.num_hidden_layers);
    if keys.layer_types.is_some() {
        spec.layers = layer_windows(&keys, &config)?
            .into_iter()
            .map(|window| AttentionSpec {
                window,
                ..attention.clone()
            })
            .collect();
    }
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> ModelConfig {
        let mut c = ModelConfig::from_json_str(json).unwrap();
        configure(&mut c).unwrap();
        c
    }

    const BASE: &str = r#""model_type":"mistral","hidden_size":64,"num_hidden_layers":2,
        "intermediate_size":128,"num_attention_heads":4,"rms_norm_eps":1e-5,"vocab_size":256"#;

    #[test]
    fn a_window_on_every_layer_stays_the_models_window() {
        let c = config(&format!("{{{BASE},\"sliding_window\":16}}"));
        assert_eq!(c.sliding_window, Some(16));
        let c = config(&format!(
            "{{{BASE},\"sliding_window\":16,\"layer_types\":[\"sliding_attention\",\"sliding_attention\"]}}"
        ));
        assert_eq!(c.sliding_window, Some(16));
    }

    #[test]
    fn mixed_layers_clear_the_models_window() {
        let c = config(&format!(
            "{{{BASE},\"sliding_window\":16,\"layer_types\":[\"sliding_attention\",\"full_attention\"]}}"
        ));
        assert_eq!(c.sliding_window, None);
        let keys: LlamaKeys = crate::own_keys(&c).unwrap();
        assert_eq!(layer_windows(&keys, &c).unwrap(), vec![Some(16), None]);
        let c = config(&format!(
            "{{{BASE},\"sliding_window\":16,\"layer_types\":[\"full_attention\",\"full_attention\"]}}"
        ));
        assert_eq!(
            c.sliding_window, None,
            "layer_types without a sliding layer"
        );
    }
}
