//! Loading a checkpoint: the registry of `mlxcel-models` picks the family
//! for its `model_type` (re-exported here for front ends and tests).

pub use mlxcel_models::{load_model, read_config};
