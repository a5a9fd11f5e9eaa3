//! The mlxcel engine: turns validated generation requests into token streams.
//!
//! One OS thread owns the model and its KV cache; request handlers talk to it
//! through channels (see `docs/architecture.md`).
//! The text side (tokenizer, chat template, detokenizer, output filter) is
//! `mlxcel-text`; the sampler lives here, so the CLI and the HTTP server
//! share one engine.

/// The front-end seam (re-exported from `mlxcel-engine-api`).
pub use mlxcel_engine_api as api;
pub mod engine;
pub mod error;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod loader;
pub mod logits;
mod runner;
pub mod sampler;
pub mod scheduler;
pub mod warmup;
mod worker;

pub use engine::{
    auto_prefill_chunk_size, Engine, EngineConfig, EngineError, EngineInfo, GgufQuantize,
    ReasoningParser, GGUF_QUANTIZE_GROUP,
};
pub use error::StepError;
pub use mlxcel_kv::StorageBackend;
pub use mlxcel_model::AttentionPath;
pub use runner::tensor_parallel::follower::run_follower;
pub use runner::tensor_parallel::TensorParallelConfig;
