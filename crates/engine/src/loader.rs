//! Picks the model family for a checkpoint's `model_type` and loads it.

use mlxcel_model::{LoadOptions, Model, ModelConfig, ModelError, Weights};
use std::path::Path;

/// Loads the model in `dir` with the family its `model_type` names.
///
/// # Errors
/// Unknown `model_type`, or any loading error of the family.
pub fn load_model(
    dir: &Path,
    config: ModelConfig,
    options: LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    let mut weights = Weights::open(dir)?;
    match config.model_type.as_str() {
        t if mlxcel_llama::MODEL_TYPES.contains(&t) => Ok(Box::new(
            mlxcel_llama::LlamaModel::load(config, &mut weights, options)?,
        )),
        other => Err(ModelError::Unsupported(format!(
            "model_type {other} (supported: {})",
            mlxcel_llama::MODEL_TYPES.join(", ")
        ))),
    }
}
