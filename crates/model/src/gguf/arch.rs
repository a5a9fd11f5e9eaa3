//! The shared machinery of a GGUF architecture's mapping: what a
//! [`GgufArch`] declares (its `model_type`, the config keys read from its
//! metadata, its tensor names, the tensors it must rewrite), the tensors
//! every architecture shares, and the `config.json` its metadata becomes.
//! The architectures themselves are declared by the families that serve
//! them, next to their config (`mlxcel-models`: `Family::gguf`; see
//! docs/adding-a-family.md, "GGUF checkpoints").

use mlxcel_mlx::Array;
use serde_json::{json, Map, Value as Json};

use super::{GgufHeader, Meta};
use crate::{ModelConfig, ModelError};

/// One GGUF architecture (`general.architecture`) and how its files
/// become the checkpoint its family loads.
pub struct GgufArch {
    /// `general.architecture` (also the prefix of its metadata keys:
    /// `llama.block_count`).
    pub name: &'static str,
    /// The `config.json` `model_type` whose family serves it.
    pub model_type: &'static str,
    /// GGUF per-layer tensor names (`blk.N.{gguf}`) and the checkpoint
    /// names they become (`model.layers.N.{hf}`), in tables searched in
    /// order (e.g. llama's, then the q/k norms, then the MoE block's).
    pub layer_tensors: &'static [&'static [(&'static str, &'static str)]],
    /// Adds the architecture's own config keys to the shared ones that
    /// [`config_json`] wrote ([`no_extra_config`] when it has none).
    pub extra_config: fn(&Meta<'_>, &mut Map<String, Json>) -> Result<(), ModelError>,
    /// Rewrites a tensor, by its checkpoint name, after renaming (llama:
    /// the q/k rows back to the checkpoint's RoPE layout;
    /// [`keep_tensor`] when it rewrites none).
    pub fix_tensor: fn(&str, Array, &ModelConfig) -> Result<Array, ModelError>,
}

impl std::fmt::Debug for GgufArch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufArch")
            .field("name", &self.name)
            .field("model_type", &self.model_type)
            .finish_non_exhaustive()
    }
}

/// The decoder-layer tensors of llama-like architectures (names from
/// llama.cpp's `gguf-py` tensor map; Llama's and Qwen2's).
pub const LLAMA_LAYER_TENSORS: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Per-head RMSNorms of queries and keys (Qwen3, Gemma 3).
pub const QK_NORM_LAYER_TENSORS: &[(&str, &str)] = &[
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
];

/// A sparse MoE block under `mlp`: the router and the stacked experts
/// (`[experts, out, in]` once read, as mlx_lm stacks them).
pub const MOE_LAYER_TENSORS: &[(&str, &str)] = &[
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_exps", "mlp.switch_mlp.gate_proj"),
    ("ffn_up_exps", "mlp.switch_mlp.up_proj"),
    ("ffn_down_exps", "mlp.switch_mlp.down_proj"),
];

/// Tensors outside the layers, shared by every architecture.
const MODEL_TENSORS: &[(&str, &str)] = &[
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
    // Llama 3.1-style RoPE divisors: read into the config, not a weight.
    ("rope_freqs", "rope_freqs"),
];

/// The checkpoint name of GGUF tensor `gguf` (`blk.3.attn_q.weight` ->
/// `model.layers.3.self_attn.q_proj.weight`; MLX's `.scales` / `.biases`
/// of a quantized tensor follow its `.weight`), or `None` when the
/// architecture has no such tensor.
pub fn checkpoint_name(arch: &GgufArch, gguf: &str) -> Option<String> {
    let (stem, suffix) = gguf.rsplit_once('.')?;
    if !matches!(suffix, "weight" | "bias" | "scales" | "biases") {
        return None;
    }
    if let Some(rest) = stem.strip_prefix("blk.") {
        let (layer, name) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let hf = arch
            .layer_tensors
            .iter()
            .flat_map(|table| table.iter())
            .find(|(g, _)| *g == name)
            .map(|(_, h)| *h)?;
        return Some(format!("model.layers.{layer}.{hf}.{suffix}"));
    }
    let hf = MODEL_TENSORS.iter().find(|(g, _)| *g == stem)?.1;
    Some(format!("{hf}.{suffix}"))
}

/// The `config.json` the GGUF's metadata describes (keys as Hugging Face
/// writes them, read by [`ModelConfig::from_json_str`] and the family):
/// sizes from `{arch}.embedding_length`, `block_count`,
/// `feed_forward_length`, `attention.head_count(_kv)`,
/// `attention.key_length`, `attention.layer_norm_rms_epsilon`,
/// `context_length`, `rope.freq_base`, `rope.scaling.*` and
/// `attention.sliding_window`; the vocabulary size from the embedding's
/// rows; tied embeddings when there is no `output.weight`.
///
/// # Errors
/// A missing size key, a value of the wrong type, or a RoPE scaling type
/// other than none or linear.
pub fn config_json(arch: &GgufArch, header: &GgufHeader) -> Result<Json, ModelError> {
    let meta = Meta {
        header,
        arch: arch.name,
    };
    let heads = meta.required_uint("attention.head_count")?;
    let embed = header
        .tensor("token_embd.weight")
        .ok_or_else(|| ModelError::MissingWeight("token_embd.weight".into()))?;
    let mut c = Map::new();
    c.insert("model_type".into(), json!(arch.model_type));
    c.insert(
        "hidden_size".into(),
        json!(meta.required_uint("embedding_length")?),
    );
    c.insert(
        "num_hidden_layers".into(),
        json!(meta.required_uint("block_count")?),
    );
    c.insert(
        "intermediate_size".into(),
        json!(meta.required_uint("feed_forward_length")?),
    );
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert(
        "num_key_value_heads".into(),
        json!(meta.uint("attention.head_count_kv")?.unwrap_or(heads)),
    );
    if let Some(d) = meta.uint("attention.key_length")? {
        c.insert("head_dim".into(), json!(d));
    }
    let eps = meta
        .float("attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| {
            ModelError::Config(format!(
                "GGUF metadata has no {}.attention.layer_norm_rms_epsilon",
                arch.name
            ))
        })?;
    c.insert("rms_norm_eps".into(), json!(eps));
    c.insert("vocab_size".into(), json!(embed.shape[0]));
    if let Some(theta) = meta.float("rope.freq_base")? {
        c.insert("rope_theta".into(), json!(theta));
    }
    if let Some(n) = meta.uint("context_length")? {
        c.insert("max_position_embeddings".into(), json!(n));
    }
    if let Some(w) = meta.uint("attention.sliding_window")? {
        c.insert("sliding_window".into(), json!(w));
    }
    match meta.string("rope.scaling.type") {
        None | Some("none") => {}
        Some("linear") => {
            let factor = meta.float("rope.scaling.factor")?.unwrap_or(1.0);
            c.insert(
                "rope_scaling".into(),
                json!({"type": "linear", "factor": factor}),
            );
        }
        Some(other) => {
            return Err(ModelError::Unsupported(format!(
                "GGUF RoPE scaling {other} (supported: none, linear)"
            )))
        }
    }
    c.insert(
        "tie_word_embeddings".into(),
        json!(header.tensor("output.weight").is_none()),
    );
    (arch.extra_config)(&meta, &mut c)?;
    Ok(Json::Object(c))
}

/// The [`GgufArch::extra_config`] of an architecture whose config keys
/// are all shared ones.
pub fn no_extra_config(_: &Meta<'_>, _: &mut Map<String, Json>) -> Result<(), ModelError> {
    Ok(())
}

/// The [`GgufArch::fix_tensor`] of an architecture whose tensors need no
/// rewriting.
pub fn keep_tensor(_: &str, a: Array, _: &ModelConfig) -> Result<Array, ModelError> {
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A llama-like architecture (the shared tensor names).
    const LLAMA_LIKE: GgufArch = GgufArch {
        name: "llama",
        model_type: "llama",
        layer_tensors: &[LLAMA_LAYER_TENSORS],
        extra_config: no_extra_config,
        fix_tensor: keep_tensor,
    };

    #[test]
    fn names_map_to_the_checkpoint_layout() {
        let llama = &LLAMA_LIKE;
        let cases = [
            (
                "blk.3.attn_q.weight",
                "model.layers.3.self_attn.q_proj.weight",
            ),
            (
                "blk.0.ffn_down.scales",
                "model.layers.0.mlp.down_proj.scales",
            ),
            (
                "blk.12.ffn_norm.weight",
                "model.layers.12.post_attention_layernorm.weight",
            ),
            ("token_embd.biases", "model.embed_tokens.biases"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            // Read into the config by GgufModel, never loaded.
            ("rope_freqs.weight", "rope_freqs.weight"),
        ];
        for (gguf, hf) in cases {
            assert_eq!(checkpoint_name(llama, gguf).as_deref(), Some(hf), "{gguf}");
        }
        for unknown in [
            "rope_embd.weight",
            "blk.x.attn_q.weight",
            "blk.0.attn_sinks.weight",
        ] {
            assert_eq!(checkpoint_name(llama, unknown), None, "{unknown}");
        }
    }
}
