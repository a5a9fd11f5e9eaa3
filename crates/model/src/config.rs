//! `config.json` of an MLX (Hugging Face layout) checkpoint.

use crate::ModelError;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

/// Affine quantization parameters (MLX `quantize`, mode `affine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct QuantSpec {
    /// Elements sharing one scale and bias (32, 64 or 128).
    pub group_size: i32,
    /// Bits per element (2, 3, 4, 5, 6 or 8).
    pub bits: i32,
}

/// The `quantization` entry: global parameters plus per-module overrides
/// (mlx_lm writes `"model.layers.0.mlp.down_proj": {"group_size":..,"bits":..}`
/// or `false` for a module left unquantized).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Quantization {
    pub default: Option<QuantSpec>,
    pub overrides: HashMap<String, Option<QuantSpec>>,
}

impl Quantization {
    fn from_json(v: &serde_json::Value) -> Result<Self, ModelError> {
        let obj = match v {
            serde_json::Value::Object(o) => o,
            _ => return Ok(Self::default()),
        };
        let mut q = Quantization::default();
        if let (Some(g), Some(b)) = (obj.get("group_size"), obj.get("bits")) {
            q.default = Some(QuantSpec {
                group_size: as_i32(g, "quantization.group_size")?,
                bits: as_i32(b, "quantization.bits")?,
            });
        }
        if let Some(mode) = obj.get("mode").and_then(|m| m.as_str()) {
            if mode != "affine" {
                return Err(ModelError::Unsupported(format!(
                    "quantization mode {mode} (only affine)"
                )));
            }
        }
        for (k, val) in obj {
            match val {
                serde_json::Value::Bool(false) => {
                    q.overrides.insert(k.clone(), None);
                }
                serde_json::Value::Object(_) => {
                    let spec: QuantSpec = serde_json::from_value(val.clone())
                        .map_err(|e| ModelError::Config(format!("quantization.{k}: {e}")))?;
                    q.overrides.insert(k.clone(), Some(spec));
                }
                _ => {}
            }
        }
        Ok(q)
    }

    /// The parameters of module `path` (e.g. `model.layers.0.self_attn.q_proj`).
    pub fn for_module(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(spec) => *spec,
            None => self.default,
        }
    }
}

fn as_i32(v: &serde_json::Value, what: &str) -> Result<i32, ModelError> {
    v.as_i64()
        .and_then(|x| i32::try_from(x).ok())
        .ok_or_else(|| ModelError::Config(format!("{what} must be an integer")))
}

/// RoPE frequency scaling from `rope_scaling`.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (`"type": "linear"`).
    Linear { factor: f32 },
    /// Llama 3.1 wavelength-dependent scaling (`"rope_type": "llama3"`).
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
    /// One divisor of the rotation angle per rotated frequency,
    /// `[dims / 2]`: frequency `i` turns by `position · base^(-2i/dims) /
    /// divisors[i]` (`"rope_type": "divisors"`, what a GGUF file's
    /// `rope_freqs` tensor holds: llama.cpp's converter writes Llama 3.1's
    /// scaling this way).
    Divisors(Vec<f32>),
    /// YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension
    /// of Large Language Models"; `"rope_type": "yarn"`, gpt-oss): the
    /// frequencies above the `beta_fast` correction dimension keep their
    /// period, those below `beta_slow` are stretched by `factor`, a linear
    /// ramp between; queries and keys are scaled by the attention factor
    /// `m(factor, mscale) / m(factor, mscale_all_dim)` with `m(s, a) =
    /// 0.1 a ln s + 1` (1 when `s <= 1`). Follows mlx_lm's `YarnRoPE`.
    Yarn {
        factor: f32,
        original_max_position_embeddings: f32,
        beta_fast: f32,
        beta_slow: f32,
        mscale: f32,
        mscale_all_dim: f32,
    },
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: String,
    hidden_size: usize,
    num_hidden_layers: usize,
    intermediate_size: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: f32,
    vocab_size: usize,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_traditional: bool,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: bool,
    max_position_embeddings: Option<usize>,
    torch_dtype: Option<String>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    quantization: Option<serde_json::Value>,
}

fn default_rope_theta() -> f32 {
    10000.0
}

/// The hyper-parameters every family shares, read from `config.json` the
/// same way for all of them (no `model_type` branches here: a family
/// adjusts what it reads differently, and reads its own keys from `raw`;
/// see the `mlxcel-models` registry).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The checkpoint's family key (`llama`, `qwen2`, `qwen3`, ...).
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Per-head feature size (default `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub rope_traditional: bool,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// `attention_bias`: biases on the q/k/v and output projections (a
    /// family may decide otherwise: Qwen2 always has q/k/v biases).
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// Context length in tokens (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// Checkpoint dtype name (`torch_dtype`), e.g. `float16`.
    pub torch_dtype: Option<String>,
    /// Sliding attention window in tokens, when the model uses one
    /// (`sliding_window`, unless `use_sliding_window` is false).
    pub sliding_window: Option<usize>,
    pub quantization: Quantization,
    /// The whole `config.json`, for the keys only one family reads.
    pub raw: serde_json::Value,
    /// This process's shard of the model under tensor parallelism (not in
    /// `config.json`: the engine sets it before loading); `None` loads the
    /// whole model.
    pub tensor_parallel: Option<crate::TensorParallel>,
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    ///
    /// # Errors
    /// Missing file, malformed JSON, missing keys, unsupported features.
    pub fn from_model_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        Self::from_json_str(&text)
    }

    /// Parses the text of a `config.json`. Python's `json` writes
    /// infinities and NaN as bare `Infinity`, `-Infinity` and `NaN`
    /// (Hugging Face configs carry them, e.g. a `time_step_limit` of `[0.0,
    /// Infinity]`); they are read as ±1e308 (infinite as `f32`) and null.
    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        let json: serde_json::Value = serde_json::from_str(&python_json(text))
            .map_err(|e| ModelError::Config(e.to_string()))?;
        let json = flatten_text_config(json);
        let raw: RawConfig =
            serde_json::from_value(json.clone()).map_err(|e| ModelError::Config(e.to_string()))?;
        let heads = raw.num_attention_heads;
        if heads == 0 || !raw.hidden_size.is_multiple_of(heads) && raw.head_dim.is_none() {
            return Err(ModelError::Config(
                "hidden_size must be a multiple of num_attention_heads".into(),
            ));
        }
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(ModelError::Config(
                "num_attention_heads must be a multiple of num_key_value_heads".into(),
            ));
        }
        let sliding_window = match (raw.sliding_window, raw.use_sliding_window) {
            (Some(_), Some(false)) => None,
            (w, _) => w,
        };
        Ok(ModelConfig {
            rope_scaling: parse_rope_scaling(raw.rope_scaling.as_ref())?,
            quantization: raw
                .quantization
                .as_ref()
                .map(Quantization::from_json)
                .transpose()?
                .unwrap_or_default(),
            head_dim: raw.head_dim.unwrap_or(raw.hidden_size / heads),
            num_key_value_heads: kv_heads,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(true),
            attention_bias: raw.attention_bias.unwrap_or(false),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            model_type: raw.model_type,
            hidden_size: raw.hidden_size,
            num_hidden_layers: raw.num_hidden_layers,
            intermediate_size: raw.intermediate_size,
            num_attention_heads: heads,
            rms_norm_eps: raw.rms_norm_eps,
            vocab_size: raw.vocab_size,
            rope_theta: raw.rope_theta,
            rope_traditional: raw.rope_traditional,
            mlp_bias: raw.mlp_bias,
            torch_dtype: raw.torch_dtype,
            sliding_window,
            raw: json,
            tensor_parallel: None,
        })
    }
}

fn parse_rope_scaling(v: Option<&serde_json::Value>) -> Result<RopeScaling, ModelError> {
    let Some(obj) = v.and_then(|v| v.as_object()) else {
        return Ok(RopeScaling::None);
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let f = |k: &str, d: f32| obj.get(k).and_then(|x| x.as_f64()).map_or(d, |x| x as f32);
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: f("factor", 1.0),
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: f("factor", 1.0),
            low_freq_factor: f("low_freq_factor", 1.0),
            high_freq_factor: f("high_freq_factor", 4.0),
            original_max_position_embeddings: f("original_max_position_embeddings", 8192.0),
        }),
        "yarn" => Ok(RopeScaling::Yarn {
            factor: f("factor", 1.0),
            original_max_position_embeddings: f("original_max_position_embeddings", 4096.0),
            beta_fast: f("beta_fast", 32.0),
            beta_slow: f("beta_slow", 1.0),
            mscale: f("mscale", 1.0),
            mscale_all_dim: f("mscale_all_dim", 0.0),
        }),
        "divisors" => {
            let divisors = obj
                .get("divisors")
                .and_then(|d| d.as_array())
                .and_then(|d| {
                    d.iter()
                        .map(|x| x.as_f64().map(|x| x as f32))
                        .collect::<Option<Vec<f32>>>()
                })
                .filter(|d| !d.is_empty() && d.iter().all(|&x| x > 0.0))
                .ok_or_else(|| {
                    ModelError::Config("rope_scaling divisors must be positive numbers".into())
                })?;
            Ok(RopeScaling::Divisors(divisors))
        }
        other => Err(ModelError::Unsupported(format!(
            "rope_scaling type {other}"
        ))),
    }
}

/// `text` with Python's non-standard JSON literals outside strings made
/// standard: `Infinity` → `1e308`, `-Infinity` → `-1e308`, `NaN` → `null`.
fn python_json(text: &str) -> std::borrow::Cow<'_, str> {
    if !(text.contains("Infinity") || text.contains("NaN")) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            (in_string, escaped) = match c {
                '\\' if !escaped => (true, true),
                '"' if !escaped => (false, false),
                _ => (true, false),
            };
        } else if c == '"' {
            in_string = true;
        } else {
            let replaced = [
                ("-Infinity", "-1e308"),
                ("Infinity", "1e308"),
                ("NaN", "null"),
            ]
            .into_iter()
            .find(|(from, _)| rest.starts_with(from));
            if let Some((from, to)) = replaced {
                out.push_str(to);
                rest = &rest[from.len()..];
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    std::borrow::Cow::Owned(out)
}

/// A multimodal checkpoint's config (Qwen3.5, Gemma 3) nests the text
/// model's keys under `text_config`: they are read as top-level keys, the
/// top level filling in what `text_config` lacks (its `model_type` and
/// `quantization` win; `vision_config` is dropped). Any other config is
/// returned unchanged.
fn flatten_text_config(json: serde_json::Value) -> serde_json::Value {
    let serde_json::Value::Object(mut top) = json else {
        return json;
    };
    let Some(serde_json::Value::Object(text)) = top.remove("text_config") else {
        return serde_json::Value::Object(top);
    };
    top.remove("vision_config");
    let mut merged = text;
    for key in ["model_type", "quantization", "quantization_config"] {
        if let Some(v) = top.remove(key) {
            merged.insert(key.to_string(), v);
        }
    }
    for (k, v) in top {
        merged.entry(k).or_insert(v);
    }
    serde_json::Value::Object(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python's `Infinity`/`NaN` literals are read outside strings only;
    /// a config carrying them parses.
    #[test]
    fn python_json_literals_are_read() {
        let text = r#"{"a": [0.0, Infinity], "b": -Infinity, "c": NaN, "d": "NaN \" Infinity"}"#;
        let v: serde_json::Value = serde_json::from_str(&python_json(text)).unwrap();
        assert_eq!(v["a"][1].as_f64(), Some(1e308));
        assert_eq!(v["b"].as_f64(), Some(-1e308));
        assert!(v["c"].is_null());
        assert_eq!(v["d"], "NaN \" Infinity");
        let c = ModelConfig::from_json_str(
            r#"{"model_type":"granitemoehybrid","hidden_size":64,"num_hidden_layers":2,
            "intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,
            "rms_norm_eps":1e-5,"vocab_size":256,"time_step_limit":[0.0,Infinity]}"#,
        )
        .unwrap();
        assert_eq!(c.raw["time_step_limit"][1].as_f64(), Some(1e308));
    }

    #[test]
    fn smollm2_style_config() {
        let c = ModelConfig::from_json_str(
            r#"{"model_type":"llama","hidden_size":576,"num_hidden_layers":30,
            "intermediate_size":1536,"num_attention_heads":9,"num_key_value_heads":3,
            "rms_norm_eps":1e-5,"vocab_size":49152,"rope_theta":100000.0,
            "tie_word_embeddings":true,"max_position_embeddings":8192,"eos_token_id":2,
            "quantization":{"group_size":32,"bits":4,"mode":"affine",
              "model.embed_tokens":{"group_size":64,"bits":8},"lm_head":false}}"#,
        )
        .unwrap();
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.num_key_value_heads, 3);
        assert!(c.tie_word_embeddings && !c.attention_bias);
        let q = &c.quantization;
        assert_eq!(
            q.for_module("model.layers.0.mlp.up_proj"),
            Some(QuantSpec {
                group_size: 32,
                bits: 4
            })
        );
        assert_eq!(
            q.for_module("model.embed_tokens"),
            Some(QuantSpec {
                group_size: 64,
                bits: 8
            })
        );
        assert_eq!(q.for_module("lm_head"), None);
    }

    #[test]
    fn rope_divisors_are_read_and_checked() {
        let d = |v: &str| parse_rope_scaling(Some(&serde_json::from_str(v).unwrap()));
        assert_eq!(
            d(r#"{"rope_type":"divisors","divisors":[1.0,2.5,8]}"#).unwrap(),
            RopeScaling::Divisors(vec![1.0, 2.5, 8.0])
        );
        for bad in [
            r#"{"rope_type":"divisors"}"#,
            r#"{"rope_type":"divisors","divisors":[]}"#,
            r#"{"rope_type":"divisors","divisors":[1.0,0.0]}"#,
            r#"{"rope_type":"divisors","divisors":[1.0,"x"]}"#,
        ] {
            assert!(matches!(d(bad), Err(ModelError::Config(_))), "{bad}");
        }
    }

    #[test]
    fn defaults_and_errors() {
        let c = ModelConfig::from_json_str(
            r#"{"model_type":"qwen2","hidden_size":896,"num_hidden_layers":24,
            "intermediate_size":4864,"num_attention_heads":14,"num_key_value_heads":2,
            "rms_norm_eps":1e-6,"vocab_size":151936,"rope_theta":1000000.0,
            "sliding_window":32768,"use_sliding_window":false,"eos_token_id":[151645,151643]}"#,
        )
        .unwrap();
        assert!(c.tie_word_embeddings, "mlx_lm ties by default");
        assert_eq!(c.sliding_window, None, "use_sliding_window: false");
        assert_eq!(c.raw["use_sliding_window"], false);
        let bad = ModelConfig::from_json_str(r#"{"model_type":"llama"}"#);
        assert!(matches!(bad, Err(ModelError::Config(_))));
        let rope = ModelConfig::from_json_str(
            r#"{"model_type":"llama","hidden_size":8,"num_hidden_layers":1,
            "intermediate_size":8,"num_attention_heads":2,"rms_norm_eps":1e-5,
            "vocab_size":10,"rope_scaling":{"type":"longrope","factor":4.0}}"#,
        );
        assert!(matches!(rope, Err(ModelError::Unsupported(_))));
        let yarn = ModelConfig::from_json_str(
            r#"{"model_type":"llama","hidden_size":8,"num_hidden_layers":1,
            "intermediate_size":8,"num_attention_heads":2,"rms_norm_eps":1e-5,
            "vocab_size":10,"rope_scaling":{"rope_type":"yarn","factor":32.0,
            "beta_fast":32.0,"original_max_position_embeddings":4096}}"#,
        )
        .unwrap();
        assert_eq!(
            yarn.rope_scaling,
            RopeScaling::Yarn {
                factor: 32.0,
                original_max_position_embeddings: 4096.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 1.0,
                mscale_all_dim: 0.0
            },
            "mlx_lm's defaults for the keys not given"
        );
    }

    #[test]
    fn a_nested_text_config_is_read_as_the_top_level() {
        let c = ModelConfig::from_json_str(
            r#"{"model_type": "qwen3_5", "tie_word_embeddings": true,
                "vision_config": {"hidden_size": 1},
                "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64,
                  "num_hidden_layers": 2, "intermediate_size": 128,
                  "num_attention_heads": 4, "rms_norm_eps": 1e-6, "vocab_size": 256}}"#,
        )
        .unwrap();
        assert_eq!(c.model_type, "qwen3_5");
        assert_eq!((c.hidden_size, c.num_hidden_layers), (64, 2));
        assert!(c.tie_word_embeddings, "filled in from the top level");
        assert!(c.raw.get("vision_config").is_none());
    }
}
