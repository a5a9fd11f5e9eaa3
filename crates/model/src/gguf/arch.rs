//! What each GGUF architecture becomes: its `model_type`, the config keys
//! read from its metadata, its tensor names, and the tensors it must
//! rewrite. Adding an architecture is one [`Arch`] in [`ARCHS`] (see
//! docs/adding-a-family.md, "GGUF checkpoints").

use mlxcel_mlx::Array;
use serde_json::{json, Map, Value as Json};

use super::{GgufHeader, Meta};
use crate::{ModelConfig, ModelError};

/// One GGUF architecture (`general.architecture`).
pub struct Arch {
    /// `general.architecture` (also the prefix of its metadata keys:
    /// `llama.block_count`).
    pub name: &'static str,
    /// The `config.json` `model_type` whose family serves it.
    pub model_type: &'static str,
    /// GGUF per-layer tensor names (`blk.N.{gguf}`) and the checkpoint
    /// names they become (`model.layers.N.{hf}`).
    pub layer_tensors: &'static [(&'static str, &'static str)],
    /// Adds the architecture's own config keys to the shared ones that
    /// [`config_json`] wrote.
    pub extra_config: fn(&Meta<'_>, &mut Map<String, Json>) -> Result<(), ModelError>,
    /// Rewrites a tensor, by its checkpoint name, after renaming (llama:
    /// the q/k rows back to the checkpoint's RoPE layout).
    pub fix_tensor: fn(&str, Array, &ModelConfig) -> Result<Array, ModelError>,
}

impl std::fmt::Debug for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arch")
            .field("name", &self.name)
            .field("model_type", &self.model_type)
            .finish_non_exhaustive()
    }
}

/// Every architecture served from GGUF.
pub const ARCHS: &[Arch] = &[
    Arch {
        name: "llama",
        model_type: "llama",
        layer_tensors: LLAMA_LAYER_TENSORS,
        extra_config: no_extra_config,
        fix_tensor: unpermute_qk,
    },
    Arch {
        name: "qwen2",
        model_type: "qwen2",
        layer_tensors: LLAMA_LAYER_TENSORS,
        extra_config: no_extra_config,
        fix_tensor: keep_tensor,
    },
    Arch {
        name: "qwen3",
        model_type: "qwen3",
        layer_tensors: QWEN3_LAYER_TENSORS,
        extra_config: no_extra_config,
        fix_tensor: keep_tensor,
    },
    Arch {
        name: "gemma3",
        model_type: "gemma3_text",
        layer_tensors: GEMMA3_LAYER_TENSORS,
        extra_config: gemma3_config,
        fix_tensor: gemma_norms,
    },
];

/// The decoder-layer tensors of llama-like architectures (names from
/// llama.cpp's `gguf-py` tensor map).
const LLAMA_LAYER_TENSORS: &[(&str, &str)] = &[
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

/// The decoder-layer tensors of Qwen3: llama's plus per-head RMSNorms of
/// q and k (llama.cpp leaves Qwen's q/k rows in the checkpoint's order:
/// its RoPE for Qwen rotates halves, as the checkpoint's does).
const QWEN3_LAYER_TENSORS: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// The decoder-layer tensors of Gemma 3 (sandwich norms: `ffn_norm` is
/// the norm before the MLP, `post_ffw_norm` the one after it).
const GEMMA3_LAYER_TENSORS: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Tensors outside the layers, shared by every architecture.
const MODEL_TENSORS: &[(&str, &str)] = &[
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
    // Llama 3.1-style RoPE divisors: read into the config, not a weight.
    ("rope_freqs", "rope_freqs"),
];

/// The architecture named `name`.
///
/// # Errors
/// [`ModelError::Unsupported`] naming it and the supported ones.
pub fn arch(name: &str) -> Result<&'static Arch, ModelError> {
    ARCHS.iter().find(|a| a.name == name).ok_or_else(|| {
        let names: Vec<&str> = ARCHS.iter().map(|a| a.name).collect();
        ModelError::Unsupported(format!(
            "GGUF architecture {name} (supported: {})",
            names.join(", ")
        ))
    })
}

/// The checkpoint name of GGUF tensor `gguf` (`blk.3.attn_q.weight` ->
/// `model.layers.3.self_attn.q_proj.weight`; MLX's `.scales` / `.biases`
/// of a quantized tensor follow its `.weight`), or `None` when the
/// architecture has no such tensor.
pub fn checkpoint_name(arch: &Arch, gguf: &str) -> Option<String> {
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
pub fn config_json(arch: &Arch, header: &GgufHeader) -> Result<Json, ModelError> {
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

fn no_extra_config(_: &Meta<'_>, _: &mut Map<String, Json>) -> Result<(), ModelError> {
    Ok(())
}

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

fn keep_tensor(_: &str, a: Array, _: &ModelConfig) -> Result<Array, ModelError> {
    Ok(a)
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

    #[test]
    fn names_map_to_the_checkpoint_layout() {
        let llama = arch("llama").unwrap();
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

    #[test]
    fn unknown_architectures_are_named() {
        let err = arch("mamba").err().unwrap().to_string();
        assert!(
            err.contains("mamba") && err.contains("llama, qwen2, qwen3, gemma3"),
            "{err}"
        );
    }
}
