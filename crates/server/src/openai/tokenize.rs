//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes): request and
//! response bodies.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::message::{ChatMessage, Tool};
use super::request::Unknown;

/// The body of `POST /tokenize`: a text `prompt` or chat `messages`
/// (exactly one of them).
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = TokenizeRequest)]
pub struct TokenizeBody {
    /// Must be the served model's id when given; another name is a 404.
    pub model: Option<String>,
    /// Text, encoded as `/v1/completions` encodes a prompt.
    pub prompt: Option<String>,
    /// Chat messages, rendered through the chat template as
    /// `/v1/chat/completions` renders them.
    #[schema(min_items = 1)]
    pub messages: Option<Vec<ChatMessage>>,
    /// With `messages`: end with the assistant turn's header, as every
    /// chat request does.
    #[schema(default = true)]
    pub add_generation_prompt: Option<bool>,
    /// With `prompt`: add the tokenizer's special tokens (a BOS), default
    /// true. With `messages` only false (the template writes them).
    pub add_special_tokens: Option<bool>,
    /// Only false (vLLM extension not supported).
    pub continue_final_message: Option<bool>,
    /// Only false: the token strings are not returned.
    pub return_token_strs: Option<bool>,
    /// With `messages`: the functions offered, rendered as a chat request
    /// offering them renders them.
    pub tools: Option<Vec<Tool>>,
    /// With `messages`: extra chat template variables (see the chat
    /// request).
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// The answer of `POST /tokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct TokenizeResponse {
    /// `tokens.len()`: for chat messages, the `prompt_tokens` of the same
    /// chat request.
    pub count: usize,
    /// The model's context length in tokens.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Always null (token strings are not returned).
    #[schema(value_type = Option<Vec<String>>, required = true)]
    pub token_strs: Option<()>,
}

/// The body of `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = DetokenizeRequest)]
pub struct DetokenizeBody {
    /// Must be the served model's id when given; another name is a 404.
    pub model: Option<String>,
    /// Token ids of the served tokenizer's vocabulary.
    #[schema(value_type = Vec<u32>)]
    pub tokens: Vec<i128>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// The answer of `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    /// The text of the tokens, special tokens included.
    pub prompt: String,
}
