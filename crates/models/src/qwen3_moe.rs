//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head
//! q/k RMSNorms, no biases) and a sparse MoE block in place of the MLP on
//! every `decoder_sparse_step`-th layer not listed in `mlp_only_layers`:
//! `num_experts` SwiGLU experts of `moe_intermediate_size`, softmax routing
//! to the top `num_experts_per_tok`, renormalised when `norm_topk_prob`.
//! Reference: mlx_lm's `models/qwen3_moe.py`.

use mlxcel_model::gguf::arch::{
    keep_tensor, LLAMA_LAYER_TENSORS, MOE_LAYER_TENSORS, QK_NORM_LAYER_TENSORS,
};
use mlxcel_model::gguf::{GgufArch, Meta};
use mlxcel_model::moe::{ExpertNames, MoeSpec, Routing};
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use crate::decoder::{Decoder, DecoderSpec, SparseLayers};
use crate::Family;

pub const FAMILY: Family = Family {
    name: "qwen3_moe",
    model_types: &["qwen3_moe"],
    configure,
    load,
    gguf: &[GGUF],
};

/// llama.cpp's `qwen3moe` GGUF architecture: Qwen3's attention tensors,
/// the router `ffn_gate_inp` and the stacked experts `ffn_{gate,up,down}_exps`
/// (`[experts, out, in]` once read, as mlx_lm stacks them).
const GGUF: GgufArch = GgufArch {
    name: "qwen3moe",
    model_type: "qwen3_moe",
    layer_tensors: &[
        LLAMA_LAYER_TENSORS,
        QK_NORM_LAYER_TENSORS,
        MOE_LAYER_TENSORS,
    ],
    extra_config: gguf_config,
    fix_tensor: keep_tensor,
};

/// The MoE keys of a `qwen3moe` GGUF: `expert_count`, `expert_used_count`,
/// `expert_feed_forward_length`; scores renormalised (llama.cpp's Qwen3-MoE
/// graph always does); a layer without a router (`ffn_gate_inp`) keeps a
/// dense MLP (`mlp_only_layers`).
///
/// # Errors
/// A missing expert key.
fn gguf_config(meta: &Meta<'_>, c: &mut Map<String, Json>) -> Result<(), ModelError> {
    let required = |key: &str| meta.required_uint(key);
    c.insert("num_experts".into(), json!(required("expert_count")?));
    c.insert(
        "num_experts_per_tok".into(),
        json!(required("expert_used_count")?),
    );
    c.insert(
        "moe_intermediate_size".into(),
        json!(required("expert_feed_forward_length")?),
    );
    c.insert("norm_topk_prob".into(), json!(true));
    c.insert("decoder_sparse_step".into(), json!(1));
    let layers = required("block_count")?;
    // The layers with a router, from the tensors the file has (a corrupt
    // block count cannot make this loop long).
    if layers > meta.header.tensors.len() as u64 {
        return Err(ModelError::Config(format!(
            "GGUF block_count {layers} with {} tensors",
            meta.header.tensors.len()
        )));
    }
    let routed: std::collections::BTreeSet<u64> = meta
        .header
        .tensors
        .iter()
        .filter_map(|t| {
            let layer = t
                .name
                .strip_prefix("blk.")?
                .strip_suffix(".ffn_gate_inp.weight")?;
            layer.parse().ok()
        })
        .collect();
    let dense: Vec<u64> = (0..layers).filter(|i| !routed.contains(i)).collect();
    c.insert("mlp_only_layers".into(), json!(dense));
    Ok(())
}

/// The MoE keys Qwen2-MoE and Qwen3-MoE share (Hugging Face's names and
/// defaults).
#[derive(Deserialize)]
pub(crate) struct QwenMoeKeys {
    num_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    #[serde(default = "one")]
    decoder_sparse_step: usize,
    #[serde(default)]
    mlp_only_layers: Option<Vec<usize>>,
    #[serde(default)]
    norm_topk_prob: bool,
}

fn one() -> usize {
    1
}

impl QwenMoeKeys {
    /// The sparse layers these keys describe, each a block of softmax
    /// routing (renormalised with `norm_topk_prob`) under `mlp`, with a
    /// shared expert of `shared_expert` rows when given.
    ///
    /// # Errors
    /// A `decoder_sparse_step` of 0.
    pub(crate) fn sparse_layers(
        &self,
        layers: usize,
        shared_expert: Option<usize>,
    ) -> Result<SparseLayers, ModelError> {
        Ok(SparseLayers {
            spec: MoeSpec {
                experts: self.num_experts,
                top_k: self.num_experts_per_tok,
                expert_hidden: self.moe_intermediate_size,
                routing: Routing::SoftmaxTopK {
                    normalize: self.norm_topk_prob,
                },
                per_expert_names: ExpertNames::PROJ,
                shared_expert,
                activation: Default::default(),
                glu: Default::default(),
                layout: Default::default(),
            },
            layers: sparse_layers(
                layers,
                self.num_experts,
                self.decoder_sparse_step,
                self.mlp_only_layers.as_deref().unwrap_or_default(),
            )?,
            path: "mlp",
        })
    }
}

/// Qwen2's reading (no window unless `use_sliding_window`), an untied head
/// unless the config ties it.
fn configure(config: &mut ModelConfig) -> Result<(), ModelError> {
    crate::qwen2::configure(config)?;
    crate::untied_unless_said(config, None);
    Ok(())
}

/// The sparse layers of Qwen2/3-MoE (Hugging Face's reading of
/// `decoder_sparse_step` and `mlp_only_layers`): every `step`-th (1-based)
/// layer not in `dense`; none when there are no experts.
///
/// # Errors
/// A `decoder_sparse_step` of 0.
fn sparse_layers(
    layers: usize,
    experts: usize,
    step: usize,
    dense: &[usize],
) -> Result<Vec<bool>, ModelError> {
    if step == 0 {
        return Err(ModelError::Config("decoder_sparse_step is 0".into()));
    }
    Ok((0..layers)
        .map(|i| experts > 0 && !dense.contains(&i) && (i + 1) % step == 0)
        .collect())
}

fn load(
    config: ModelConfig,
    weights: &mut Weights,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let keys: QwenMoeKeys = crate::own_keys(&config)?;
    let moe = keys.sparse_layers(config.num_hidden_layers, None)?;
    let spec = DecoderSpec {
        moe: Some(moe),
        ..DecoderSpec::uniform(crate::qwen3::attention(&config), config.num_hidden_layers)
    };
    Ok(Box::new(Decoder::load(config, &spec, weights, options)?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn sparse_layers_follow_the_step_and_the_dense_list() {
        let v = super::sparse_layers(6, 8, 2, &[3]).unwrap();
        assert_eq!(v, vec![false, true, false, false, false, true]);
        assert_eq!(super::sparse_layers(3, 0, 1, &[]).unwrap(), vec![false; 3]);
        assert!(super::sparse_layers(3, 8, 0, &[]).is_err());
    }
}
