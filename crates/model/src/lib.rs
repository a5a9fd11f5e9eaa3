//! The model layer of mlxcel: the [`Model`] trait, `config.json` parsing,
//! weight loading (MLX-format safetensors, quantized or not), and the shared
//! layers (linear, embedding, RMSNorm, RoPE, gated MLP, and the one attention
//! layer that talks to the KV view). Families (`crates/models/*`) are wiring.

pub mod attention;
pub mod config;
pub mod kv_view;
pub mod layers;
pub mod rope;
pub mod weights;

pub use config::ModelConfig;
pub use kv_view::DenseSequenceCache;
pub use layers::WeightMode;
pub use weights::Weights;

use mlxcel_mlx::{Array, Dtype};
use std::path::Path;

/// Errors of model loading and forward passes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Io(String),
    #[error("bad config.json: {0}")]
    Config(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("weights: {0}")]
    Weights(String),
    #[error("checkpoint has no tensor {0}")]
    MissingWeight(String),
    #[error("kv cache: {0}")]
    Cache(String),
    #[error(transparent)]
    Mlx(#[from] mlxcel_mlx::Error),
}

/// How to load a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadOptions {
    /// Compute dtype of activations and dense weights.
    pub dtype: Dtype,
    /// Quantized weights kept quantized or dequantized at load.
    pub weight_mode: WeightMode,
}

/// A causal language model that runs one sequence's new tokens against its
/// KV cache.
pub trait Model: Send {
    /// The model's hyper-parameters.
    fn config(&self) -> &ModelConfig;

    /// Runs `tokens` (the sequence's next tokens, at positions
    /// `cache.next_position()..`) and returns float32 logits `[vocab]` of the
    /// last one. On success the tokens are live in `cache`; on error the
    /// cache is as it was.
    fn forward(&self, tokens: &[u32], cache: &mut DenseSequenceCache) -> Result<Array, ModelError>;

    /// An empty KV cache for this model.
    fn new_cache(&self) -> DenseSequenceCache {
        let c = self.config();
        DenseSequenceCache::new(
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            self.dtype(),
        )
    }

    /// Compute dtype.
    fn dtype(&self) -> Dtype;
}

/// The compute dtype for `--dtype auto`: float32 on CPU (MLX's CPU float16
/// quantized matmul is ~35x slower than float32), the checkpoint's dtype on a
/// GPU (float16 when unknown).
pub fn auto_dtype(config: &ModelConfig, gpu: bool) -> Dtype {
    if !gpu {
        return Dtype::Float32;
    }
    config
        .torch_dtype
        .as_deref()
        .and_then(Dtype::parse_float)
        .unwrap_or(Dtype::Float16)
}

/// Reads `config.json` of a model directory (a convenience for front ends).
pub fn read_config(dir: &Path) -> Result<ModelConfig, ModelError> {
    ModelConfig::from_model_dir(dir)
}
