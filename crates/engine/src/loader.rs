//! Loading a checkpoint, shared by the engine's start-up and a
//! tensor-parallel follower: the device settings a configuration asks for,
//! the compute types, the text side and the model. The registry of
//! `mlxcel-models` picks the family for its `model_type` (re-exported here
//! for front ends and tests); a checkpoint is a directory or a GGUF file,
//! opened once ([`Checkpoint::open`]: a GGUF header is read once per
//! start).

use std::path::Path;

pub use mlxcel_model::gguf::is_gguf;
pub use mlxcel_models::{load_model, read_config, Checkpoint};

use mlxcel_mlx::Dtype;
use mlxcel_model::gguf::Requantize;
use mlxcel_model::{LoadOptions, Model, ModelConfig, TensorParallel, WeightMode};
use mlxcel_text::Text;

use crate::config::{EngineConfig, GgufQuantize, GGUF_QUANTIZE_GROUP};
use crate::error::EngineError;

/// The text side of `checkpoint` (a directory or a GGUF file): its
/// tokenizer, chat template (`template_file` if given, else the model's
/// own), EOS ids and grammar vocabulary for `vocab_size` logit rows
/// ([`Text::from_model_dir`], [`Text::from_gguf_header`] on the header the
/// checkpoint already read).
///
/// # Errors
/// An unreadable or unsupported tokenizer, a template that does not
/// compile.
pub fn load_text(
    checkpoint: &Checkpoint,
    template_file: Option<&Path>,
    vocab_size: usize,
) -> Result<Text, EngineError> {
    let path = checkpoint.path();
    Ok(match checkpoint.gguf_header() {
        Some(header) => Text::from_gguf_header(path, header, template_file, vocab_size)?,
        None => Text::from_model_dir(path, template_file, vocab_size)?,
    })
}

/// Applies `config`'s device settings to MLX (cuDNN attention, the kernel
/// cache directory, the default device) on this thread; returns whether it
/// runs on a GPU.
///
/// # Errors
/// MLX refused a setting.
pub(crate) fn prepare_device(config: &EngineConfig) -> Result<bool, EngineError> {
    let gpu = config.use_gpu && mlxcel_mlx::gpu_available();
    mlxcel_mlx::set_cudnn_attention(config.cudnn_attention)?;
    if let Some(dir) = &config.kernel_cache_dir {
        mlxcel_mlx::set_kernel_cache_dir(&dir.join(format!("mlx-{}", mlxcel_mlx::version())))?;
    }
    mlxcel_mlx::use_device(gpu)?;
    Ok(gpu)
}

/// The compute dtype, weight mode and GGUF re-quantization `config` asks
/// for on this device (`auto`: float32 and dequantized weights on a CPU,
/// the checkpoint's dtype and quantized weights on a GPU; see
/// [`GgufQuantize`]), as [`LoadOptions`].
pub(crate) fn load_options(
    config: &EngineConfig,
    model_config: &ModelConfig,
    gpu: bool,
) -> LoadOptions {
    let dtype: Dtype = config
        .dtype
        .unwrap_or_else(|| mlxcel_model::auto_dtype(model_config, gpu));
    let weight_mode = config.weight_mode.unwrap_or(if gpu {
        WeightMode::Quantized
    } else {
        WeightMode::Dequantized
    });
    let quantize = match config.quantize {
        _ if !is_gguf(&config.model_dir) => None,
        GgufQuantize::Off => None,
        _ if weight_mode == WeightMode::Dequantized => {
            if config.quantize != GgufQuantize::Auto {
                tracing::warn!("--quantize has no effect with dequantized weights");
            }
            None
        }
        GgufQuantize::Auto if gpu => Some(Requantize::MatchSource),
        GgufQuantize::Auto => None,
        GgufQuantize::Bits(bits) => Some(Requantize::All(mlxcel_model::config::QuantSpec {
            group_size: GGUF_QUANTIZE_GROUP,
            bits,
        })),
    };
    LoadOptions {
        dtype,
        weight_mode,
        quantize,
    }
}

/// A checkpoint opened for a configuration: its config (with this rank's
/// tensor-parallel shard, if any) and how it will load.
pub(crate) struct Opened {
    pub(crate) checkpoint: Checkpoint,
    pub(crate) model_config: ModelConfig,
    pub(crate) options: LoadOptions,
    pub(crate) gpu: bool,
    /// [`EngineConfig::dequant_matmul_rows`] decided for the device
    /// (`None`: never).
    pub(crate) dequant_matmul_rows: Option<usize>,
    /// [`crate::config::dequant_matmul_min_weights`] for the device.
    pub(crate) dequant_matmul_min_weights: usize,
}

impl Opened {
    /// Opens `config.model_dir` (its header read once): see
    /// [`Opened::new`].
    ///
    /// # Errors
    /// An unreadable or unsupported checkpoint, a refused device setting.
    pub(crate) fn open(
        config: &EngineConfig,
        shard: Option<TensorParallel>,
    ) -> Result<Self, EngineError> {
        Self::new(config, Checkpoint::open(&config.model_dir)?, shard)
    }

    /// `checkpoint` (of `config.model_dir`, already open) with the device
    /// settings applied and the compute types decided; under tensor
    /// parallelism the config carries this rank's `shard`.
    ///
    /// # Errors
    /// An unsupported config, a refused device setting.
    pub(crate) fn new(
        config: &EngineConfig,
        checkpoint: Checkpoint,
        shard: Option<TensorParallel>,
    ) -> Result<Self, EngineError> {
        let mut model_config = checkpoint.config()?;
        model_config.tensor_parallel = shard;
        let gpu = prepare_device(config)?;
        let options = load_options(config, &model_config, gpu);
        let dequant_matmul_rows =
            crate::config::dequant_matmul_rows(config.dequant_matmul_rows, gpu);
        let dequant_matmul_min_weights = crate::config::dequant_matmul_min_weights(gpu);
        Ok(Opened {
            checkpoint,
            model_config,
            options,
            gpu,
            dequant_matmul_rows,
            dequant_matmul_min_weights,
        })
    }

    /// Loads the model (on the calling thread's device) and sets the
    /// calling thread's dequantized-matmul row count, which the forwards it
    /// builds use.
    ///
    /// # Errors
    /// Missing or mistyped weights, an unsupported variant.
    pub(crate) fn load(self) -> Result<Box<dyn Model>, EngineError> {
        mlxcel_mlx::use_device(self.gpu)?;
        mlxcel_model::layers::set_dequantized_matmul_rows(self.dequant_matmul_rows);
        mlxcel_model::layers::set_dequantized_matmul_min_weights(self.dequant_matmul_min_weights);
        tracing::info!(
            dir = %self.checkpoint.path().display(),
            dtype = ?self.options.dtype,
            weight_mode = ?self.options.weight_mode,
            gpu = self.gpu,
            dequant_matmul_rows = ?self.dequant_matmul_rows,
            dequant_matmul_min_weights = self.dequant_matmul_min_weights,
            "loading model"
        );
        Ok(self
            .checkpoint
            .load_model(self.model_config, self.options)?)
    }
}
