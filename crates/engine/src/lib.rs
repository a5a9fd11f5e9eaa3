//! The mlxcel engine: turns validated generation requests into token streams.
//!
//! One OS thread owns the model and its KV cache; request handlers talk to it
//! through channels (see `docs/architecture.md`). The modules, by job:
//!
//! - [`config`]: the typed options and the defaults the flags read.
//! - [`loader`]: opening a checkpoint once, device settings, compute types,
//!   the text side and the model (shared with tensor-parallel followers).
//! - `start` ([`Engine::start`]): the engine thread, the KV cache, the
//!   runner, the warm-up through the finished handle.
//! - `handle` ([`Engine`]): the [`api::InferenceService`] front ends use.
//! - `request`: a request's job (prompt, grammar, limits).
//! - `worker`: the engine thread's loop (admit, plan, step, sample, stream).
//! - `runner`: what runs a step (local, tensor-parallel leader, follower).
//! - [`scheduler`], [`sampler`], [`logits`]: step planning and sampling.
//! - [`speculative`]: draft tokens (prompt lookup) and their verification;
//!   `draft`: proposals of a draft model.
//! - [`error`]: start-up errors and the typed errors of the step path.
//! - `platform`: what the engine asks of the machine.
//!
//! The text side (tokenizer, chat templates, detokenizer, output filter)
//! is `mlxcel-text`.

/// The front-end seam (re-exported from `mlxcel-engine-api`).
pub use mlxcel_engine_api as api;
pub mod config;
mod disk;
mod draft;
pub mod error;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod handle;
pub mod kernels;
pub mod loader;
pub mod logits;
mod plan;
mod platform;
mod request;
mod runner;
pub mod sampler;
pub mod scheduler;
pub mod speculative;
mod start;
pub mod warmup;
mod worker;

pub use config::{
    auto_prefill_chunk_size, defaults, EngineConfig, GgufQuantize, ReasoningParser,
    TensorParallelConfig, GGUF_QUANTIZE_GROUP,
};
pub use error::{EngineError, StepError};
pub use handle::{Engine, EngineInfo};
pub use mlxcel_kv::{KvCacheDtype, StorageBackend};
pub use mlxcel_model::AttentionPath;
pub use runner::tensor_parallel::follower::run_follower;
pub use speculative::{SpeculativeConfig, SpeculativeMethod};
