//! How an embedding checkpoint turns a prompt's final hidden states into
//! one vector: read from its sentence-transformers files when present
//! (`modules.json`, whose `sentence_transformers.models.Pooling` module
//! names a folder holding `config.json` with `pooling_mode_*` keys; e.g.
//! Qwen3-Embedding's `1_Pooling/config.json` sets
//! `pooling_mode_lasttoken`).
//!
//! Plain serde, no MLX: the engine reads it once at load.

use std::path::Path;

use serde::Deserialize;

use crate::ModelError;

/// How the final hidden states of a prompt's tokens become its embedding
/// (always L2-normalised afterwards).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The last token's hidden state (Qwen3-Embedding; what `--embeddings`
    /// uses for any decoder): a causal model's last position has seen the
    /// whole prompt.
    LastToken,
    /// The mean over every token's hidden state.
    Mean,
}

impl Pooling {
    /// The name sentence-transformers gives the mode.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::LastToken => "lasttoken",
            Pooling::Mean => "mean_tokens",
        }
    }
}

/// One entry of `modules.json`.
#[derive(Deserialize)]
struct Module {
    #[serde(default)]
    path: String,
    #[serde(rename = "type", default)]
    kind: String,
}

/// The pooling of the checkpoint in `dir`: `None` when it has no
/// `modules.json` or no Pooling module in it (not an embedding
/// checkpoint).
///
/// # Errors
/// [`ModelError::Io`] for a file that cannot be read,
/// [`ModelError::Config`] for one that is not the expected JSON, and
/// [`ModelError::Unsupported`] naming the mode for a pooling other than
/// `pooling_mode_lasttoken` and `pooling_mode_mean_tokens` (or several
/// modes at once).
pub fn read_pooling(dir: &Path) -> Result<Option<Pooling>, ModelError> {
    let modules = dir.join("modules.json");
    if !modules.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&modules).map_err(|e| ModelError::io(&modules, e))?;
    let list: Vec<Module> = serde_json::from_str(&text)
        .map_err(|e| ModelError::Config(format!("{}: {e}", modules.display())))?;
    let Some(pooling) = list.iter().find(|m| m.kind.ends_with("models.Pooling")) else {
        return Ok(None);
    };
    let config = dir.join(&pooling.path).join("config.json");
    let text = std::fs::read_to_string(&config).map_err(|e| ModelError::io(&config, e))?;
    pooling_of(&text).map(Some).map_err(|e| match e {
        ModelError::Config(m) => ModelError::Config(format!("{}: {m}", config.display())),
        other => other,
    })
}

/// The pooling a sentence-transformers `Pooling` `config.json` selects.
///
/// # Errors
/// As [`read_pooling`].
pub fn pooling_of(config: &str) -> Result<Pooling, ModelError> {
    let value: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(config).map_err(|e| ModelError::Config(e.to_string()))?;
    let on: Vec<&str> = value
        .iter()
        .filter(|(k, v)| k.starts_with("pooling_mode_") && v.as_bool() == Some(true))
        .map(|(k, _)| k.as_str())
        .collect();
    match on[..] {
        ["pooling_mode_lasttoken"] => Ok(Pooling::LastToken),
        ["pooling_mode_mean_tokens"] => Ok(Pooling::Mean),
        [] => Err(ModelError::Config("no pooling_mode_* is set".into())),
        _ => Err(ModelError::Unsupported(format!(
            "embedding pooling {}: only pooling_mode_lasttoken and pooling_mode_mean_tokens are served",
            on.join(" + ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_modes_are_read_and_others_named() {
        let mode = |k: &str| {
            format!(
                r#"{{"word_embedding_dimension": 8, "{k}": true, "pooling_mode_cls_token": false}}"#
            )
        };
        assert_eq!(
            pooling_of(&mode("pooling_mode_lasttoken")).ok(),
            Some(Pooling::LastToken)
        );
        assert_eq!(
            pooling_of(&mode("pooling_mode_mean_tokens")).ok(),
            Some(Pooling::Mean)
        );
        let err = pooling_of(&mode("pooling_mode_max_tokens"))
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("pooling_mode_max_tokens")));
        assert!(pooling_of("{}").is_err());
    }

    #[test]
    fn a_directory_without_modules_is_no_embedding_checkpoint() {
        let dir = std::env::temp_dir().join(format!("mlxcel-pooling-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("1_Pooling")).ok();
        assert_eq!(read_pooling(&dir).ok(), Some(None));
        let modules = r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
            {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"}]"#;
        std::fs::write(dir.join("modules.json"), modules).ok();
        std::fs::write(
            dir.join("1_Pooling/config.json"),
            r#"{"pooling_mode_mean_tokens": true}"#,
        )
        .ok();
        assert_eq!(read_pooling(&dir).ok(), Some(Some(Pooling::Mean)));
        std::fs::remove_dir_all(&dir).ok();
    }
}
