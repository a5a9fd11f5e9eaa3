//! The seam between a front end (HTTP server, CLI) and the engine.
//!
//! A front end builds a [`GenerationRequest`], calls
//! [`InferenceService::submit`], and reads [`GenerationEvent`]s from the
//! returned stream until a `Finished` or `Failed` event. Dropping the stream
//! cancels the request at the engine's next step.
//!
//! - request.rs: what a front end asks ([`GenerationRequest`],
//!   [`TokenizeRequest`] and their parts).
//! - event.rs: what comes back on the stream ([`GenerationEvent`]).
//! - service.rs: the engine as a front end sees it ([`InferenceService`],
//!   [`ServiceSlot`], [`SubmitError`]).
//! - stats.rs: [`EngineStats`] and [`CacheReset`].

mod event;
mod request;
mod service;
mod stats;

pub use event::{
    EventStream, FailureKind, FinishReason, GenerationEvent, SampledLogprobs, Timings,
    TokenLogprob, Usage,
};
pub use request::{
    ChatMessage, EmbeddingRequest, GenerationRequest, Infill, InfillFile, Prompt, ResponseFormat,
    SamplingParams, TokenizeRequest, ToolCall, ToolChoice, ToolDefinition,
    RESERVED_TEMPLATE_VARIABLES,
};
pub use service::{
    EmbeddingModel, InferenceService, Pooling, RequestField, ServiceSlot, SubmitError,
};
pub use stats::{CacheReset, DiskCacheStats, EngineStats, KvGroupStats, RecurrentStateStats};
