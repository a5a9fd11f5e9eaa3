//! Weight loading from MLX-format safetensors (single file or sharded with
//! `model.safetensors.index.json`), or from tensors already read (a GGUF
//! file, `crate::gguf`).

use crate::config::{QuantSpec, Quantization};
use crate::ModelError;
use mlxcel_mlx::{Array, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// All tensors of a checkpoint, by name; each is taken once.
pub struct Weights {
    files: Vec<SafeTensors>,
    /// Name -> (its shard, its name in the shard).
    index: HashMap<String, (usize, String)>,
    /// Tensors held in memory, by checkpoint name.
    arrays: HashMap<String, Array>,
}

impl Weights {
    /// Opens every `*.safetensors` shard of `dir` (lazily: data is read when
    /// a tensor is first evaluated).
    ///
    /// # Errors
    /// No shard, unreadable shard, or a shard named in the index missing.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let shards = shard_paths(dir)?;
        let mut files = Vec::with_capacity(shards.len());
        let mut index = HashMap::new();
        for (i, path) in shards.iter().enumerate() {
            tracing::info!(shard = %path.display(), "loading weights");
            let st = SafeTensors::load(path)
                .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
            for name in st.names() {
                index.insert(name.clone(), (i, name));
            }
            files.push(st);
        }
        Ok(Weights {
            files,
            index,
            arrays: HashMap::new(),
        })
    }

    /// Tensors already read, by checkpoint name.
    pub fn from_arrays(arrays: HashMap<String, Array>) -> Self {
        Weights {
            files: Vec::new(),
            index: HashMap::new(),
            arrays,
        }
    }

    /// Whether tensor `name` exists (and was not taken yet).
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name) || self.arrays.contains_key(name)
    }

    /// Removes and returns tensor `name`.
    ///
    /// # Errors
    /// [`ModelError::MissingWeight`] when the checkpoint has no such tensor.
    pub fn take(&mut self, name: &str) -> Result<Array, ModelError> {
        if let Some(a) = self.arrays.remove(name) {
            return Ok(a);
        }
        let (i, stored) = self
            .index
            .remove(name)
            .ok_or_else(|| ModelError::MissingWeight(name.to_string()))?;
        Ok(self.files[i].take(&stored)?)
    }

    /// Renames every tensor by `f` (its new name, or `None` to drop it):
    /// a family whose checkpoints nest the text model (`language_model.`)
    /// maps them onto the shared decoder's paths.
    pub fn rename(&mut self, f: impl Fn(&str) -> Option<String>) {
        self.index = std::mem::take(&mut self.index)
            .into_iter()
            .filter_map(|(name, at)| f(&name).map(|n| (n, at)))
            .collect();
        self.arrays = std::mem::take(&mut self.arrays)
            .into_iter()
            .filter_map(|(name, a)| f(&name).map(|n| (n, a)))
            .collect();
    }

    /// The shape of tensor `name`, which stays in place (read lazily).
    ///
    /// # Errors
    /// No such tensor; MLX failures.
    pub fn shape(&mut self, name: &str) -> Result<Vec<i32>, ModelError> {
        let a = self.take(name)?;
        let shape = a.shape().to_vec();
        self.arrays.insert(name.to_string(), a);
        Ok(shape)
    }

    /// Takes `name` if present.
    pub fn take_opt(&mut self, name: &str) -> Result<Option<Array>, ModelError> {
        if self.contains(name) {
            self.take(name).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Names not taken yet (a model checks that none of its own are left).
    pub fn remaining(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .index
            .keys()
            .chain(self.arrays.keys())
            .cloned()
            .collect();
        v.sort();
        v
    }
}

/// An affine-quantized matrix of a checkpoint, as [`quantized_matrices`]
/// finds it in the tensors' headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizedShape {
    /// Module path (`model.layers.0.mlp.down_proj`).
    pub path: String,
    /// Output features (rows of the `[out, in]` matrix).
    pub out: usize,
    /// Input features (the packed `[out, in · bits / 32]` words unpacked).
    pub input: usize,
    pub spec: QuantSpec,
}

/// Every 2-D affine-quantized matrix of the safetensors checkpoint in
/// `dir` (a `{path}.weight` uint32 `[out, in · bits / 32]` beside
/// `{path}.scales`), with the bits and group size `quantization` gives its
/// module, read from the shards' headers only (no tensor data). Stacked
/// expert matrices (3-D) are left out.
///
/// # Errors
/// No shard, an unreadable shard.
pub fn quantized_matrices(
    dir: &Path,
    quantization: &Quantization,
) -> Result<Vec<QuantizedShape>, ModelError> {
    let mut found = Vec::new();
    for path in shard_paths(dir)? {
        let mut st = SafeTensors::load(&path)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
        let names = st.names();
        for name in &names {
            let Some(module) = name.strip_suffix(".scales") else {
                continue;
            };
            let weight = format!("{module}.weight");
            if !names.contains(&weight) {
                continue;
            }
            let Some(spec) = quantization.for_module(module) else {
                continue;
            };
            let shape = st.take(&weight)?.shape();
            if let ([out, words], true) = (shape.as_slice(), spec.bits > 0) {
                found.push(QuantizedShape {
                    path: module.to_string(),
                    out: *out as usize,
                    input: *words as usize * 32 / spec.bits as usize,
                    spec,
                });
            }
        }
    }
    Ok(found)
}

fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", index.display())))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::Weights("index has no weight_map".into()))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(ModelError::Weights(format!(
            "no .safetensors files in {}",
            dir.display()
        )));
    }
    Ok(found)
}
