//! GGUF checkpoints (llama.cpp's single-file format) read as the
//! checkpoints the families already load: the metadata becomes a
//! `config.json` ([`arch::config_json`]), the tensors get the checkpoint's
//! names and layout ([`arch::checkpoint_name`], [`Arch::fix_tensor`]).
//!
//! The header is read and checked in Rust ([`reader`]); the tensor data is
//! read by MLX's GGUF loader, which keeps Q4_0, Q4_1, Q4_K and Q8_0 as MLX
//! affine quantized weights (group size 32, float16 scales and biases) and
//! dequantizes Q6_K to float16. The tokenizer's metadata is read by
//! mlxcel-engine from [`GgufModel::header`]. Format: ggml's `docs/gguf.md`.

pub mod arch;
pub mod reader;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use arch::{Arch, ARCHS};
pub use reader::{GgufHeader, TensorInfo, TensorType, Value};

use crate::{ModelConfig, ModelError, Weights};

/// Whether `path` names a GGUF file (a file whose name ends in `.gguf`).
pub fn is_gguf(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A GGUF file whose header was read and checked: a supported
/// architecture, every tensor of a supported type and known to it.
#[derive(Debug, Clone)]
pub struct GgufModel {
    pub path: PathBuf,
    pub header: GgufHeader,
    arch: &'static Arch,
}

impl GgufModel {
    /// Reads the header of `path` and checks that mlxcel can serve it.
    ///
    /// # Errors
    /// [`ModelError::Io`] for an unreadable file; [`ModelError::Weights`]
    /// for a file that is not valid GGUF; [`ModelError::Unsupported`]
    /// naming an unsupported architecture, or the tensors of unsupported
    /// types (with the type) or unknown names.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let header = GgufHeader::read(path)?;
        let name = header
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| ModelError::Config("GGUF has no general.architecture".into()))?;
        let arch = arch::arch(name)?;
        let mut unsupported: Vec<String> = header
            .tensors
            .iter()
            .filter(|t| !t.ty.is_supported())
            .map(|t| format!("{} ({})", t.name, t.ty))
            .collect();
        if !unsupported.is_empty() {
            let total = unsupported.len();
            unsupported.truncate(4);
            return Err(ModelError::Unsupported(format!(
                "GGUF tensor types: {total} tensors, e.g. {} (supported: F32, F16, Q4_0, Q4_1, \
                 Q4_K, Q8_0, Q6_K)",
                unsupported.join(", ")
            )));
        }
        let unknown: Vec<&str> = header
            .tensors
            .iter()
            .filter(|t| arch::checkpoint_name(arch, &t.name).is_none())
            .map(|t| t.name.as_str())
            .collect();
        if !unknown.is_empty() {
            return Err(ModelError::Unsupported(format!(
                "GGUF tensors the {} architecture does not know: {}",
                arch.name,
                unknown.join(", ")
            )));
        }
        Ok(GgufModel {
            path: path.to_path_buf(),
            header,
            arch,
        })
    }

    /// The architecture table entry.
    pub fn arch(&self) -> &'static Arch {
        self.arch
    }

    /// The shared config, before the family's own reading: the metadata's
    /// `config.json` ([`arch::config_json`]) plus the `quantization` of
    /// the tensors MLX keeps quantized (per module: group size 32, 4 or 8
    /// bits).
    ///
    /// # Errors
    /// As [`arch::config_json`] and [`ModelConfig::from_json_str`].
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        let arch = self.arch();
        let mut json = arch::config_json(arch, &self.header)?;
        let mut quantization = serde_json::Map::new();
        for t in &self.header.tensors {
            let (Some(bits), Some(name)) = (
                t.ty.mlx_quantized_bits(),
                arch::checkpoint_name(arch, &t.name),
            ) else {
                continue;
            };
            let module = name.strip_suffix(".weight").unwrap_or(&name);
            quantization.insert(
                module.to_string(),
                serde_json::json!({"group_size": 32, "bits": bits}),
            );
        }
        if let Some(obj) = json.as_object_mut() {
            obj.insert("quantization".into(), quantization.into());
        }
        ModelConfig::from_json_str(&json.to_string())
    }

    /// Reads every tensor with MLX's loader, under its checkpoint name,
    /// rewritten by the architecture for `config` (the config the family
    /// has read).
    ///
    /// # Errors
    /// MLX failing to read the file, a tensor MLX returns that the
    /// architecture does not know, or a tensor that does not fit `config`.
    pub fn weights(&self, config: &ModelConfig) -> Result<Weights, ModelError> {
        let arch = self.arch();
        tracing::info!(file = %self.path.display(), arch = arch.name, "loading GGUF tensors");
        let mut file = mlxcel_mlx::SafeTensors::load_gguf(&self.path)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", self.path.display())))?;
        let mut arrays = HashMap::new();
        for gguf in file.names() {
            let name = arch::checkpoint_name(arch, &gguf).ok_or_else(|| {
                ModelError::Unsupported(format!("GGUF tensor {gguf} ({} architecture)", arch.name))
            })?;
            let array = (arch.fix_tensor)(&name, file.take(&gguf)?, config)?;
            arrays.insert(name, array);
        }
        Ok(Weights::from_arrays(arrays))
    }
}
