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

use mlxcel_mlx::Array;
use mlxcel_model::attention::AttentionSpec;
use mlxcel_model::gguf::arch::{no_extra_config, LLAMA_LAYER_TENSORS};
use mlxcel_model::gguf::GgufArch;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};

use crate::decoder::{Decoder, DecoderSpec};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "llama",
    model_types: &["llama", "mistral"],
    configure,
    load,
    gguf: &[GGUF],
};

/// llama.cpp's `llama` GGUF architecture (Llama, SmolLM, Mistral files):
/// llama's tensor names, the q/k rows put back in the checkpoint's order.
const GGUF: GgufArch = GgufArch {
    name: "llama",
    model_type: "llama",
    layer_tensors: &[LLAMA_LAYER_TENSORS],
    extra_config: no_extra_config,
    fix_tensor: unpermute_qk,
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

/// llama.cpp's converter reorders the rows of each llama q and k head so
/// that the two halves RoPE rotates together (HF's layout) sit in adjacent
/// rows (ggml's layout): checkpoint row `j·(d/2) + i` of a head of `d`
/// rows is stored as GGUF row `2i + j` (`i < d/2`, `j` in 0..2). This puts
/// them back, for the weight and, when quantized, its scales and biases
/// (rows carry their quantization groups along) and a bias.
fn unpermute_qk(name: &str, a: Array, config: &ModelConfig) -> Result<Array, ModelError> {
    let heads = if name.contains(".self_attn.q_proj.") {
        config.num_attention_heads
    } else if name.contains(".self_attn.k_proj.") {
        config.num_key_value_heads
    } else {
        return Ok(a);
    };
    let rows = a.dim(0)? as usize;
    let d = config.head_dim;
    if rows != heads * d || !d.is_multiple_of(2) {
        return Err(ModelError::Weights(format!(
            "{name}: {rows} rows are not {heads} heads of {d}"
        )));
    }
    Ok(a.take(
        &Array::from_u32(&unpermute_rows(heads, d), &[rows as i32])?,
        0,
    )?)
}

/// For each checkpoint row, the GGUF row it comes from (see
/// [`unpermute_qk`]).
fn unpermute_rows(heads: usize, d: usize) -> Vec<u32> {
    let half = d / 2;
    let mut rows = Vec::with_capacity(heads * d);
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..half {
                rows.push((h * d + 2 * i + j) as u32);
            }
        }
    }
    rows
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

    #[test]
    fn gguf_layer_tensors_are_llamas() {
        use mlxcel_model::gguf::arch::checkpoint_name;
        assert_eq!(
            checkpoint_name(&GGUF, "blk.3.attn_q.weight").as_deref(),
            Some("model.layers.3.self_attn.q_proj.weight")
        );
        assert_eq!(
            checkpoint_name(&GGUF, "blk.12.ffn_norm.weight").as_deref(),
            Some("model.layers.12.post_attention_layernorm.weight")
        );
    }

    #[test]
    fn unpermuting_inverts_llama_cpp_row_order() {
        // llama.cpp stores checkpoint row h·d + j·d/2 + i at h·d + 2i + j.
        let (heads, d) = (3, 8);
        let mut gguf_of_hf = vec![0usize; heads * d];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..d / 2 {
                    gguf_of_hf[h * d + j * d / 2 + i] = h * d + 2 * i + j;
                }
            }
        }
        let rows = unpermute_rows(heads, d);
        for (hf, &src) in rows.iter().enumerate() {
            assert_eq!(src as usize, gguf_of_hf[hf]);
        }
        assert_eq!(&rows[..8], &[0, 2, 4, 6, 1, 3, 5, 7]);
    }
}
