//! The model layer of mlxcel: the [`Model`] trait, `config.json` parsing,
//! weight loading (MLX-format safetensors, quantized or not; GGUF files
//! through [`gguf`]), and the shared
//! layers (linear, embedding, RMSNorm, RoPE, gated MLP, and the one attention
//! layer that talks to the KV view). Families (`crates/models`) are wiring.

pub mod attention;
pub mod config;
pub mod gated_delta;
pub mod gguf;
pub mod invariant;
pub mod layers;
pub mod mamba2;
pub mod moe;
pub mod pooling;
pub mod profile;
mod recurrent;
pub mod rope;
pub mod step;
pub mod tensor_parallel;
pub mod weights;

pub use config::ModelConfig;
pub use layers::WeightMode;
pub use step::{AttentionPath, RowInput, Step, StepGraph, StepMismatch, StepRow};
pub use tensor_parallel::TensorParallel;
pub use weights::Weights;

use mlxcel_kv::{AttentionKv, KvLayout, LayerState};
use mlxcel_mlx::{Array, Dtype};

/// Errors of model loading and forward passes.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ModelError {
    /// A checkpoint file that could not be read.
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::sync::Arc<std::io::Error>,
    },
    #[error("bad config.json: {0}")]
    Config(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("weights: {0}")]
    Weights(String),
    #[error("checkpoint has no tensor {0}")]
    MissingWeight(String),
    /// A step that does not match its KV view (a bug above the model).
    #[error("step: {0}")]
    StepMismatch(#[from] StepMismatch),
    #[error(transparent)]
    Kv(#[from] mlxcel_kv::KvError),
    #[error(transparent)]
    Mlx(#[from] mlxcel_mlx::Error),
}

impl ModelError {
    /// An I/O error reading `path`.
    pub fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source: std::sync::Arc::new(source),
        }
    }
}

/// How to load a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadOptions {
    /// Compute dtype of activations and dense weights.
    pub dtype: Dtype,
    /// Quantized weights kept quantized or dequantized at load.
    pub weight_mode: WeightMode,
    /// Which of a GGUF file's floating-point matrices are quantized at
    /// load (`--quantize`; see `gguf::GgufModel::weights_requantized`);
    /// `None` keeps them as the file has them. Directories ignore it.
    pub quantize: Option<gguf::Requantize>,
}

/// A causal language model that runs one step: several sequences' next
/// tokens (rows) against their KV caches, in one forward.
pub trait Model: Send {
    /// The model's hyper-parameters.
    fn config(&self) -> &ModelConfig;

    /// Builds one step's graph over `rows` (row `r`'s tokens at the
    /// positions `kv.new_positions(r)`, already reserved in the cache) and
    /// returns its float32 next-token logits `[wanted positions, vocab]`
    /// (per row in row order, the positions of its [`StepRow::logits`];
    /// see [`Step::logit_indices`]) and the final hidden states of the
    /// positions of the rows' [`StepRow::hidden`] ([`StepGraph`]),
    /// **not evaluated**: the caller evaluates them together
    /// with `kv.storage()` (the K/V of every token, pad tokens too, are
    /// written through `kv`), synchronously or with `async_eval`. The caller
    /// rewinds pads and, on error, the whole step.
    ///
    /// `ids`, when given, is a uint32 `[tokens]` array of the step's packed
    /// token ids that replaces the rows' inputs (which then only give each
    /// row's length): a pipelined decode step feeds the previous step's
    /// sampled tokens without reading them back.
    ///
    /// # Errors
    /// Rows that don't match the view, or an MLX failure while building.
    fn build_step(
        &self,
        rows: &[StepRow<'_>],
        ids: Option<&Array>,
        kv: &mut dyn AttentionKv,
        path: AttentionPath,
    ) -> Result<StepGraph, ModelError>;

    /// [`Model::build_step`] from the rows' host tokens, evaluated (logits
    /// and the cache's writes).
    ///
    /// # Errors
    /// As [`Model::build_step`], and MLX failures during evaluation.
    fn forward(
        &self,
        rows: &[StepRow<'_>],
        kv: &mut dyn AttentionKv,
        path: AttentionPath,
    ) -> Result<Array, ModelError> {
        let logits = self.build_step(rows, None, kv, path)?.logits;
        let mut outputs: Vec<&Array> = vec![&logits];
        outputs.extend(kv.storage());
        mlxcel_mlx::eval(&outputs)?;
        drop(outputs);
        Ok(logits)
    }

    /// Compute dtype.
    fn dtype(&self) -> Dtype;

    /// Each layer's attention window in keys (a query sees at most this
    /// many, itself included), `None` for full attention: `[layers]`, from
    /// the layers' [`attention::AttentionSpec::window`]. The engine groups
    /// layers by window into KV groups (`mlxcel_kv::KvGroupConfig`). The
    /// default, for a model without per-layer specs, is the config's
    /// `sliding_window` on every layer.
    fn layer_windows(&self) -> Vec<Option<usize>> {
        let c = self.config();
        vec![c.sliding_window; c.num_hidden_layers]
    }

    /// What each layer keeps per sequence between steps, `[layers]`: K/V
    /// within its window for attention layers, a fixed-size state for
    /// recurrent ones. The engine builds the KV cache from it (and refuses
    /// a kind of state it cannot store). The default: every layer an
    /// attention layer of [`Model::layer_windows`].
    fn layer_states(&self) -> Vec<LayerState> {
        self.layer_windows()
            .into_iter()
            .map(|window| LayerState::Attention { window })
            .collect()
    }

    /// The input embeddings of `ids` as a token row feeds them to the
    /// first layer, `[ids.len(), hidden]` in the compute dtype (any
    /// embedding scale of the family applied): what
    /// [`RowInput::Embeddings`] takes, for rows mixing text with other
    /// inputs.
    ///
    /// # Errors
    /// An id outside the embedding table, MLX failures.
    fn embed_tokens(&self, ids: &[u32]) -> Result<Array, ModelError>;

    /// One token's K/V shape, for sizing the KV cache (under tensor
    /// parallelism, this rank's K/V heads only).
    fn kv_layout(&self) -> KvLayout {
        let c = self.config();
        let ranks = c.tensor_parallel.map_or(1, |tp| tp.size);
        KvLayout {
            layers: c.num_hidden_layers,
            kv_heads: c.num_key_value_heads / ranks,
            head_dim: c.head_dim,
            dtype: self.dtype(),
            kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
        }
    }
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
