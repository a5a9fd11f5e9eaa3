//! Parsing request bodies into validated types: [`ValidatedChatRequest`]
//! for `/v1/chat/completions`, [`ValidatedCompletionRequest`] for
//! `/v1/completions`.
//!
//! serde reads a body into the wire types of [`crate::openai::request`]
//! (a wrong type or a missing field becomes a [`ValidationError`] naming the
//! field's path, e.g. `messages[0].content[1].text`); this module then
//! applies the range and relation rules, each its own variant naming the
//! offending `param`, and builds the engine's request. Fields of the OpenAI
//! API that mlxcel does not implement yet are refused when they carry a
//! non-default value, never silently ignored. Validation runs before
//! anything is submitted to the engine.

mod chat;
mod completion;
mod embeddings;
mod infill;
mod messages;
mod params;
mod responses;
mod tokenize;
mod tools;

pub use chat::ValidatedChatRequest;
pub use completion::ValidatedCompletionRequest;
pub use embeddings::{ValidatedEmbeddingsRequest, MAX_INPUTS};
pub use infill::ValidatedInfillRequest;
pub use messages::ValidatedMessagesRequest;
pub use responses::{ConversationItem, ValidatedResponsesRequest};
pub use tokenize::{ValidatedDetokenizeRequest, ValidatedTokenizeRequest};

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::openai::request::Unknown;

/// A broken rule of a request schema. `param` names the field at fault, as
/// OpenAI does (`messages[0].role`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValidationError {
    /// The body is JSON but not an object.
    #[error("The request body must be a JSON object")]
    BodyNotObject,
    /// A field has the wrong JSON type.
    #[error("Invalid type for '{param}': expected {expected}")]
    WrongType {
        /// The field.
        param: String,
        /// What it should have been.
        expected: &'static str,
    },
    /// A required field is absent or null.
    #[error("Missing required parameter: '{0}'")]
    Missing(String),
    /// `messages` is an empty array.
    #[error("'messages' must contain at least one message")]
    EmptyMessages,
    /// A message role other than system, developer, user, assistant or tool.
    #[error("Invalid value for '{param}': '{role}' (supported: system, developer, user, assistant, tool)")]
    UnsupportedRole {
        /// The field (`messages[i].role`).
        param: String,
        /// The role sent.
        role: String,
    },
    /// A message field that its role cannot carry: `tool_calls` outside an
    /// assistant message, `tool_call_id` outside a tool message.
    #[error("'{param}' is not allowed on a message with role '{role}'")]
    MisplacedMessageField {
        /// The field (`messages[i].tool_calls`).
        param: String,
        /// The message's role.
        role: String,
    },
    /// A `tool` message whose `tool_call_id` answers no call of an earlier
    /// assistant message.
    #[error(
        "Invalid value for '{param}': '{id}' answers no tool call of an earlier assistant message"
    )]
    UnknownToolCallId {
        /// The field (`messages[i].tool_call_id`).
        param: String,
        /// The id sent.
        id: String,
    },
    /// A content part whose `type` is not `text`.
    #[error("Invalid value for '{param}': '{kind}' (only 'text' parts are supported)")]
    UnsupportedContentPart {
        /// The field (`messages[i].content[j].type`).
        param: String,
        /// The type sent.
        kind: String,
    },
    /// `max_tokens` or `max_completion_tokens` below 1.
    #[error("Invalid value for '{param}': {value} (must be at least 1)")]
    MaxTokensTooSmall {
        /// `max_tokens` or `max_completion_tokens`.
        param: &'static str,
        /// The value sent.
        value: i128,
    },
    /// `max_tokens` and `max_completion_tokens` both given, with different
    /// values.
    #[error("'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({max_completion_tokens}) disagree; set only one")]
    ConflictingMaxTokens {
        /// The `max_tokens` sent.
        max_tokens: usize,
        /// The `max_completion_tokens` sent.
        max_completion_tokens: usize,
    },
    /// `temperature` outside [0, 2].
    #[error("Invalid value for 'temperature': {0} (must be between 0 and 2)")]
    TemperatureOutOfRange(f64),
    /// `top_p` outside (0, 1].
    #[error("Invalid value for 'top_p': {0} (must be greater than 0 and at most 1)")]
    TopPOutOfRange(f64),
    /// `top_k` below 0.
    #[error("Invalid value for 'top_k': {0} (must be at least 0; 0 disables it)")]
    TopKNegative(i128),
    /// `min_p` outside [0, 1].
    #[error("Invalid value for 'min_p': {0} (must be between 0 and 1)")]
    MinPOutOfRange(f64),
    /// `presence_penalty` or `frequency_penalty` outside [-2, 2].
    #[error("Invalid value for '{param}': {value} (must be between -2 and 2)")]
    PenaltyOutOfRange {
        /// `presence_penalty` or `frequency_penalty`.
        param: &'static str,
        /// The value sent.
        value: f64,
    },
    /// `repetition_penalty` outside (0, 2].
    #[error("Invalid value for 'repetition_penalty': {0} (must be greater than 0 and at most 2; 1 disables it)")]
    RepetitionPenaltyOutOfRange(f64),
    /// `stop` is an array with no strings or more than four.
    #[error("Invalid value for 'stop': {0} strings (1 to 4 are allowed)")]
    StopCount(usize),
    /// An empty stop string.
    #[error("Invalid value for '{param}': stop strings must not be empty")]
    EmptyStop {
        /// `stop` or `stop[i]`.
        param: String,
    },
    /// A `logit_bias` key that is not a token id.
    #[error("Invalid key in 'logit_bias': '{0}' (keys are token ids)")]
    LogitBiasKey(String),
    /// A `logit_bias` value outside [-100, 100].
    #[error(
        "Invalid value in 'logit_bias' for token {token}: {value} (must be between -100 and 100)"
    )]
    LogitBiasOutOfRange {
        /// The token id.
        token: u32,
        /// The bias sent.
        value: f64,
    },
    /// Chat `top_logprobs` outside 0..=20.
    #[error("Invalid value for 'top_logprobs': {0} (must be between 0 and 20)")]
    TopLogprobsOutOfRange(i128),
    /// Chat `top_logprobs` without `logprobs: true`.
    #[error("'top_logprobs' is only allowed when 'logprobs' is true")]
    TopLogprobsWithoutLogprobs,
    /// Completions `logprobs` outside 0..=5.
    #[error("Invalid value for 'logprobs': {0} (must be between 0 and 5)")]
    LogprobsOutOfRange(i128),
    /// `n` outside 1..=16.
    #[error("Invalid value for 'n': {0} (must be between 1 and 16)")]
    NOutOfRange(i128),
    /// Completions `best_of` other than `n`.
    #[error("Invalid value for 'best_of': {best_of} (only best_of = n, here {n}, is supported)")]
    BestOfNotN {
        /// The value sent.
        best_of: i128,
        /// The request's `n`.
        n: usize,
    },
    /// `stream_options` without `stream: true`.
    #[error("'stream_options' is only allowed when 'stream' is true")]
    StreamOptionsWithoutStream,
    /// A `response_format.type` other than text, json_object, json_schema.
    #[error("Invalid value for 'response_format.type': '{0}' (supported: text, json_object, json_schema)")]
    UnsupportedResponseFormat(String),
    /// A tool (or tool call, or named tool choice) whose `type` is not
    /// `function`.
    #[error("Invalid value for '{param}': '{kind}' (only 'function' is supported)")]
    UnsupportedToolType {
        /// The field (`tools[i].type`).
        param: String,
        /// The type sent.
        kind: String,
    },
    /// A function name outside `^[a-zA-Z0-9_-]{1,64}$`.
    #[error("Invalid value for '{param}': '{name}' (function names are 1 to 64 letters, digits, '_' or '-')")]
    InvalidToolName {
        /// The field (`tools[i].function.name`).
        param: String,
        /// The name sent.
        name: String,
    },
    /// A `tool_choice` string other than none, auto, required.
    #[error("Invalid value for 'tool_choice': '{0}' (supported: none, auto, required, or a named function)")]
    UnsupportedToolChoice(String),
    /// `tool_choice` `required` or a named function without `tools`.
    #[error("'tool_choice' requires 'tools'")]
    ToolChoiceWithoutTools,
    /// A named `tool_choice` that is not among `tools`.
    #[error("Invalid value for 'tool_choice.function.name': '{0}' is not among 'tools'")]
    UnknownToolChoice(String),
    /// An empty `prompt` list, or an empty token list in it.
    #[error("Invalid value for '{param}': prompts must not be empty")]
    EmptyPrompt {
        /// `prompt` or `prompt[i]`.
        param: String,
    },
    /// A prompt token id that is not a u32.
    #[error("Invalid value for '{param}': {value} is not a token id")]
    TokenIdOutOfRange {
        /// The field (`prompt[i]`, `prompt[i][j]`).
        param: String,
        /// The value sent.
        value: i128,
    },
    /// `model` names a model this server does not serve.
    #[error("The model `{0}` does not exist")]
    ModelNotFound(String),
    /// An OpenAI field that mlxcel does not implement yet, with a non-default
    /// value.
    #[error("'{param}' is not supported by this server yet")]
    UnsupportedParameter {
        /// The field.
        param: String,
    },
    /// `min_tokens` above the request's `max_tokens`.
    #[error("Invalid value for 'min_tokens': {min_tokens} (more than max_tokens, {max_tokens})")]
    MinTokensAboveMax {
        /// The value sent.
        min_tokens: usize,
        /// The request's token budget.
        max_tokens: usize,
    },
    /// A `metadata` map beyond OpenAI's limits (16 pairs, keys of at most
    /// 64 characters, values of at most 512).
    #[error("Invalid value for '{param}': {limit}")]
    MetadataLimit {
        /// `metadata` or `metadata.<key>`.
        param: String,
        /// The limit broken.
        limit: &'static str,
    },
    /// A `chat_template_kwargs` key the server sets itself.
    #[error("Invalid key in 'chat_template_kwargs': '{0}' is set by the server")]
    ReservedTemplateVariable(String),
    /// A field that is not part of the request.
    #[error("Unrecognized request argument supplied: '{param}'")]
    UnrecognizedParameter {
        /// The field.
        param: String,
    },
    /// `/tokenize` with both or neither of `prompt` and `messages`.
    #[error("Exactly one of 'prompt' and 'messages' is required")]
    PromptOrMessages,
    /// A field that cannot be used together with another one.
    #[error("'{param}' cannot be used with '{with}'")]
    NotWith {
        /// The field.
        param: String,
        /// The field it excludes.
        with: &'static str,
    },
    /// A field that only applies together with another one.
    #[error("'{param}' is only allowed with '{with}'")]
    OnlyWith {
        /// The field.
        param: String,
        /// The field it needs.
        with: &'static str,
    },
    /// A Responses input item whose `type` (or content part type) mlxcel
    /// does not serve (reasoning, images, item references, built-in tool
    /// calls).
    #[error("Invalid value for '{param}': '{kind}' (supported: {supported})")]
    UnsupportedItemType {
        /// The field (`input[i].type`).
        param: String,
        /// The type sent.
        kind: String,
        /// The types that are served.
        supported: &'static str,
    },
    /// A `function_call_output` whose `call_id` answers no earlier
    /// `function_call`.
    #[error("No tool call found for function call output with call_id '{call_id}'")]
    UnknownCallId {
        /// The field (`input[i].call_id`).
        param: String,
        /// The id sent.
        call_id: String,
    },
    /// `previous_response_id` names no stored response (never stored,
    /// evicted, or deleted).
    #[error("Previous response with id '{0}' not found")]
    PreviousResponseNotFound(String),
    /// `store: true` (or `previous_response_id`) on a server whose
    /// response store is off (`--responses-store-size 0`).
    #[error("'{0}' needs the response store, which this server has turned off (--responses-store-size 0)")]
    StoreDisabled(&'static str),
    /// A number outside the range its field allows (Anthropic Messages:
    /// `temperature`, `top_p`, `top_k`, `max_tokens`,
    /// `thinking.budget_tokens`).
    #[error("Invalid value for '{param}': {value} (must be {range})")]
    ValueOutOfRange {
        /// The field.
        param: String,
        /// The value sent.
        value: String,
        /// The allowed range, in words.
        range: String,
    },
    /// A list longer than its field allows.
    #[error("Invalid value for '{param}': {count} items (at most {max} are allowed)")]
    TooMany {
        /// The field.
        param: &'static str,
        /// Items sent.
        count: usize,
        /// Most allowed.
        max: usize,
    },
    /// A named tool choice whose function is not among `tools`.
    #[error("Invalid value for '{param}': '{name}' is not among 'tools'")]
    NotAmongTools {
        /// The field (`tool_choice.name`).
        param: &'static str,
        /// The name sent.
        name: String,
    },
}

impl ValidationError {
    /// The request field at fault, if any.
    pub fn param(&self) -> Option<String> {
        let param = match self {
            Self::BodyNotObject => return None,
            Self::WrongType { param, .. }
            | Self::Missing(param)
            | Self::UnsupportedRole { param, .. }
            | Self::MisplacedMessageField { param, .. }
            | Self::UnknownToolCallId { param, .. }
            | Self::UnsupportedContentPart { param, .. }
            | Self::EmptyStop { param }
            | Self::UnsupportedToolType { param, .. }
            | Self::InvalidToolName { param, .. }
            | Self::EmptyPrompt { param }
            | Self::TokenIdOutOfRange { param, .. }
            | Self::UnsupportedParameter { param }
            | Self::MetadataLimit { param, .. }
            | Self::UnrecognizedParameter { param }
            | Self::OnlyWith { param, .. }
            | Self::NotWith { param, .. }
            | Self::UnsupportedItemType { param, .. }
            | Self::UnknownCallId { param, .. }
            | Self::ValueOutOfRange { param, .. } => param.as_str(),
            Self::TooMany { param, .. } => param,
            Self::PromptOrMessages => "prompt",
            Self::PreviousResponseNotFound(_) => "previous_response_id",
            Self::StoreDisabled(param) | Self::NotAmongTools { param, .. } => param,
            Self::MinTokensAboveMax { .. } => "min_tokens",
            Self::ReservedTemplateVariable(key) => {
                return Some(format!("chat_template_kwargs.{key}"))
            }
            Self::EmptyMessages => "messages",
            Self::MaxTokensTooSmall { param, .. } | Self::PenaltyOutOfRange { param, .. } => param,
            Self::ConflictingMaxTokens { .. } => "max_tokens",
            Self::TemperatureOutOfRange(_) => "temperature",
            Self::TopPOutOfRange(_) => "top_p",
            Self::TopKNegative(_) => "top_k",
            Self::MinPOutOfRange(_) => "min_p",
            Self::RepetitionPenaltyOutOfRange(_) => "repetition_penalty",
            Self::StopCount(_) => "stop",
            Self::LogitBiasKey(_) | Self::LogitBiasOutOfRange { .. } => "logit_bias",
            Self::TopLogprobsOutOfRange(_) | Self::TopLogprobsWithoutLogprobs => "top_logprobs",
            Self::LogprobsOutOfRange(_) => "logprobs",
            Self::NOutOfRange(_) => "n",
            Self::BestOfNotN { .. } => "best_of",
            Self::StreamOptionsWithoutStream => "stream_options",
            Self::UnsupportedResponseFormat(_) => "response_format.type",
            Self::UnsupportedToolChoice(_) | Self::ToolChoiceWithoutTools => "tool_choice",
            Self::UnknownToolChoice(_) => "tool_choice.function.name",
            Self::ModelNotFound(_) => "model",
        };
        Some(param.to_owned())
    }
}

/// How a streamed answer is sent.
///
/// `include_obfuscation` (OpenAI) is accepted with either value: chunks
/// never carry an `obfuscation` padding field (the server is meant for
/// trusted networks; TLS terminators in front of it can pad).
/// `continuous_usage_stats` (vLLM) is accepted when false; true is a 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `usage: null` on the others).
    pub include_usage: bool,
}

/// Reads `body` into the wire type `T`. The first mismatch is an error
/// naming its field: [`ValidationError::Missing`] for an absent (or null)
/// required field, [`ValidationError::WrongType`] for a value of the wrong
/// type, [`ValidationError::BodyNotObject`] when the body is no object.
fn from_value<T: DeserializeOwned>(body: Value) -> Result<T, ValidationError> {
    serde_path_to_error::deserialize(body).map_err(|err| {
        let path = err.path().clone();
        let message = err.into_inner().to_string();
        let at = param_of(&path);
        // serde's own messages: "missing field `x`", "invalid type: null,
        // expected ...", "invalid type: string \"a\", expected ...".
        if let Some(field) = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(field, _)| field)
        {
            return ValidationError::Missing(join(at.as_deref(), field));
        }
        let Some(param) = at else {
            return ValidationError::BodyNotObject;
        };
        let in_list = matches!(
            path.iter().next_back(),
            Some(serde_path_to_error::Segment::Seq { .. })
        );
        if message.starts_with("invalid type: null") && !in_list {
            return ValidationError::Missing(param);
        }
        let expected = message
            .rsplit_once(", expected ")
            .map_or("", |(_, expected)| expected);
        ValidationError::WrongType {
            param,
            expected: plain_type(expected),
        }
    })
}

/// `path` in OpenAI's `a[0].b.c` form; `None` for the body itself.
fn param_of(path: &serde_path_to_error::Path) -> Option<String> {
    let mut param = String::new();
    for segment in path.iter() {
        match segment {
            serde_path_to_error::Segment::Seq { index } => param.push_str(&format!("[{index}]")),
            serde_path_to_error::Segment::Map { key } => {
                if !param.is_empty() {
                    param.push('.');
                }
                param.push_str(key);
            }
            serde_path_to_error::Segment::Enum { .. } | serde_path_to_error::Segment::Unknown => {}
        }
    }
    (!param.is_empty()).then_some(param)
}

fn join(at: Option<&str>, field: &str) -> String {
    match at {
        Some(at) => format!("{at}.{field}"),
        None => field.to_owned(),
    }
}

/// What serde says a field expects, in the words of the error message.
fn plain_type(serde_expected: &str) -> &'static str {
    use crate::openai::{message, request};
    match serde_expected {
        "a boolean" => "a boolean",
        "a string" => "a string",
        "f64" | "f32" => "a number",
        "i128" | "i64" | "u64" | "u32" | "an integer" => "an integer",
        "a sequence" => "an array",
        "a map" => "an object",
        request::STRING_OR_STRINGS => request::STRING_OR_STRINGS,
        request::PROMPT_TYPES => request::PROMPT_TYPES,
        request::PROMPT_ITEM_TYPES => request::PROMPT_ITEM_TYPES,
        request::TOKEN_IDS => request::TOKEN_IDS,
        message::CONTENT_TYPES => message::CONTENT_TYPES,
        message::TOOL_CHOICE_TYPES => message::TOOL_CHOICE_TYPES,
        other if other.starts_with("struct ") => "an object",
        _ => "a valid value",
    }
}

/// Refuses every key of `unknown` (keys that are not fields, null ones
/// already dropped), each named with `prefix` (`messages[0].`): those in
/// `unsupported` unless their value is a default one, all others always.
fn reject_unknown(
    unknown: Unknown,
    unsupported: &[&str],
    prefix: &str,
) -> Result<(), ValidationError> {
    for (key, value) in unknown.0 {
        let param = format!("{prefix}{key}");
        if !unsupported.contains(&key.as_str()) {
            return Err(ValidationError::UnrecognizedParameter { param });
        }
        if !is_default_value(&key, &value) {
            return Err(ValidationError::UnsupportedParameter { param });
        }
    }
    Ok(())
}

/// Checks `model` against the served one.
fn check_model(model: Option<String>, model_id: &str) -> Result<(), ValidationError> {
    match model {
        Some(model) if model != model_id => Err(ValidationError::ModelNotFound(model)),
        _ => Ok(()),
    }
}

/// Whether `value` asks for the behaviour mlxcel already has, so that
/// accepting it ignores nothing: `false`, `0`, `""`, `[]`, `{}`, and the
/// documented defaults of a few fields.
fn is_default_value(key: &str, value: &Value) -> bool {
    let generic = match value {
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Null => true,
    };
    generic
        || match key {
            "service_tier" => matches!(value.as_str(), Some("auto" | "default")),
            "truncation" => value.as_str() == Some("disabled"),
            "modalities" => {
                value.as_array().map(|m| m.as_slice()) == Some(&[Value::from("text")][..])
            }
            _ => false,
        }
}
