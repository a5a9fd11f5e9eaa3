//! Weight loading from MLX-format safetensors (single file or sharded with
//! `model.safetensors.index.json`), or from tensors already read (a GGUF
//! file, `crate::gguf`).

use crate::config::{QuantSpec, Quantization};
use crate::ModelError;
use mlxcel_mlx::{Array, Dtype, SafeTensors};
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
    /// Bits per element and elements per scale, from the config.
    pub spec: QuantSpec,
}

/// Every 2-D affine-quantized matrix of the safetensors checkpoint in
/// `dir`: a uint32 `{path}.weight` `[out, in · bits / 32]` with a
/// `{path}.scales` `[out, in / group_size]`, in any shards, the bits and
/// group size those of `quantization` for the module, read from the
/// shards' headers only (no tensor data). A matrix whose scales do not
/// fit its words at those bits and group size is left out, as are stacked
/// expert matrices (3-D). Sorted by path.
///
/// # Errors
/// No shard, an unreadable shard.
pub fn quantized_matrices(
    dir: &Path,
    quantization: &Quantization,
) -> Result<Vec<QuantizedShape>, ModelError> {
    // Every tensor's shape and dtype, over all shards (a module's weight
    // and scales may sit in different ones).
    let mut headers = HashMap::new();
    for path in shard_paths(dir)? {
        let mut st = SafeTensors::load(&path)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
        for name in st.names() {
            let a = st.take(&name)?;
            headers.insert(name, (a.shape(), a.dtype()));
        }
    }
    let mut found = Vec::new();
    for (name, (scales, _)) in &headers {
        let Some(module) = name.strip_suffix(".scales") else {
            continue;
        };
        let (Some((weight, Dtype::Uint32)), Some(spec)) = (
            headers.get(&format!("{module}.weight")),
            quantization.for_module(module),
        ) else {
            continue;
        };
        let ([out, words], [rows, groups]) = (weight.as_slice(), scales.as_slice()) else {
            continue;
        };
        let input = i64::from(*words) * 32 / i64::from(spec.bits.max(1));
        if out != rows || spec.bits <= 0 || input != i64::from(*groups) * i64::from(spec.group_size)
        {
            continue;
        }
        found.push(QuantizedShape {
            path: module.to_string(),
            out: *out as usize,
            input: input as usize,
            spec,
        });
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_matrices_are_read_from_every_shard_with_their_overrides() {
        let dir = std::env::temp_dir().join(format!("mlxcel-qshapes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let u = |rows: i32, cols: i32| {
            Array::from_u32(&vec![0; (rows * cols) as usize], &[rows, cols]).expect("u32")
        };
        let f = |rows: i32, cols: i32| {
            Array::from_f32(&vec![0.0; (rows * cols) as usize], &[rows, cols]).expect("f32")
        };
        // a: 4-bit [8, 32]; b: its scales in the other shard; c: 8-bit by
        // override [4, 32]; d: float "weights"; e: scales of the wrong
        // size; f: an override that leaves it unquantized.
        let (aw, asc, bw, bsc, cw, csc) = (u(8, 4), f(8, 1), u(6, 8), f(6, 2), u(4, 8), f(4, 1));
        let (dw, dsc, ew, esc, fw, fsc) = (f(4, 4), f(4, 1), u(4, 4), f(4, 3), u(2, 4), f(2, 1));
        let one = [
            ("a.weight", &aw),
            ("a.scales", &asc),
            ("b.weight", &bw),
            ("c.weight", &cw),
            ("c.scales", &csc),
        ];
        let two = [
            ("b.scales", &bsc),
            ("d.weight", &dw),
            ("d.scales", &dsc),
            ("e.weight", &ew),
            ("e.scales", &esc),
            ("f.weight", &fw),
            ("f.scales", &fsc),
        ];
        let mut map = serde_json::Map::new();
        for (file, tensors) in [("one.safetensors", &one[..]), ("two.safetensors", &two[..])] {
            let named: Vec<(String, &Array)> =
                tensors.iter().map(|(n, a)| (n.to_string(), *a)).collect();
            mlxcel_mlx::save_safetensors(&dir.join(file), &named).expect("save");
            for (n, _) in tensors {
                map.insert(n.to_string(), serde_json::Value::from(file));
            }
        }
        let index = serde_json::json!({ "weight_map": map });
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
        let spec = |bits, group_size| QuantSpec { group_size, bits };
        let mut q = Quantization {
            default: Some(spec(4, 32)),
            overrides: HashMap::new(),
        };
        q.overrides.insert("c".into(), Some(spec(8, 32)));
        q.overrides.insert("f".into(), None);
        let found = quantized_matrices(&dir, &q).expect("headers");
        let shape = |path: &str, out, input, s| QuantizedShape {
            path: path.into(),
            out,
            input,
            spec: s,
        };
        assert_eq!(
            found,
            vec![
                shape("a", 8, 32, spec(4, 32)),
                shape("b", 6, 64, spec(4, 32)),
                shape("c", 4, 32, spec(8, 32)),
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
