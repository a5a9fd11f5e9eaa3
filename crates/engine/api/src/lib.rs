//! The seam between a front end (HTTP server, CLI) and the engine.
//!
//! A front end builds a [`GenerationRequest`], calls
//! [`InferenceService::submit`], and reads [`GenerationEvent`]s from the
//! returned stream until a `Finished` or `Failed` event. Dropping the stream
//! cancels the request at the engine's next step.

use serde::{Deserialize, Serialize};

/// One chat message, as the chat template sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or `tool`).
    pub role: String,
    /// Plain text content.
    pub content: String,
}

/// What to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Messages rendered through the model's chat template with
    /// `add_generation_prompt = true`.
    Chat(Vec<ChatMessage>),
    /// Raw text, tokenized as-is (special tokens as the tokenizer adds them).
    Text(String),
    /// Token ids, used as-is.
    Tokens(Vec<u32>),
}

/// Sampling parameters of one request. Validated by the front end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax). Otherwise logits are divided by it.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p` times the top
    /// probability; 0 disables it.
    pub min_p: f32,
    /// Seed of the request's random generator; `None` picks one.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0).
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }
}

/// A validated request for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Upper bound on completion tokens (>= 1). The engine may stop earlier
    /// at EOS or at the model's context length.
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens (benchmarks; vLLM's
    /// `ignore_eos`).
    pub ignore_eos: bool,
    /// Read the prompt's prefix from the prefix cache and donate the
    /// request's blocks to it (llama.cpp's `cache_prompt`; default true).
    pub cache_prompt: bool,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token was sampled (it is not part of the text).
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

/// Token accounting of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the (rendered) prompt.
    pub prompt_tokens: usize,
    /// Tokens generated, including a final EOS token.
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

/// Timing of one finished request, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Time from submission to the first completion token (TTFT).
    pub time_to_first_token_s: f64,
    /// Time spent in prefill forwards.
    pub prefill_s: f64,
    /// Time spent from the first to the last completion token.
    pub decode_s: f64,
}

/// One event on a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// New text, completed by `token`. `text` may be empty when a token ends
    /// inside a multi-byte character (it is held back until the character
    /// is complete). An EOS token is sent only when held-back text is left.
    Delta { token: u32, text: String },
    /// The request ended normally; every piece of text was sent in a
    /// `Delta` before this event.
    Finished {
        reason: FinishReason,
        usage: Usage,
        timings: Timings,
    },
    /// The request failed inside the engine; nothing else was affected.
    Failed { message: String },
}

/// The receiving end of a request's events.
pub type EventStream = tokio::sync::mpsc::UnboundedReceiver<GenerationEvent>;

/// Why a request was refused before it ran.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// The request cannot be served as asked (HTTP 400). `param` names the
    /// offending field where there is one.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
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
    /// The engine's counters and gauges now.
    fn stats(&self) -> EngineStats;
    /// Frees every prefix-cache block no running request holds.
    fn reset_prefix_cache(&self) -> Result<CacheReset, SubmitError>;
}

/// What `/v1/cache/reset` freed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheReset {
    /// Cached blocks nobody held, now empty.
    pub blocks_freed: usize,
    /// Their K/V size in bytes.
    pub bytes_freed: usize,
}

/// A snapshot of the engine's scheduler and KV cache, updated every step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Sequences running (admitted, holding KV).
    pub running: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// `dense` or `paged`.
    pub kv_storage_backend: String,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Bytes of K/V per block.
    pub kv_block_bytes: usize,
    /// Blocks in the pool.
    pub kv_blocks_total: usize,
    /// Blocks holding K/V: held by a running request or by the prefix cache.
    pub kv_blocks_used: usize,
    /// Empty blocks.
    pub kv_blocks_free: usize,
    /// Blocks held by running requests.
    pub kv_blocks_active: usize,
    /// Blocks registered in the prefix cache (held or not).
    pub kv_blocks_cached: usize,
    /// Prefix cache on.
    pub prefix_cache_enabled: bool,
    /// Most unreferenced cached blocks kept.
    pub prefix_cache_capacity_blocks: usize,
    /// Prefix-cache lookups, hits (at least one block), misses.
    pub prefix_cache_lookups: u64,
    pub prefix_cache_hits: u64,
    pub prefix_cache_misses: u64,
    /// Prompt tokens looked up, and those served from the cache.
    pub prefix_cache_tokens_queried: u64,
    pub prefix_cache_tokens_reused: u64,
    /// Blocks newly cached; cached blocks evicted to reuse them.
    pub prefix_cache_inserts: u64,
    pub prefix_cache_evictions: u64,
    /// Forwards run.
    pub steps: u64,
    /// Forwards that failed (their requests failed; the engine went on).
    pub failed_steps: u64,
    /// Steps with at least one prefill row / one decode row.
    pub prefill_steps: u64,
    pub decode_steps: u64,
    /// Real prompt tokens prefilled, pad tokens run and rewound, decode
    /// tokens run.
    pub prefill_tokens: u64,
    pub pad_tokens: u64,
    pub decode_tokens: u64,
    /// Decode-row attentions by path: padded batch over the paged pool, or
    /// one row at a time.
    pub attention_batched_rows: u64,
    pub attention_per_row_rows: u64,
}
