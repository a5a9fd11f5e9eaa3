//! GGUF checkpoints (llama.cpp's single-file format) read as the
//! checkpoints the families already load: the metadata becomes a
//! `config.json` ([`arch::config_json`]), the tensors get the checkpoint's
//! names and layout ([`arch::checkpoint_name`], [`GgufArch::fix_tensor`]).
//! Each architecture's mapping ([`GgufArch`]) is declared by the family
//! that serves it (`mlxcel-models`, `Family::gguf`); this module holds the
//! shared machinery and lists no architecture.
//!
//! The header is read and checked in Rust (`mlxcel-gguf`, no MLX:
//! [`GgufHeader`]), once per start (`mlxcel_models::Checkpoint`). When
//! MLX's GGUF loader reads every tensor type of the file, it reads the
//! tensor data: it keeps Q4_0, Q4_1, Q4_K and Q8_0 as MLX affine quantized
//! weights (group size 32, float16 scales and biases) and dequantizes Q6_K
//! to float16. A file with other types (Q5_0, Q5_1, Q5_K, BF16: llama.cpp's
//! Q4_K_M puts Q5_0 where a row is not a whole number of 256-element
//! k-quant blocks, as in Gemma 3 270M) makes MLX's loader fail on the whole
//! file, so such a file is read tensor by tensor by [`dequant`] (also
//! `mlxcel-gguf`), every tensor to float32. The tokenizer's metadata is
//! read by mlxcel-engine from [`GgufModel::header`]. Format: ggml's
//! `docs/gguf.md`.

pub mod arch;

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use mlxcel_mlx::{Array, Dtype};

pub use arch::GgufArch;
pub use mlxcel_gguf::{
    dequant, is_gguf, GgufError, GgufHeader, HeaderError, Meta, TensorInfo, TensorType, Value,
};

use crate::config::QuantSpec;
use crate::{ModelConfig, ModelError, Weights};

/// A GGUF error as the model layer reports it (the message unchanged):
/// unreadable file [`ModelError::Io`]; missing or mistyped metadata
/// [`ModelError::Config`]; an invalid header or tensor data
/// [`ModelError::Weights`].
impl From<GgufError> for ModelError {
    fn from(e: GgufError) -> Self {
        match e {
            GgufError::Io { path, source } => ModelError::io(path, source),
            GgufError::MissingKey(_) | GgufError::KeyType { .. } => {
                ModelError::Config(e.to_string())
            }
            GgufError::Invalid { .. }
            | GgufError::NoDecoder(_)
            | GgufError::PartialBlocks { .. } => ModelError::Weights(e.to_string()),
        }
    }
}

/// Group size of `--quantize`: 32, the group llama.cpp's own 4- and
/// 8-bit types use (and what MLX's GGUF loader gives Q4_0/Q8_0); 64
/// measurably hurts small models.
pub const REQUANTIZE_GROUP: i32 = 32;

/// `--quantize`: which floating-point matrices of a GGUF file are
/// quantized at load (see [`GgufModel::weights_requantized`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requantize {
    /// Every one, to this spec (`--quantize 4` or `8`).
    All(QuantSpec),
    /// Each to about the precision the file stored it at, group
    /// [`REQUANTIZE_GROUP`]: 4 bits for 4-bit GGUF types (Q4_0, Q4_1,
    /// Q4_K), 8 bits for the 5- to 8-bit ones (Q5_0, Q5_1, Q5_K, Q6_K,
    /// Q8_0); F32, F16 and BF16 tensors stay as they are (`--quantize
    /// auto` on a GPU).
    MatchSource,
}

impl Requantize {
    /// The spec of a matrix stored as `source`, or `None` to keep it.
    pub fn spec_for(self, source: TensorType) -> Option<QuantSpec> {
        match self {
            Requantize::All(spec) => Some(spec),
            Requantize::MatchSource => source.stored_bits().map(|bits| QuantSpec {
                group_size: REQUANTIZE_GROUP,
                bits: if bits <= 4 { 4 } else { 8 },
            }),
        }
    }
}

/// The tensors read so far under their checkpoint names, and the modules
/// quantized on the way (for `config.quantization`).
#[derive(Default)]
struct Loaded {
    arrays: HashMap<String, Array>,
    quantized: Vec<(String, QuantSpec)>,
}

impl Loaded {
    /// Adds tensor `name` (already renamed and rewritten), quantized first
    /// to `spec` when it is a floating-point matrix whose rows are a whole
    /// number of groups (see [`GgufModel::weights_requantized`]).
    fn insert(
        &mut self,
        name: String,
        array: Array,
        spec: Option<QuantSpec>,
    ) -> Result<(), ModelError> {
        let shape = array.shape();
        // Matrices, and the stacked matrices of a layer's experts
        // (`[experts, out, in]`: MLX quantizes along the last axis).
        let matrix = shape.len() == 2 || (shape.len() == 3 && name.contains(".switch_mlp."));
        let row = shape.last().copied().unwrap_or(0);
        let spec = spec.filter(|s| {
            matrix
                && matches!(
                    array.dtype(),
                    Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16
                )
                && row > 0
                && usize::try_from(s.group_size)
                    .is_ok_and(|g| g > 0 && (row as usize).is_multiple_of(g))
        });
        match (spec, name.strip_suffix(".weight")) {
            (Some(spec), Some(module)) => {
                let module = module.to_string();
                let (q, scales, biases) = array.quantize(spec.group_size, spec.bits)?;
                mlxcel_mlx::eval(&[&q, &scales, &biases])?;
                self.arrays.insert(name, q);
                self.arrays.insert(format!("{module}.scales"), scales);
                self.arrays.insert(format!("{module}.biases"), biases);
                self.quantized.push((module, spec));
            }
            _ => {
                self.arrays.insert(name, array);
            }
        }
        Ok(())
    }
}

/// The spec `policy` gives tensor `name`, stored as `source`, unless its
/// module is already quantized in the file.
fn requantize_spec(
    policy: Option<Requantize>,
    source: Option<TensorType>,
    name: &str,
    config: &ModelConfig,
) -> Option<QuantSpec> {
    let module = name.strip_suffix(".weight")?;
    if config.quantization.for_module(module).is_some() {
        return None;
    }
    policy?.spec_for(source?)
}

/// A GGUF file whose header was read and checked: a supported
/// architecture, every tensor of a supported type and known to it.
#[derive(Debug, Clone)]
pub struct GgufModel {
    pub path: PathBuf,
    pub header: GgufHeader,
    arch: &'static GgufArch,
}

impl GgufModel {
    /// Reads the header of `path` (the one read of it: the tokenizer's
    /// metadata is [`GgufModel::header`] too) and checks that mlxcel can
    /// serve it, with the mapping `find_arch` gives its
    /// `general.architecture` (the family registry's lookup).
    ///
    /// # Errors
    /// [`ModelError::Io`] for an unreadable file; [`ModelError::Weights`]
    /// for a file that is not valid GGUF; [`ModelError::Config`] for a file
    /// without `general.architecture`; `find_arch`'s error for an
    /// unsupported architecture; [`ModelError::Unsupported`] naming the
    /// tensors of unsupported types (with the type) or unknown names.
    pub fn open(
        path: &Path,
        find_arch: impl FnOnce(&str) -> Result<&'static GgufArch, ModelError>,
    ) -> Result<Self, ModelError> {
        let header = GgufHeader::read(path)?;
        let name = header
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| ModelError::Config("GGUF has no general.architecture".into()))?;
        let arch = find_arch(name)?;
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
                "GGUF tensor types: {total} tensors, e.g. {} (supported: F32, F16, BF16, Q4_0, \
                 Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)",
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

    /// The architecture's mapping.
    pub fn arch(&self) -> &'static GgufArch {
        self.arch
    }

    /// Whether MLX's loader reads every tensor of the file (see the module
    /// docs); otherwise [`GgufModel::weights`] decodes them to float32.
    pub fn mlx_reads_all(&self) -> bool {
        self.header.tensors.iter().all(|t| t.ty.mlx_reads())
    }

    /// The shared config, before the family's own reading: the metadata's
    /// `config.json` ([`arch::config_json`]) plus the `quantization` of
    /// the tensors MLX keeps quantized (per module: group size 32, 4 or 8
    /// bits; none when [`GgufModel::mlx_reads_all`] is false).
    ///
    /// # Errors
    /// As [`arch::config_json`] and [`ModelConfig::from_json_str`].
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        let arch = self.arch();
        let mut json = arch::config_json(arch, &self.header)?;
        let mut quantization = serde_json::Map::new();
        let quantized = self.mlx_reads_all();
        for t in self.header.tensors.iter().filter(|_| quantized) {
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
            if let Some(divisors) = self.rope_divisors()? {
                if obj.contains_key("rope_scaling") {
                    return Err(ModelError::Unsupported(
                        "GGUF with both rope_freqs and a rope.scaling type".into(),
                    ));
                }
                obj.insert(
                    "rope_scaling".into(),
                    serde_json::json!({"rope_type": "divisors", "divisors": divisors}),
                );
            }
        }
        ModelConfig::from_json_str(&json.to_string())
    }

    /// Reads every tensor (with MLX's loader, or decoded to float32 when
    /// MLX cannot read the file: see the module docs), under its
    /// checkpoint name, rewritten by the architecture for `config` (the
    /// config the family has read).
    ///
    /// # Errors
    /// MLX failing to read the file, an I/O error, a tensor MLX returns
    /// that the architecture does not know, or a tensor that does not fit
    /// `config`.
    pub fn weights(&self, config: &ModelConfig) -> Result<Weights, ModelError> {
        Ok(Weights::from_arrays(self.arrays(config, None)?.arrays))
    }

    /// [`GgufModel::weights`], with the floating-point matrices (2-D
    /// `*.weight`: linear layers, embeddings, the head) that the file does
    /// not hold MLX-quantized quantized with MLX's affine quantizer
    /// ([`Array::quantize`]) as `policy` says, each as soon as it is read
    /// (a file decoded to float32 never holds more than one float32 matrix
    /// beyond the quantized ones); `config.quantization` names every such
    /// module. This is `--quantize`: on a GPU a dense float32 matrix reads
    /// 8 times the bytes per token of a 4-bit one. Matrices whose rows are
    /// not a whole number of groups stay as they are. Returns the weights
    /// and how many matrices were quantized.
    ///
    /// # Errors
    /// As [`GgufModel::weights`]; a group size or bit width MLX refuses.
    pub fn weights_requantized(
        &self,
        config: &mut ModelConfig,
        policy: Requantize,
    ) -> Result<(Weights, usize), ModelError> {
        let Loaded { arrays, quantized } = self.arrays(config, Some(policy))?;
        let count = quantized.len();
        for (module, spec) in quantized {
            config.quantization.overrides.insert(module, Some(spec));
        }
        tracing::info!(
            matrices = count,
            ?policy,
            "quantized the GGUF's floating-point matrices"
        );
        Ok((Weights::from_arrays(arrays), count))
    }

    /// The GGUF type each checkpoint tensor was stored as.
    fn source_types(&self) -> HashMap<String, TensorType> {
        self.header
            .tensors
            .iter()
            .filter_map(|t| Some((arch::checkpoint_name(self.arch, &t.name)?, t.ty)))
            .collect()
    }

    /// Every tensor under its checkpoint name (see [`GgufModel::weights`]),
    /// the matrices `policy` picks quantized.
    fn arrays(
        &self,
        config: &ModelConfig,
        policy: Option<Requantize>,
    ) -> Result<Loaded, ModelError> {
        let arch = self.arch();
        if !self.mlx_reads_all() {
            return self.decoded_arrays(config, policy);
        }
        let sources = self.source_types();
        tracing::info!(file = %self.path.display(), arch = arch.name, "loading GGUF tensors");
        let mut file = mlxcel_mlx::SafeTensors::load_gguf(&self.path)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", self.path.display())))?;
        let mut loaded = Loaded::default();
        for gguf in file.names() {
            let name = arch::checkpoint_name(arch, &gguf).ok_or_else(|| {
                ModelError::Unsupported(format!("GGUF tensor {gguf} ({} architecture)", arch.name))
            })?;
            let tensor = file.take(&gguf)?;
            if name == ROPE_FREQS {
                continue;
            }
            let array = (arch.fix_tensor)(&name, tensor, config)?;
            let spec = requantize_spec(policy, sources.get(&name).copied(), &name, config);
            loaded.insert(name, array, spec)?;
        }
        Ok(loaded)
    }
}

impl GgufModel {
    /// Every tensor decoded to float32 by [`dequant`], renamed and
    /// rewritten as in [`GgufModel::weights`].
    fn decoded_arrays(
        &self,
        config: &ModelConfig,
        policy: Option<Requantize>,
    ) -> Result<Loaded, ModelError> {
        let arch = self.arch();
        tracing::info!(
            file = %self.path.display(),
            arch = arch.name,
            "decoding GGUF tensors to float32 (types MLX's reader does not read)"
        );
        let io = |e: std::io::Error| ModelError::io(&self.path, e);
        let mut file = std::fs::File::open(&self.path).map_err(io)?;
        let mut loaded = Loaded::default();
        let mut bytes = Vec::new();
        for t in &self.header.tensors {
            let name = arch::checkpoint_name(arch, &t.name).ok_or_else(|| {
                ModelError::Unsupported(format!(
                    "GGUF tensor {} ({} architecture)",
                    t.name, arch.name
                ))
            })?;
            if name == ROPE_FREQS {
                continue;
            }
            let values = self.read_f32(&mut file, t, &mut bytes)?;
            let shape = t
                .shape
                .iter()
                .map(|&d| i32::try_from(d))
                .collect::<Result<Vec<i32>, _>>()
                .map_err(|_| {
                    ModelError::Weights(format!("tensor {}: dimension too large", t.name))
                })?;
            let array = Array::from_f32(&values, &shape)?;
            let array = (arch.fix_tensor)(&name, array, config)?;
            let spec = requantize_spec(policy, Some(t.ty), &name, config);
            loaded.insert(name, array, spec)?;
        }
        Ok(loaded)
    }

    /// Tensor `t`'s data decoded to float32 ([`dequant`]), read through
    /// `bytes` (a reused buffer).
    fn read_f32(
        &self,
        file: &mut std::fs::File,
        t: &TensorInfo,
        bytes: &mut Vec<u8>,
    ) -> Result<Vec<f32>, ModelError> {
        let io = |e: std::io::Error| ModelError::io(&self.path, e);
        let size = t
            .shape
            .iter()
            .product::<u64>()
            .checked_mul(t.ty.block_bytes())
            .and_then(|b| b.checked_div(t.ty.block_elements()))
            .ok_or_else(|| ModelError::Weights(format!("tensor {}: size overflows", t.name)))?;
        bytes.resize(
            usize::try_from(size)
                .map_err(|_| ModelError::Weights(format!("tensor {}: {size} bytes", t.name)))?,
            0,
        );
        file.seek(SeekFrom::Start(self.header.data_start + t.offset))
            .map_err(io)?;
        file.read_exact(bytes).map_err(io)?;
        let mut values = Vec::new();
        dequant::dequantize(t.ty, bytes, &mut values)
            .map_err(|e| ModelError::Weights(format!("tensor {}: {e}", t.name)))?;
        Ok(values)
    }

    /// The `rope_freqs` tensor llama.cpp's converter writes for Llama
    /// 3.1-style RoPE scaling (one divisor of the rotation angle per
    /// rotated frequency, `[rotated dims / 2]`), if the file has one.
    fn rope_divisors(&self) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(t) = self.header.tensor(ROPE_FREQS) else {
            return Ok(None);
        };
        let io = |e: std::io::Error| ModelError::io(&self.path, e);
        let mut file = std::fs::File::open(&self.path).map_err(io)?;
        self.read_f32(&mut file, t, &mut Vec::new()).map(Some)
    }
}

/// llama.cpp's name of the RoPE divisors tensor (also its checkpoint name,
/// [`arch::checkpoint_name`]); it is read into the config
/// (`rope_scaling`), never loaded as a weight.
const ROPE_FREQS: &str = "rope_freqs.weight";

#[cfg(test)]
mod tests {
    use super::*;

    /// Requantizing at load takes 2-D matrices and the 3-D stacks of a
    /// layer's experts (quantized along their last axis), and leaves other
    /// 3-D tensors and vectors as they are.
    #[test]
    fn expert_stacks_are_quantized_like_matrices() {
        let spec = QuantSpec {
            group_size: 32,
            bits: 8,
        };
        let values: Vec<f32> = (0..4 * 8 * 64).map(|i| (i % 17) as f32 / 17.0).collect();
        let stack = || Array::from_f32(&values, &[4, 8, 64]).unwrap();
        let mut loaded = Loaded::default();
        let experts = "model.layers.0.mlp.switch_mlp.up_proj";
        loaded
            .insert(format!("{experts}.weight"), stack(), Some(spec))
            .unwrap();
        let other = "model.layers.0.something.weight";
        loaded.insert(other.into(), stack(), Some(spec)).unwrap();
        let norm = "model.norm.weight";
        loaded
            .insert(
                norm.into(),
                Array::from_f32(&values[..64], &[64]).unwrap(),
                Some(spec),
            )
            .unwrap();
        assert_eq!(loaded.quantized, vec![(experts.to_string(), spec)]);
        assert_eq!(
            loaded.arrays[&format!("{experts}.weight")].shape(),
            vec![4, 8, 16]
        );
        assert_eq!(
            loaded.arrays[&format!("{experts}.scales")].shape(),
            vec![4, 8, 2]
        );
        assert_eq!(loaded.arrays[other].shape(), vec![4, 8, 64]);
        assert_eq!(loaded.arrays[norm].shape(), vec![64]);
        // The quantized stack dequantizes back to within 8-bit rounding.
        let back = loaded.arrays[&format!("{experts}.weight")]
            .dequantize(
                &loaded.arrays[&format!("{experts}.scales")],
                &loaded.arrays[&format!("{experts}.biases")],
                32,
                8,
            )
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let worst = back
            .iter()
            .zip(&values)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-2, "{worst}");
    }
}
