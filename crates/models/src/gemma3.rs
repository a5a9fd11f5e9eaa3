//! Gemma 3 (text; `model_type` `gemma3_text`): local and global attention
//! layers, sandwich norms, GeGLU MLP. Reference: mlx_lm's
//! `models/gemma3_text.py` and Google DeepMind's Gemma 3 technical report
//! (2025).
//!
//! - Layers are local (sliding window of `sliding_window` keys, RoPE base
//!   `rope_local_base_freq`) or global (no window, RoPE base `rope_theta`
//!   with `rope_scaling`): as `layer_types` lists them, or else every
//!   `sliding_window_pattern`-th layer global, the others local.
//! - Every RMSNorm scales by `1 + weight`; each layer normalizes before and
//!   after both branches; queries and keys get a per-head RMSNorm.
//! - The MLP gate is GELU (tanh approximation); queries are scaled by
//!   `query_pre_attn_scalar^-0.5`; embeddings are multiplied by
//!   `sqrt(hidden_size)` rounded to bfloat16, as the reference does.
//! - The head is tied to the embedding unless the checkpoint has an
//!   `lm_head`.
//!
//! The window is the layer's own (`Model::layer_windows`): the shared
//! `sliding_window` of [`ModelConfig`] is cleared, and the KV cache keeps
//! the local layers in their own KV group, which holds only their window
//! (see docs/architecture.md, "KV windows and KV groups").

use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use mlxcel_mlx::{Array, Dtype};
use mlxcel_model::attention::{AttentionSpec, QkNorm};
use mlxcel_model::config::RopeScaling;
use mlxcel_model::gguf::arch::QK_NORM_LAYER_TENSORS;
use mlxcel_model::gguf::{GgufArch, Meta};
use mlxcel_model::layers::Activation;
use mlxcel_model::rope::RopeSpec;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};

use crate::decoder::{Decoder, DecoderSpec, NormPlacement};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "gemma3",
    model_types: &["gemma3_text"],
    configure,
    load,
    gguf: &[GGUF],
};

/// llama.cpp's `gemma3` GGUF architecture: Gemma 3's keys its metadata
/// does not record ([`gemma3_config`]), its sandwich-norm tensor names, 1
/// taken off every norm ([`gemma_norms`]).
const GGUF: GgufArch = GgufArch {
    name: "gemma3",
    model_type: "gemma3_text",
    layer_tensors: &[GEMMA3_LAYER_TENSORS, QK_NORM_LAYER_TENSORS],
    extra_config: gemma3_config,
    fix_tensor: gemma_norms,
};

/// The decoder-layer tensors of Gemma 3 (sandwich norms: `ffn_norm` is
/// the norm before the MLP, `post_ffw_norm` the one after it).
const GEMMA3_LAYER_TENSORS: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Gemma 3's keys that its GGUF metadata does not record, as Gemma 3's own
/// configuration fixes them: every 6th layer global, local layers with
/// RoPE base 10 000, GELU (tanh) MLP, no logit soft-capping. Queries are
/// scaled by `query_pre_attn_scalar^-0.5`, where the scalar is the head
/// size (`attention.key_length`: 256 for 270M, 1B, 4B and 12B) except for
/// the 27B model (62 layers), whose scalar is `hidden_size / heads` (168),
/// the rule llama.cpp's Gemma 3 loader applies too.
fn gemma3_config(meta: &Meta<'_>, c: &mut Map<String, Json>) -> Result<(), ModelError> {
    let layers = meta.required_uint("block_count")?;
    let scalar = if layers == 62 {
        meta.required_uint("embedding_length")? / meta.required_uint("attention.head_count")?
    } else {
        meta.required_uint("attention.key_length")?
    };
    c.insert("query_pre_attn_scalar".into(), json!(scalar));
    c.insert("sliding_window_pattern".into(), json!(6));
    c.insert("rope_local_base_freq".into(), json!(10_000.0));
    c.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
    // Gemma's own dtype: `--dtype auto` on a GPU computes in it (float16
    // overflows Gemma's residual stream, and the family refuses it).
    c.insert("torch_dtype".into(), json!("bfloat16"));
    Ok(())
}

/// llama.cpp's converter stores each Gemma RMSNorm weight as `1 + w`
/// (its kernel multiplies by the stored weight); the checkpoint layout the
/// family reads is `w` (it computes `1 + w`), so 1 comes off every norm.
/// Gemma's q and k rows are not permuted (its RoPE rotates halves, as the
/// checkpoint's).
fn gemma_norms(name: &str, a: Array, _: &ModelConfig) -> Result<Array, ModelError> {
    if name.ends_with("norm.weight") {
        Ok(a.subtract(&Array::scalar(1.0)?)?)
    } else {
        Ok(a)
    }
}

/// Gemma 3's own `config.json` keys (defaults: mlx_lm's).
#[derive(Debug, Deserialize)]
struct Gemma3Keys {
    #[serde(default = "default_window")]
    sliding_window: usize,
    #[serde(default = "default_pattern")]
    sliding_window_pattern: usize,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default = "default_local_base")]
    rope_local_base_freq: f32,
    #[serde(default = "default_query_scalar")]
    query_pre_attn_scalar: f32,
    #[serde(default)]
    hidden_activation: Option<String>,
}

fn default_window() -> usize {
    512
}
fn default_pattern() -> usize {
    6
}
fn default_local_base() -> f32 {
    10_000.0
}
fn default_query_scalar() -> f32 {
    256.0
}

/// The windows are per layer (see the module docs); checks the keys.
fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    let keys: Gemma3Keys = crate::own_keys(config)?;
    crate::sliding_layers(
        keys.layer_types.as_deref(),
        config.num_hidden_layers,
        keys.sliding_window_pattern,
    )?;
    if let Some(act) = keys.hidden_activation.as_deref() {
        if act != "gelu_pytorch_tanh" {
            return Err(ModelError::Config(format!(
                "gemma3: hidden_activation {act:?} (only gelu_pytorch_tanh)"
            )));
        }
    }
    config.sliding_window = None;
    Ok(())
}

/// `v` rounded to the nearest bfloat16 (ties to even), as a float32.
fn round_to_bf16(v: f32) -> f32 {
    let bits = v.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(rounded)
}

fn load(
    mut config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    if options.dtype == Dtype::Float16 {
        // The residual stream overflows float16 (mlx_lm clips it there).
        return Err(ModelError::Config(
            "gemma3: float16 overflows its residual stream; use bfloat16 or float32".into(),
        ));
    }
    let keys: Gemma3Keys = crate::own_keys(&config)?;
    let local = crate::sliding_layers(
        keys.layer_types.as_deref(),
        config.num_hidden_layers,
        keys.sliding_window_pattern,
    )?;
    config.tie_word_embeddings = !weights.contains("lm_head.weight");
    let global = AttentionSpec {
        qk_norm: Some(QkNorm {
            eps: config.rms_norm_eps,
            per_head: true,
            weight_offset: 1.0,
        }),
        window: None,
        scale: keys.query_pre_attn_scalar.powf(-0.5),
        ..AttentionSpec::from_config(&config)
    };
    let sliding = AttentionSpec {
        window: Some(keys.sliding_window),
        rope: RopeSpec {
            base: keys.rope_local_base_freq,
            scaling: RopeScaling::None,
            ..global.rope.clone()
        },
        ..global.clone()
    };
    let spec = DecoderSpec {
        layers: local
            .iter()
            .map(|&l| if l { sliding.clone() } else { global.clone() })
            .collect(),
        embedding_scale: round_to_bf16((config.hidden_size as f32).sqrt()),
        norms: NormPlacement::Sandwich,
        norm_weight_offset: 1.0,
        activation: Activation::GeluTanh,
        ..DecoderSpec::uniform(global.clone(), config.num_hidden_layers)
    };
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedding_scale_is_rounded_as_bfloat16() {
        // sqrt(640) = 25.2982...; bfloat16 keeps 8 significant bits: 25.25.
        assert_eq!(round_to_bf16(640f32.sqrt()), 25.25);
        // sqrt(1152) = 33.941...: 34.0 in bfloat16.
        assert_eq!(round_to_bf16(1152f32.sqrt()), 34.0);
        assert_eq!(round_to_bf16(1.0), 1.0);
    }
}
