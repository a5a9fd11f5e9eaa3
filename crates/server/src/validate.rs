//! Parsing a chat completion body into a [`ValidatedChatRequest`].
//!
//! The body is read as a JSON object and checked field by field, so every
//! broken rule is its own [`ValidationError`] variant naming the offending
//! `param`. Fields of the OpenAI API that mlxcel does not implement yet are
//! refused when they carry a non-default value, never silently ignored.

use mlxcel_engine_api::{ChatMessage, GenerationRequest, Prompt, SamplingParams};
use serde_json::{Map, Value};

/// A broken rule of the chat completion request schema. `param` names the
/// field at fault, as OpenAI does (`messages[0].role`).
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
    /// A message role other than system, user or assistant.
    #[error("Invalid value for '{param}': '{role}' (supported: system, user, assistant)")]
    UnsupportedRole {
        /// The field (`messages[i].role`).
        param: String,
        /// The role sent.
        role: String,
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
    /// `n` other than 1.
    #[error("Invalid value for 'n': {0} (only n = 1 is supported)")]
    UnsupportedN(i128),
    /// `stream_options` without `stream: true`.
    #[error("'stream_options' is only allowed when 'stream' is true")]
    StreamOptionsWithoutStream,
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
    /// A field that is not part of the chat completion request.
    #[error("Unrecognized request argument supplied: '{param}'")]
    UnrecognizedParameter {
        /// The field.
        param: String,
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
            | Self::UnsupportedContentPart { param, .. }
            | Self::UnsupportedParameter { param }
            | Self::UnrecognizedParameter { param } => param.as_str(),
            Self::EmptyMessages => "messages",
            Self::MaxTokensTooSmall { param, .. } => param,
            Self::ConflictingMaxTokens { .. } => "max_tokens",
            Self::TemperatureOutOfRange(_) => "temperature",
            Self::TopPOutOfRange(_) => "top_p",
            Self::TopKNegative(_) => "top_k",
            Self::MinPOutOfRange(_) => "min_p",
            Self::UnsupportedN(_) => "n",
            Self::StreamOptionsWithoutStream => "stream_options",
            Self::ModelNotFound(_) => "model",
        };
        Some(param.to_owned())
    }
}

/// How a streamed answer is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `usage: null` on the others).
    pub include_usage: bool,
}

/// A chat completion request that passed every rule.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedChatRequest {
    /// What the engine runs.
    pub generation: GenerationRequest,
    /// `Some` for `"stream": true`.
    pub stream: Option<StreamOptions>,
}

/// Fields the OpenAI chat API has and mlxcel does not implement yet. They are
/// accepted only with a default value (see [`is_default_value`]).
const UNSUPPORTED_FIELDS: &[&str] = &[
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "metadata",
    "modalities",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "service_tier",
    "stop",
    "store",
    "tool_choice",
    "tools",
    "top_logprobs",
    "verbosity",
    "web_search_options",
];

impl ValidatedChatRequest {
    /// Checks a parsed body. `model_id` is the served model;
    /// `default_max_tokens` applies when neither `max_tokens` nor
    /// `max_completion_tokens` is given.
    pub fn parse(
        body: Value,
        model_id: &str,
        default_max_tokens: usize,
    ) -> Result<Self, ValidationError> {
        let Value::Object(mut body) = body else {
            return Err(ValidationError::BodyNotObject);
        };
        if let Some(model) = take(&mut body, "model") {
            let model = string("model", model)?;
            if model != model_id {
                return Err(ValidationError::ModelNotFound(model));
            }
        }
        let messages = match take(&mut body, "messages") {
            Some(messages) => parse_messages(messages)?,
            None => return Err(ValidationError::Missing("messages".to_owned())),
        };
        let max_tokens = parse_max_tokens(&mut body)?.unwrap_or(default_max_tokens);
        let sampling = parse_sampling(&mut body)?;
        let stream = parse_stream(&mut body)?;
        if let Some(n) = take(&mut body, "n") {
            let n = integer("n", n)?;
            if n != 1 {
                return Err(ValidationError::UnsupportedN(n));
            }
        }
        if let Some(user) = take(&mut body, "user") {
            // An opaque end-user id: checked for type, otherwise unused.
            string("user", user)?;
        }
        let cache_prompt = match take(&mut body, "cache_prompt") {
            Some(v) => boolean("cache_prompt", v)?,
            None => true,
        };
        reject_leftovers(body, UNSUPPORTED_FIELDS, "")?;
        Ok(Self {
            generation: GenerationRequest {
                prompt: Prompt::Chat(messages),
                sampling,
                max_tokens,
                ignore_eos: false,
                cache_prompt,
            },
            stream,
        })
    }
}

fn parse_messages(value: Value) -> Result<Vec<ChatMessage>, ValidationError> {
    let Value::Array(items) = value else {
        return Err(wrong_type("messages", "an array of messages"));
    };
    if items.is_empty() {
        return Err(ValidationError::EmptyMessages);
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| parse_message(i, item))
        .collect()
}

fn parse_message(index: usize, value: Value) -> Result<ChatMessage, ValidationError> {
    let at = format!("messages[{index}]");
    let Value::Object(mut message) = value else {
        return Err(wrong_type(&at, "an object"));
    };
    let role_param = format!("{at}.role");
    let role = match take(&mut message, "role") {
        Some(role) => string(&role_param, role)?,
        None => return Err(ValidationError::Missing(role_param)),
    };
    // OpenAI's newer name for the system role; chat templates know "system".
    let role = if role == "developer" {
        "system".to_string()
    } else {
        role
    };
    if !matches!(role.as_str(), "system" | "user" | "assistant") {
        return Err(ValidationError::UnsupportedRole {
            param: role_param,
            role,
        });
    }
    let content_param = format!("{at}.content");
    let content = match take(&mut message, "content") {
        Some(content) => parse_content(&content_param, content)?,
        None => return Err(ValidationError::Missing(content_param)),
    };
    reject_leftovers(message, &[], &format!("{at}."))?;
    Ok(ChatMessage { role, content })
}

/// A string, or an array of `{"type":"text","text":...}` parts joined
/// without a separator.
fn parse_content(param: &str, value: Value) -> Result<String, ValidationError> {
    const EXPECTED: &str = "a string or an array of text parts";
    let parts = match value {
        Value::String(text) => return Ok(text),
        Value::Array(parts) => parts,
        _ => return Err(wrong_type(param, EXPECTED)),
    };
    let mut content = String::new();
    for (j, part) in parts.into_iter().enumerate() {
        let at = format!("{param}[{j}]");
        let Value::Object(mut part) = part else {
            return Err(wrong_type(&at, "an object"));
        };
        let type_param = format!("{at}.type");
        let kind = match take(&mut part, "type") {
            Some(kind) => string(&type_param, kind)?,
            None => return Err(ValidationError::Missing(type_param)),
        };
        if kind != "text" {
            return Err(ValidationError::UnsupportedContentPart {
                param: type_param,
                kind,
            });
        }
        let text_param = format!("{at}.text");
        match take(&mut part, "text") {
            Some(text) => content.push_str(&string(&text_param, text)?),
            None => return Err(ValidationError::Missing(text_param)),
        }
        reject_leftovers(part, &[], &format!("{at}."))?;
    }
    Ok(content)
}

fn parse_max_tokens(body: &mut Map<String, Value>) -> Result<Option<usize>, ValidationError> {
    let mut read = |param: &'static str| -> Result<Option<usize>, ValidationError> {
        let Some(value) = take(body, param) else {
            return Ok(None);
        };
        let value = integer(param, value)?;
        if value < 1 {
            return Err(ValidationError::MaxTokensTooSmall { param, value });
        }
        Ok(Some(usize::try_from(value).unwrap_or(usize::MAX)))
    };
    let max_tokens = read("max_tokens")?;
    let max_completion_tokens = read("max_completion_tokens")?;
    match (max_tokens, max_completion_tokens) {
        (Some(a), Some(b)) if a != b => Err(ValidationError::ConflictingMaxTokens {
            max_tokens: a,
            max_completion_tokens: b,
        }),
        (a, b) => Ok(b.or(a)),
    }
}

fn parse_sampling(body: &mut Map<String, Value>) -> Result<SamplingParams, ValidationError> {
    let mut sampling = SamplingParams::default();
    if let Some(value) = take(body, "temperature") {
        let t = number("temperature", value)?;
        if !(t.is_finite() && (0.0..=2.0).contains(&t)) {
            return Err(ValidationError::TemperatureOutOfRange(t));
        }
        sampling.temperature = t as f32;
    }
    if let Some(value) = take(body, "top_p") {
        let p = number("top_p", value)?;
        if !(p.is_finite() && p > 0.0 && p <= 1.0) {
            return Err(ValidationError::TopPOutOfRange(p));
        }
        sampling.top_p = p as f32;
    }
    if let Some(value) = take(body, "top_k") {
        let k = integer("top_k", value)?;
        if k < 0 {
            return Err(ValidationError::TopKNegative(k));
        }
        sampling.top_k = usize::try_from(k).unwrap_or(usize::MAX);
    }
    if let Some(value) = take(body, "min_p") {
        let p = number("min_p", value)?;
        if !(p.is_finite() && (0.0..=1.0).contains(&p)) {
            return Err(ValidationError::MinPOutOfRange(p));
        }
        sampling.min_p = p as f32;
    }
    if let Some(value) = take(body, "seed") {
        let seed = integer("seed", value)?;
        // Negative seeds map to their two's-complement bits: distinct seeds
        // stay distinct and the mapping is stable.
        sampling.seed = Some(u64::try_from(seed).unwrap_or(seed as i64 as u64));
    }
    Ok(sampling)
}

fn parse_stream(body: &mut Map<String, Value>) -> Result<Option<StreamOptions>, ValidationError> {
    let stream = match take(body, "stream") {
        Some(value) => boolean("stream", value)?,
        None => false,
    };
    let Some(options) = take(body, "stream_options") else {
        return Ok(stream.then(StreamOptions::default));
    };
    if !stream {
        return Err(ValidationError::StreamOptionsWithoutStream);
    }
    let Value::Object(mut options) = options else {
        return Err(wrong_type("stream_options", "an object"));
    };
    let include_usage = match take(&mut options, "include_usage") {
        Some(value) => boolean("stream_options.include_usage", value)?,
        None => false,
    };
    reject_leftovers(options, &[], "stream_options.")?;
    Ok(Some(StreamOptions { include_usage }))
}

/// Refuses every field left in `object` that has a non-null value: fields in
/// `unsupported` unless their value is a default one, all others always.
fn reject_leftovers(
    object: Map<String, Value>,
    unsupported: &[&str],
    prefix: &str,
) -> Result<(), ValidationError> {
    for (key, value) in object {
        if value.is_null() {
            continue;
        }
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
            "response_format" => value.get("type").and_then(Value::as_str) == Some("text"),
            "tool_choice" => matches!(value.as_str(), Some("none" | "auto")),
            "service_tier" => matches!(value.as_str(), Some("auto" | "default")),
            "parallel_tool_calls" => value.as_bool() == Some(true),
            "modalities" => {
                value.as_array().map(|m| m.as_slice()) == Some(&[Value::from("text")][..])
            }
            _ => false,
        }
}

/// Removes `key`; a `null` counts as absent.
fn take(object: &mut Map<String, Value>, key: &str) -> Option<Value> {
    object.remove(key).filter(|v| !v.is_null())
}

fn wrong_type(param: &str, expected: &'static str) -> ValidationError {
    ValidationError::WrongType {
        param: param.to_owned(),
        expected,
    }
}

fn string(param: &str, value: Value) -> Result<String, ValidationError> {
    match value {
        Value::String(s) => Ok(s),
        _ => Err(wrong_type(param, "a string")),
    }
}

fn boolean(param: &str, value: Value) -> Result<bool, ValidationError> {
    value
        .as_bool()
        .ok_or_else(|| wrong_type(param, "a boolean"))
}

fn number(param: &str, value: Value) -> Result<f64, ValidationError> {
    value.as_f64().ok_or_else(|| wrong_type(param, "a number"))
}

/// Any JSON integer (the full i64 and u64 ranges); floats are refused.
fn integer(param: &str, value: Value) -> Result<i128, ValidationError> {
    value
        .as_i64()
        .map(i128::from)
        .or_else(|| value.as_u64().map(i128::from))
        .ok_or_else(|| wrong_type(param, "an integer"))
}
