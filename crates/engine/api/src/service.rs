//! The engine as a front end sees it: the [`InferenceService`] trait, the
//! [`ServiceSlot`] that stands in for it while the model loads, and why a
//! request can be refused ([`SubmitError`], [`RequestField`]).

use crate::event::EventStream;
use crate::request::{EmbeddingRequest, GenerationRequest, TokenizeRequest};
use crate::stats::{CacheReset, EngineStats};

/// The part of a [`GenerationRequest`] an engine refusal is about: the
/// fields whose rules only the engine can check (the front end owns the
/// others). The engine does not know which API a request came through;
/// each front end names the field in its own terms (the prompt is
/// `messages` in chat, `prompt` in completions, `input` in the Responses
/// API).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestField {
    /// The prompt: its messages, text or token ids (an empty prompt, a token
    /// id outside the vocabulary, a template that refuses the messages).
    Prompt,
    /// The number of choices.
    N,
    /// The logit bias.
    LogitBias,
    /// The tool choice.
    ToolChoice,
    /// The output format (`response_format`).
    ResponseFormat,
    /// The code after the cursor of a fill-in-the-middle prompt
    /// (completions' `suffix`): refused for a model without FIM tokens.
    Suffix,
}

impl RequestField {
    /// The field's name in OpenAI's Chat Completions API.
    pub fn chat_name(self) -> &'static str {
        match self {
            Self::Prompt => "messages",
            Self::N => "n",
            Self::LogitBias => "logit_bias",
            Self::ToolChoice => "tool_choice",
            Self::ResponseFormat => "response_format",
            Self::Suffix => "suffix",
        }
    }
}

/// How an embedding's token states are pooled into one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The last token's final hidden state (Qwen3-Embedding style; what
    /// `--embeddings` gives any decoder).
    LastToken,
    /// The mean of every token's final hidden state.
    Mean,
}

/// What a model that serves embeddings gives ([`InferenceService::embedding_model`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingModel {
    /// How token states become one vector (then L2-normalised).
    pub pooling: Pooling,
    /// The vector's length: the model's hidden size.
    pub dimensions: usize,
}

/// Why a request was refused before it ran.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// The request cannot be served as asked (HTTP 400). `field` is the
    /// part of the request at fault where there is one; the front end names
    /// it in its own API's terms.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        field: Option<RequestField>,
    },
    /// The prompt does not fit the model's context (HTTP 400, OpenAI code
    /// `context_length_exceeded`).
    #[error(
        "the prompt has {prompt_tokens} tokens; this model's context is {context_length} tokens"
    )]
    ContextLengthExceeded {
        prompt_tokens: usize,
        context_length: usize,
    },
    /// The engine is gone or shutting down (HTTP 503).
    #[error("engine unavailable: {0}")]
    Unavailable(String),
}

/// What a front end needs from an engine. Implemented by the real engine
/// handle and by test fakes.
pub trait InferenceService: Send + Sync + 'static {
    /// The name the model is served under (`--alias` or the directory name).
    fn model_id(&self) -> &str;
    /// The model's context length in tokens.
    fn context_length(&self) -> usize;
    /// Validate, tokenize and queue a request; events arrive on the stream.
    fn submit(&self, request: GenerationRequest) -> Result<EventStream, SubmitError>;
    /// The text of `tokens` (special tokens included), as the model's
    /// tokenizer decodes them: `/v1/completions` echoes token prompts with
    /// it. Errors: an id outside the vocabulary (`InvalidRequest`).
    fn detokenize(&self, tokens: &[u32]) -> Result<String, SubmitError>;
    /// The token ids of a prompt, rendered and encoded as `submit` would
    /// (`/tokenize`). Errors: template and tokenizer failures, ids outside
    /// the vocabulary, tools with a text prompt (`InvalidRequest`).
    fn tokenize(&self, request: &TokenizeRequest) -> Result<Vec<u32>, SubmitError>;
    /// The engine's counters and gauges now.
    fn stats(&self) -> EngineStats;
    /// Whether and how the model serves embeddings (an embedding
    /// checkpoint, or any decoder under `--embeddings`); `None`: it does
    /// not.
    fn embedding_model(&self) -> Option<EmbeddingModel> {
        None
    }
    /// Tokenize and queue a prompt to embed; its one
    /// [`crate::GenerationEvent::Embedding`] (or `Failed`) arrives on the
    /// stream. Errors: a model that serves no embeddings, an empty prompt
    /// or ids outside the vocabulary (`InvalidRequest`, field `Prompt`), a
    /// prompt past the context (`ContextLengthExceeded`).
    fn embed(&self, request: EmbeddingRequest) -> Result<EventStream, SubmitError> {
        let _ = request;
        Err(SubmitError::InvalidRequest {
            message: "this model does not serve embeddings".into(),
            field: None,
        })
    }
    /// Frees every prefix-cache block no running request holds and,
    /// unless `keep_disk`, deletes the disk tier's block files.
    fn reset_prefix_cache(&self, keep_disk: bool) -> Result<CacheReset, SubmitError>;
    /// Whether the engine serves requests yet (`GET /health` answers 503
    /// `starting` until then): false while the model loads and warms up.
    fn ready(&self) -> bool {
        true
    }
    /// Why the engine can no longer serve, when it can't (`GET /health`
    /// answers 503 `unhealthy`): e.g. a tensor-parallel rank that died.
    fn unhealthy(&self) -> Option<String> {
        None
    }
}

/// An [`InferenceService`] that exists before its engine: a server listens
/// (and answers `GET /health` with `starting`) while the model loads and
/// warms up, then [`ServiceSlot::fill`] hands it the engine. Until then
/// requests get [`SubmitError::Unavailable`] (HTTP 503) and the stats are
/// empty.
pub struct ServiceSlot {
    model_id: String,
    context_length: usize,
    engine: std::sync::OnceLock<std::sync::Arc<dyn InferenceService>>,
}

impl ServiceSlot {
    /// An empty slot for the model served as `model_id` with a context of
    /// `context_length` tokens.
    pub fn new(model_id: String, context_length: usize) -> Self {
        Self {
            model_id,
            context_length,
            engine: std::sync::OnceLock::new(),
        }
    }

    /// Puts the ready engine in the slot (a second call is ignored).
    pub fn fill(&self, engine: std::sync::Arc<dyn InferenceService>) {
        let _ = self.engine.set(engine);
    }

    fn engine(&self) -> Result<&dyn InferenceService, SubmitError> {
        self.engine
            .get()
            .map(|e| e.as_ref())
            .ok_or_else(|| SubmitError::Unavailable("the model is still loading".into()))
    }
}

impl InferenceService for ServiceSlot {
    fn model_id(&self) -> &str {
        &self.model_id
    }
    fn context_length(&self) -> usize {
        self.context_length
    }
    fn submit(&self, request: GenerationRequest) -> Result<EventStream, SubmitError> {
        self.engine()?.submit(request)
    }
    fn detokenize(&self, tokens: &[u32]) -> Result<String, SubmitError> {
        self.engine()?.detokenize(tokens)
    }
    fn tokenize(&self, request: &TokenizeRequest) -> Result<Vec<u32>, SubmitError> {
        self.engine()?.tokenize(request)
    }
    fn stats(&self) -> EngineStats {
        self.engine().map(|e| e.stats()).unwrap_or_default()
    }
    fn reset_prefix_cache(&self, keep_disk: bool) -> Result<CacheReset, SubmitError> {
        self.engine()?.reset_prefix_cache(keep_disk)
    }
    fn embedding_model(&self) -> Option<EmbeddingModel> {
        self.engine.get().and_then(|e| e.embedding_model())
    }
    fn embed(&self, request: EmbeddingRequest) -> Result<EventStream, SubmitError> {
        self.engine()?.embed(request)
    }
    fn ready(&self) -> bool {
        self.engine.get().is_some_and(|e| e.ready())
    }
    fn unhealthy(&self) -> Option<String> {
        self.engine.get().and_then(|e| e.unhealthy())
    }
}
