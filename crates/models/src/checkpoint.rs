//! A checkpoint opened once per start: a directory (`config.json` and
//! safetensors, read when asked) or a GGUF file, whose header (metadata,
//! the whole vocabulary, tensor descriptions) is read and checked at
//! [`Checkpoint::open`] and then serves the config, the tokenizer builders
//! ([`Checkpoint::gguf_header`]) and the weights.

use std::path::{Path, PathBuf};

use mlxcel_model::gguf::{self, GgufHeader, GgufModel};
use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};

use crate::{family, gguf_arch};

/// An opened checkpoint: a directory, or a GGUF file with its header.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    /// The GGUF file's header and mapping; `None` for a directory.
    gguf: Option<GgufModel>,
}

impl Checkpoint {
    /// Opens `path`: a GGUF file (a file named `*.gguf`: its header is
    /// read and checked here, the one read of it) or a checkpoint
    /// directory (nothing is read until [`Checkpoint::config`]).
    ///
    /// # Errors
    /// For GGUF: an unreadable or invalid file, an unsupported architecture
    /// (named, with the supported ones), tensors of unsupported types or
    /// unknown names (as [`GgufModel::open`]).
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let gguf = if gguf::is_gguf(path) {
            Some(GgufModel::open(path, gguf_arch)?)
        } else {
            None
        };
        Ok(Checkpoint {
            path: path.to_path_buf(),
            gguf,
        })
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The config as the checkpoint's family reads it: `config.json` of a
    /// directory, or the one a GGUF file's metadata describes
    /// (`mlxcel_model::gguf`).
    ///
    /// # Errors
    /// Missing or malformed `config.json`, an unsupported `model_type`, or
    /// a family's refusal of the config; for GGUF, metadata that does not
    /// describe a config (a missing size key, a value of the wrong type).
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        let mut config = match &self.gguf {
            Some(file) => file.config()?,
            None => ModelConfig::from_model_dir(&self.path)?,
        };
        (family(&config.model_type)?.configure)(&mut config)?;
        Ok(config)
    }

    /// The GGUF file (header and mapping); `None` for a directory.
    pub fn gguf(&self) -> Option<&GgufModel> {
        self.gguf.as_ref()
    }

    /// The GGUF header (the tokenizer's and chat template's metadata);
    /// `None` for a directory.
    pub fn gguf_header(&self) -> Option<&GgufHeader> {
        self.gguf.as_ref().map(|g| &g.header)
    }

    /// Loads the model with its family, for `config` (from
    /// [`Checkpoint::config`], possibly adjusted: tensor parallelism).
    /// Consumes the checkpoint: a GGUF header is dropped once the weights
    /// are read.
    ///
    /// # Errors
    /// An unsupported `model_type`, or any loading error of the family.
    pub fn load_model(
        self,
        mut config: ModelConfig,
        options: LoadOptions,
    ) -> Result<Box<dyn Model>, ModelError> {
        let family = family(&config.model_type)?;
        let mut weights = match &self.gguf {
            Some(file) => match options.quantize {
                Some(policy) => file.weights_requantized(&mut config, policy)?.0,
                None => file.weights(&config)?,
            },
            None => Weights::open(&self.path)?,
        };
        drop(self);
        tracing::info!(family = family.name, model_type = %config.model_type, "loading model");
        (family.load)(config, &mut weights, options)
    }
}
