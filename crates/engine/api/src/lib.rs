//! The seam between a front end (HTTP server, CLI) and the engine.
//!
//! A front end builds a [`GenerationRequest`], calls
//! [`InferenceService::submit`], and reads [`GenerationEvent`]s from the
//! returned stream until a `Finished` or `Failed` event. Dropping the stream
//! cancels the request at the engine's next step.

use serde::{Deserialize, Serialize};

/// One chat message, as the chat template sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Plain text content; `None` for an assistant message that only calls
    /// tools.
    pub content: Option<String>,
    /// Tool calls an assistant message made (empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// On a `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Optional participant name (on `tool` messages: the function's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An earlier assistant reply's reasoning, as clients send the reply
    /// back (`reasoning_content`); the chat template sees it under that
    /// name (Qwen3's reads it, most ignore it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message of `role` with text `content` and nothing else.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            ..Self::default()
        }
    }
}

/// One function call made by the model (OpenAI's `tool_calls[i]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// `call_` followed by random characters; echoed back by the client in
    /// the `tool` message that answers it.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The arguments, as JSON text (an object).
    pub arguments: String,
}

/// A function the model may call (OpenAI's `tools[i].function`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// The function's name.
    pub name: String,
    /// What it does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of its arguments (`{"type": "object", ...}`).
    pub parameters: serde_json::Value,
}

/// Whether and which tools the model must call (OpenAI's `tool_choice`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides; calls are parsed from its output.
    #[default]
    Auto,
    /// No tools: they are not rendered and nothing is parsed.
    None,
    /// At least one call, enforced by constrained decoding.
    Required,
    /// Exactly one call of this function, enforced by constrained decoding.
    Function(String),
}

/// A grammar the completion must follow, enforced token by token
/// (constrained decoding), never by retrying.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this schema (`{"type": "json_schema", ...}`).
    JsonSchema(serde_json::Value),
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

/// A prompt to count, as `/tokenize` asks: rendered and encoded exactly
/// as [`InferenceService::submit`] would run it, so that its length is the
/// `prompt_tokens` of the same request.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizeRequest {
    /// Chat messages (rendered through the chat template), text, or token
    /// ids (checked against the vocabulary and returned as they are).
    pub prompt: Prompt,
    /// Chat prompts: end with the header of an assistant turn, as every
    /// generation does (vLLM's default, true).
    pub add_generation_prompt: bool,
    /// Text prompts: add the tokenizer's special tokens (a BOS the text
    /// does not already start with), as `/v1/completions` does.
    pub add_special_tokens: bool,
    /// Functions rendered with a chat prompt, as a request offering them
    /// renders them.
    pub tools: Vec<ToolDefinition>,
    /// Extra chat template variables (see
    /// [`GenerationRequest::chat_template_kwargs`]).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
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
    /// OpenAI's presence penalty in [-2, 2]: subtracted once from the logit
    /// of every token already generated; 0 disables it.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty in [-2, 2]: subtracted from a token's
    /// logit once per time it was generated; 0 disables it.
    pub frequency_penalty: f32,
    /// CTRL-style repetition penalty (Keskar et al. 2019, as in
    /// `transformers` and mlx-lm) over the prompt and completion tokens:
    /// positive logits are divided by it, negative ones multiplied; 1
    /// disables it.
    pub repetition_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
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

/// Chat template variables the engine sets itself; a request's
/// `chat_template_kwargs` cannot set them.
pub const RESERVED_TEMPLATE_VARIABLES: &[&str] = &[
    "messages",
    "tools",
    "add_generation_prompt",
    "documents",
    "bos_token",
    "eos_token",
];

/// A validated request for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Upper bound on completion tokens of each choice (>= 1). The engine
    /// may stop earlier at EOS, a stop string, or the context length.
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens (benchmarks; vLLM's
    /// `ignore_eos`).
    pub ignore_eos: bool,
    /// End-of-sequence tokens cannot be sampled before this many completion
    /// tokens (vLLM's `min_tokens`; 0: no floor). Stop strings, the output
    /// grammar and `max_tokens` still end a choice.
    pub min_tokens: usize,
    /// Extra variables for the chat template (vLLM's `chat_template_kwargs`,
    /// e.g. `enable_thinking`); never one the engine sets itself
    /// (`messages`, `tools`, `add_generation_prompt`, `documents`,
    /// `bos_token`, `eos_token`).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Read the prompt's prefix from the prefix cache and donate the
    /// request's blocks to it (llama.cpp's `cache_prompt`; default true).
    pub cache_prompt: bool,
    /// Stop strings (at most 4, non-empty): generation ends before the
    /// first one to appear in the text, which is not returned.
    pub stop: Vec<String>,
    /// Added to the logits of these token ids before sampling (OpenAI's
    /// `logit_bias`, values in [-100, 100]).
    pub logit_bias: Vec<(u32, f32)>,
    /// `Some(k)`: report each sampled token's log-probability and the `k`
    /// (0..=20) most likely alternatives.
    pub logprobs: Option<usize>,
    /// `Some(k)`: report the log-probability of every prompt token after
    /// the first, given the tokens before it, with the `k` most likely
    /// alternatives (vLLM's `prompt_logprobs`; OpenAI completions' `echo`
    /// with `logprobs`). The model's own distribution: no logit bias,
    /// penalties or grammar. The whole prompt is computed (the prefix cache
    /// is not read for it), in chunks of at most 128 tokens.
    pub prompt_logprobs: Option<usize>,
    /// Choices generated from the one prompt (>= 1); they share the
    /// prompt's KV blocks.
    pub n: usize,
    /// Grammar the output must follow (`response_format`).
    pub response_format: Option<ResponseFormat>,
    /// Functions the model may call; rendered through the chat template
    /// (chat prompts only).
    pub tools: Vec<ToolDefinition>,
    /// Whether the model must call them.
    pub tool_choice: ToolChoice,
    /// `false`: at most one tool call (a required call is constrained to
    /// exactly one).
    pub parallel_tool_calls: bool,
}

impl GenerationRequest {
    /// A request of `prompt` with these sampling settings and budget, and
    /// every other option off: one choice, no stop strings, no logprobs,
    /// no tools, the prompt cache on.
    pub fn new(prompt: Prompt, sampling: SamplingParams, max_tokens: usize) -> Self {
        Self {
            prompt,
            sampling,
            max_tokens,
            ignore_eos: false,
            min_tokens: 0,
            chat_template_kwargs: serde_json::Map::new(),
            cache_prompt: true,
            stop: Vec::new(),
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            n: 1,
            response_format: None,
            tools: Vec::new(),
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
        }
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token was sampled (it is not part of the text),
    /// a stop string appeared, or the output grammar was complete.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The model called tools (sent as [`GenerationEvent::ToolCallStart`]
    /// and [`GenerationEvent::ToolCallArguments`]).
    ToolCalls,
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

/// Log-probability of one token (natural log, after logit bias and
/// penalties, before temperature and the top-k/top-p/min-p filters, as
/// OpenAI and vLLM report them).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// Token id.
    pub id: u32,
    /// The token's text; bytes that are not valid UTF-8 on their own are
    /// shown as U+FFFD.
    pub text: String,
    /// The token's exact bytes.
    pub bytes: Vec<u8>,
    /// `ln p(token)`.
    pub logprob: f32,
}

/// The log-probabilities reported for one sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledLogprobs {
    /// The sampled token.
    pub token: TokenLogprob,
    /// The `k` most likely tokens at this position, most likely first.
    pub top: Vec<TokenLogprob>,
}

/// One event on a request's stream. `index` is the choice (0..n) it
/// belongs to.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// New text, completed by `token`. `text` may be empty when a token ends
    /// inside a multi-byte character, or inside what may become a stop
    /// string or a tool call (it is held back until decided). An EOS token
    /// is sent only when held-back text is left.
    Delta {
        index: usize,
        token: u32,
        text: String,
        /// Reasoning text completed by `token`, which comes before `text`
        /// (reasoning models, chat prompts: the `<think>` block, see the
        /// engine's `reasoning` module); empty otherwise.
        reasoning: String,
        /// Set when the request asked for logprobs.
        logprobs: Option<SampledLogprobs>,
    },
    /// The prompt's log-probabilities (requests with `prompt_logprobs`):
    /// the first token, then one entry per prompt token after it. Sent once, on
    /// choice 0, before its first `Delta`; every choice shares the prompt.
    PromptLogprobs {
        index: usize,
        /// The first prompt token (id, text, bytes); it has no context, so
        /// its `logprob` is 0 and means nothing (OpenAI shows `null`).
        first: TokenLogprob,
        logprobs: Vec<SampledLogprobs>,
    },
    /// A tool call of choice `index` begins: its id (`call_...`) and the
    /// function it calls. Its arguments follow as
    /// [`GenerationEvent::ToolCallArguments`]; none of the call's text is
    /// sent as a `Delta`. A token's `Delta` comes before the tool-call
    /// events it completed.
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of the arguments of choice `index`'s latest tool call: JSON
    /// text as generated. The call's arguments are the concatenation of
    /// its fragments (valid JSON once the call is complete; a call cut by
    /// `max_tokens` keeps what was generated).
    ToolCallArguments { index: usize, arguments: String },
    /// Choice `index` ended normally; every piece of its text was sent
    /// before this event. The request ends when every choice has.
    Finished {
        index: usize,
        reason: FinishReason,
        usage: Usage,
        timings: Timings,
    },
    /// The request failed inside the engine (every choice ends); nothing
    /// else was affected.
    Failed { message: String },
}

/// The part of a [`GenerationRequest`] a refusal is about. The engine
/// does not know which API a request came through; each front end names
/// the field in its own terms (the prompt is `messages` in chat, `prompt`
/// in completions, `input` in the Responses API).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestField {
    /// The prompt: its messages, text or token ids (an empty prompt, a token
    /// id outside the vocabulary, a template that refuses the messages).
    Prompt,
    /// The number of choices.
    N,
    /// The logit bias.
    LogitBias,
    /// The tools offered.
    Tools,
    /// The tool choice.
    ToolChoice,
    /// The output format (`response_format`).
    ResponseFormat,
    /// The floor on completion tokens.
    MinTokens,
    /// The extra chat template variables.
    ChatTemplateKwargs,
}

impl RequestField {
    /// The field's name in OpenAI's Chat Completions API.
    pub fn chat_name(self) -> &'static str {
        match self {
            Self::Prompt => "messages",
            Self::N => "n",
            Self::LogitBias => "logit_bias",
            Self::Tools => "tools",
            Self::ToolChoice => "tool_choice",
            Self::ResponseFormat => "response_format",
            Self::MinTokens => "min_tokens",
            Self::ChatTemplateKwargs => "chat_template_kwargs",
        }
    }
}

/// The receiving end of a request's events.
pub type EventStream = tokio::sync::mpsc::UnboundedReceiver<GenerationEvent>;

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
    /// Frees every prefix-cache block no running request holds.
    fn reset_prefix_cache(&self) -> Result<CacheReset, SubmitError>;
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
    fn reset_prefix_cache(&self) -> Result<CacheReset, SubmitError> {
        self.engine()?.reset_prefix_cache()
    }
    fn ready(&self) -> bool {
        self.engine.get().is_some_and(|e| e.ready())
    }
    fn unhealthy(&self) -> Option<String> {
        self.engine.get().and_then(|e| e.unhealthy())
    }
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
    /// Decode-row attentions by path: together over the paged pool (the
    /// paged-attention kernel, or a padded batch), or one row at a time.
    pub attention_batched_rows: u64,
    pub attention_per_row_rows: u64,
    /// Decode steps queued before the previous step's tokens were read
    /// (pipelined decode).
    pub pipelined_steps: u64,
}
