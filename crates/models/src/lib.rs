//! mlxcel's model families and the registry that picks one for a
//! checkpoint.
//!
//! A family is one short file (`llama.rs`, `qwen2.rs`, `qwen3.rs`,
//! `granite.rs`, `phi3.rs`, `olmo2.rs`, `gemma3.rs`, `gemma4.rs`, and the
//! mixture-of-experts `qwen2_moe.rs`, `qwen3_moe.rs`, `mixtral.rs`,
//! `gpt_oss.rs`, and the hybrids `qwen3_5.rs`, `granitemoehybrid.rs`): the
//! `model_type`s it serves, what it reads from `config.json` beyond the
//! shared [`ModelConfig`] (its own keys come from `ModelConfig::raw`),
//! how it builds each layer from the shared layers of `mlxcel-model`, and
//! the GGUF architectures it serves ([`Family::gguf`]: tensor names, extra
//! config keys, tensor fix-ups). The
//! engine depends on this registry only: a [`Checkpoint`] (or
//! [`read_config`] and [`load_model`]). Adding a family: docs/adding-a-family.md.

mod checkpoint;
pub mod decoder;
mod gemma3;
mod gemma4;
mod gpt_oss;
mod granite;
mod granitemoehybrid;
mod llama;
mod mixtral;
mod olmo2;
mod phi3;
mod qwen2;
mod qwen2_moe;
mod qwen3;
mod qwen3_5;
mod qwen3_moe;

use std::path::Path;

use mlxcel_model::gguf::GgufArch;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};

pub use checkpoint::Checkpoint;

/// One family: its `model_type`s, how it adjusts the shared config, and how
/// it loads.
pub struct Family {
    /// A short name for logs and errors.
    pub name: &'static str,
    /// The `config.json` `model_type`s it serves.
    pub model_types: &'static [&'static str],
    /// Applies the family's reading of `config.json` to the shared config
    /// (defaults and keys it reads differently).
    pub configure: fn(&mut ModelConfig) -> Result<(), ModelError>,
    /// Loads the model from an opened checkpoint.
    pub load: LoadFn,
    /// The GGUF architectures (`general.architecture`) it serves and how
    /// their files map to its checkpoint layout (empty: none).
    pub gguf: &'static [GgufArch],
}

/// How a family loads its model from an opened checkpoint.
pub type LoadFn = fn(ModelConfig, &mut Weights, LoadOptions) -> Result<Box<dyn Model>, ModelError>;

/// Every family mlxcel serves.
pub const FAMILIES: &[&Family] = &[
    &llama::FAMILY,
    &qwen2::FAMILY,
    &qwen3::FAMILY,
    &granite::FAMILY,
    &phi3::FAMILY,
    &olmo2::FAMILY,
    &gemma3::FAMILY,
    &gemma4::FAMILY,
    &qwen2_moe::FAMILY,
    &qwen3_moe::FAMILY,
    &mixtral::FAMILY,
    &gpt_oss::FAMILY,
    &qwen3_5::FAMILY,
    &granitemoehybrid::FAMILY,
];

/// The family serving `model_type`.
///
/// # Errors
/// [`ModelError::Unsupported`] naming the `model_type` and the supported
/// ones.
pub fn family(model_type: &str) -> Result<&'static Family, ModelError> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.model_types.contains(&model_type))
        .ok_or_else(|| {
            ModelError::Unsupported(format!(
                "model_type {model_type} (supported: {})",
                supported().join(", ")
            ))
        })
}

/// The mapping of GGUF architecture `name` (`general.architecture`),
/// from the family that serves it.
///
/// # Errors
/// [`ModelError::Unsupported`] naming it and the supported ones.
pub fn gguf_arch(name: &str) -> Result<&'static GgufArch, ModelError> {
    gguf_archs().find(|a| a.name == name).ok_or_else(|| {
        let names: Vec<&str> = gguf_archs().map(|a| a.name).collect();
        ModelError::Unsupported(format!(
            "GGUF architecture {name} (supported: {})",
            names.join(", ")
        ))
    })
}

/// Every GGUF architecture served, in registry order.
fn gguf_archs() -> impl Iterator<Item = &'static GgufArch> {
    FAMILIES.iter().flat_map(|f| f.gguf.iter())
}

/// Every `model_type` served, in registry order.
pub fn supported() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.model_types.iter().copied())
        .collect()
}

/// Reads `dir/config.json` as its family reads it; when `dir` is a GGUF
/// file, the config its metadata describes (`mlxcel_model::gguf`). Opens
/// the checkpoint for this alone: a start-up that also loads the model or
/// the GGUF tokenizer opens one [`Checkpoint`] instead.
///
/// # Errors
/// Missing or malformed `config.json`, an unsupported `model_type`, or a
/// family's refusal of the config; for GGUF, an invalid file or an
/// unsupported architecture or tensor type (named).
pub fn read_config(dir: &Path) -> Result<ModelConfig, ModelError> {
    Checkpoint::open(dir)?.config()
}

/// Loads the model in `dir` (a checkpoint directory or a GGUF file; its
/// config from [`read_config`]) with its family ([`Checkpoint::load_model`]
/// on a checkpoint opened for this alone).
///
/// # Errors
/// An unsupported `model_type`, or any loading error of the family.
pub fn load_model(
    dir: &Path,
    config: ModelConfig,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    Checkpoint::open(dir)?.load_model(config, options)
}

/// The family's own `config.json` keys, deserialized from `config.raw`.
fn own_keys<T: serde::de::DeserializeOwned>(config: &ModelConfig) -> Result<T, ModelError> {
    serde_json::from_value(config.raw.clone()).map_err(|e| ModelError::Config(e.to_string()))
}

/// Which layers attend within a sliding window: as `layer_types` lists
/// them (`sliding_attention` or `full_attention`, Hugging Face's key), or
/// else every `pattern`-th layer global and the others windowed (Gemma's
/// `sliding_window_pattern`; a pattern of 0 is refused, `usize::MAX` makes
/// every layer windowed).
///
/// # Errors
/// A `layer_types` list of the wrong length or with an unknown kind, or a
/// zero pattern.
pub(crate) fn sliding_layers(
    layer_types: Option<&[String]>,
    layers: usize,
    pattern: usize,
) -> Result<Vec<bool>, ModelError> {
    match layer_types {
        Some(types) => {
            if types.len() != layers {
                return Err(ModelError::Config(format!(
                    "{} layer_types for {layers} layers",
                    types.len()
                )));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(ModelError::Config(format!("unknown layer type {other:?}"))),
                })
                .collect()
        }
        None if pattern == 0 => Err(ModelError::Config("sliding_window_pattern is 0".into())),
        None => Ok((0..layers).map(|i| (i + 1) % pattern != 0).collect()),
    }
}

/// Defaults of the mixture-of-experts families that the shared config
/// reads otherwise: an untied head when `tie_word_embeddings` is absent
/// (Hugging Face's default for them; the shared reader ties), and, with
/// `rope_base` given, that RoPE base when `rope_theta` is absent.
fn untied_unless_said(config: &mut ModelConfig, rope_base: Option<f32>) {
    if config.raw.get("tie_word_embeddings").is_none() {
        config.tie_word_embeddings = false;
    }
    if let Some(base) = rope_base {
        if config.raw.get("rope_theta").is_none() {
            config.rope_theta = base;
        }
    }
}

/// A multimodal checkpoint's text-model tensor name as the shared decoder
/// names it: `model.language_model.X` (Hugging Face) and
/// `language_model.model.X` (mlx_lm) become `model.X`, `language_model.X`
/// (the head) `X`; any other name is unchanged.
pub(crate) fn text_model_path(name: &str) -> String {
    for (from, to) in [
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.", ""),
    ] {
        if let Some(rest) = name.strip_prefix(from) {
            return format!("{to}{rest}");
        }
    }
    name.to_string()
}

/// Nothing to adjust.
fn keep(_: &mut ModelConfig) -> Result<(), ModelError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn unknown_gguf_architectures_are_named() {
        let err = super::gguf_arch("mamba").err().unwrap().to_string();
        assert!(
            err.contains("mamba") && err.contains("llama, qwen2, qwen3, gemma3"),
            "{err}"
        );
    }

    #[test]
    fn each_gguf_architecture_becomes_a_model_type_of_its_family() {
        for family in super::FAMILIES {
            for arch in family.gguf {
                assert_eq!(super::gguf_arch(arch.name).unwrap().name, arch.name);
                assert!(
                    family.model_types.contains(&arch.model_type),
                    "{} -> {}",
                    arch.name,
                    arch.model_type
                );
            }
        }
    }

    #[test]
    fn sliding_layers_follow_layer_types_or_the_pattern() {
        let global = |v: Vec<bool>| -> Vec<usize> { (0..v.len()).filter(|&i| !v[i]).collect() };
        assert_eq!(
            global(super::sliding_layers(None, 12, 6).unwrap()),
            vec![5, 11]
        );
        let types = vec![
            "full_attention".to_string(),
            "sliding_attention".to_string(),
        ];
        assert_eq!(
            super::sliding_layers(Some(&types), 2, 6).unwrap(),
            vec![false, true]
        );
        assert!(
            super::sliding_layers(Some(&types), 3, 6).is_err(),
            "wrong length"
        );
        let odd = vec!["chunked_attention".to_string()];
        assert!(
            super::sliding_layers(Some(&odd), 1, 6).is_err(),
            "unknown kind"
        );
        assert!(super::sliding_layers(None, 2, 0).is_err(), "zero pattern");
    }
}
