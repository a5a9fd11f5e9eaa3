//! Qwen3.5 (text; dense `qwen3_5` and mixture-of-experts `qwen3_5_moe`): a
//! hybrid decoder. Three of every four layers (`full_attention_interval`,
//! or `layer_types`) mix tokens with a Gated DeltaNet (linear attention
//! with a fixed-size recurrent state per sequence,
//! `mlxcel_model::gated_delta`); the others with Qwen3's attention (per-head
//! q/k RMSNorms) whose query projection also gives a sigmoid output gate,
//! RoPE over a quarter of each head (`partial_rotary_factor`). MoE layers
//! are Qwen2-MoE's block (softmax top-k, a shared expert behind a sigmoid
//! gate). Reference: mlx_lm's `models/qwen3_5.py`, `qwen3_5_moe.py`,
//! `qwen3_next.py`.
//!
//! Checkpoints: mlx_lm's (`language_model.model.*`, convolution `[channels,
//! kernel, 1]`) and Hugging Face's (`model.language_model.*`, convolution
//! `[channels, 1, kernel]`, RMSNorms that scale by `1 + weight`). A
//! multimodal checkpoint's vision tower and the multi-token-prediction head
//! (`mtp.*`) are not loaded. Hugging Face MoE checkpoints with fused
//! `experts.gate_up_proj` need `mlx_lm.convert` first.

use mlxcel_model::attention::{AttentionSpec, QkNorm};
use mlxcel_model::gated_delta::GatedDeltaSpec;
use mlxcel_model::rope::RopeSpec;
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use serde::Deserialize;

use crate::decoder::{Decoder, DecoderSpec, LinearLayers, LinearMixer};
use crate::qwen3_moe::QwenMoeKeys;
use crate::Family;

pub const FAMILY: Family = Family {
    name: "qwen3_5",
    model_types: &["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"],
    configure,
    load,
    gguf: &[],
};

/// Qwen3.5's own keys (Hugging Face's names; mlx_lm's defaults).
#[derive(Deserialize)]
struct Qwen35Keys {
    linear_num_value_heads: usize,
    linear_num_key_heads: usize,
    linear_key_head_dim: usize,
    linear_value_head_dim: usize,
    #[serde(default = "four")]
    linear_conv_kernel_dim: usize,
    #[serde(default = "four")]
    full_attention_interval: usize,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    partial_rotary_factor: Option<f32>,
    #[serde(default)]
    num_experts: usize,
    #[serde(default)]
    shared_expert_intermediate_size: usize,
}

#[derive(Deserialize)]
struct RopeParameters {
    #[serde(default)]
    rope_theta: Option<f32>,
    #[serde(default)]
    partial_rotary_factor: Option<f32>,
}

fn four() -> usize {
    4
}

/// An untied head unless the config ties it; RoPE base 10^5 unless given
/// (top level or in `rope_parameters`).
fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    let keys: Qwen35Keys = crate::own_keys(config)?;
    crate::untied_unless_said(config, Some(100_000.0));
    if let Some(theta) = keys.rope_parameters.as_ref().and_then(|r| r.rope_theta) {
        config.rope_theta = theta;
    }
    config.sliding_window = None;
    Ok(())
}

/// mlx_lm's reading of a checkpoint's tensor names: the text model under
/// `model.`, its head `lm_head`; vision tower and MTP head dropped.
fn text_model_name(name: &str) -> Option<String> {
    if name.starts_with("vision_tower") || name.starts_with("model.visual") || name.contains("mtp.")
    {
        return None;
    }
    Some(crate::text_model_path(name))
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let keys: Qwen35Keys = crate::own_keys(&config)?;
    let layers = config.num_hidden_layers;
    let linear: Vec<bool> = match &keys.layer_types {
        Some(types) => {
            if types.len() != layers {
                return Err(ModelError::Config(format!(
                    "layer_types lists {} layers, num_hidden_layers is {layers}",
                    types.len()
                )));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "linear_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(ModelError::Config(format!("layer_types: unknown {other}"))),
                })
                .collect::<Result<_, _>>()?
        }
        None if keys.full_attention_interval == 0 => {
            return Err(ModelError::Config(
                "full_attention_interval must be at least 1".into(),
            ))
        }
        None => (0..layers)
            .map(|i| (i + 1) % keys.full_attention_interval != 0)
            .collect(),
    };
    weights.rename(text_model_name);
    if config.tie_word_embeddings {
        weights.rename(|n| (n != "lm_head.weight").then(|| n.to_string()));
    }
    // Hugging Face's checkpoints keep the convolution `[channels, 1,
    // kernel]` and RMSNorm weights as offsets from 1 (mlx_lm converts both).
    let hf_layout = match linear.iter().position(|&l| l) {
        Some(l) => {
            let shape = weights.shape(&format!("model.layers.{l}.linear_attn.conv1d.weight"))?;
            shape.last().is_some_and(|&k| k != 1)
        }
        None => false,
    };
    let norm_offset = if hf_layout { 1.0 } else { 0.0 };
    let partial = keys
        .rope_parameters
        .as_ref()
        .and_then(|r| r.partial_rotary_factor)
        .or(keys.partial_rotary_factor)
        .unwrap_or(0.25);
    let attention = AttentionSpec {
        qk_norm: Some(QkNorm {
            eps: config.rms_norm_eps,
            per_head: true,
            weight_offset: norm_offset,
        }),
        rope: RopeSpec {
            dims: ((config.head_dim as f32 * partial) as usize).max(2),
            traditional: false,
            ..RopeSpec::from_config(&config)
        },
        window: None,
        output_gate: true,
        ..AttentionSpec::from_config(&config)
    };
    let moe = if keys.num_experts > 0 {
        // mlx_lm renormalises the top-k scores unless told not to.
        let mut raw = config.raw.clone();
        if let Some(map) = raw.as_object_mut() {
            map.entry("norm_topk_prob").or_insert(true.into());
        }
        let moe: QwenMoeKeys =
            serde_json::from_value(raw).map_err(|e| ModelError::Config(e.to_string()))?;
        let shared = keys.shared_expert_intermediate_size;
        Some(moe.sparse_layers(layers, (shared > 0).then_some(shared))?)
    } else {
        None
    };
    let spec = DecoderSpec {
        norm_weight_offset: norm_offset,
        moe,
        linear: Some(LinearLayers {
            spec: LinearMixer::GatedDelta(GatedDeltaSpec {
                k_heads: keys.linear_num_key_heads,
                v_heads: keys.linear_num_value_heads,
                k_dim: keys.linear_key_head_dim,
                v_dim: keys.linear_value_head_dim,
                conv_kernel: keys.linear_conv_kernel_dim,
                eps: config.rms_norm_eps,
            }),
            layers: linear,
        }),
        ..DecoderSpec::uniform(attention, layers)
    };
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}
