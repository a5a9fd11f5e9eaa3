//! What a front end asks the engine: a [`GenerationRequest`] (its
//! [`Prompt`], [`SamplingParams`], tools and output grammar) and, for
//! `/tokenize`, a [`TokenizeRequest`].

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use crate::InferenceService;

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
    /// A fill-in-the-middle prompt, built from the model's FIM tokens
    /// (`mlxcel_text::fim`); refused for a model without them.
    Infill(Infill),
}

/// What a fill-in-the-middle prompt is made of (llama-server's `/infill`
/// fields; OpenAI completions' `prompt` and `suffix`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Infill {
    /// The code before the cursor.
    pub prefix: String,
    /// The code after the cursor.
    pub suffix: String,
    /// Other files of the project, before the prefix (llama-server's
    /// `input_extra`).
    pub extra: Vec<InfillFile>,
    /// Text after the middle token that the model continues
    /// (llama-server's `prompt`); usually empty.
    pub middle: String,
}

/// One file of an infill's extra context.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InfillFile {
    pub filename: String,
    pub text: String,
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

/// A prompt to embed (`/v1/embeddings`): its final hidden states pooled
/// into one L2-normalised vector ([`crate::EmbeddingModel`]). Runs through
/// the engine like any prompt, prefill only, batched with other requests.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingRequest {
    /// Text (encoded with the tokenizer's special tokens, as completions
    /// encode a prompt) or token ids; never chat messages or an infill.
    pub prompt: Prompt,
    /// Read the prompt's prefix from the prefix cache (last-token pooling
    /// only: mean pooling needs every position, so it computes the whole
    /// prompt) and donate its blocks to it.
    pub cache_prompt: bool,
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
    /// Let the engine verify draft tokens for this request when it
    /// speculates (`--speculative`; default true). Greedy output is the
    /// same either way; `false` opts a request out.
    pub speculative: bool,
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
            speculative: true,
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
