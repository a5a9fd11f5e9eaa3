//! `POST /v1/chat/completions` bodies.

use mlxcel_engine_api::{ChatMessage, GenerationRequest, Prompt, ToolChoice};
use serde_json::{Map, Value};

use super::params::{max_tokens, SharedParams};
use super::tools::{
    parse_message_tool_calls, parse_response_format, parse_tool_choice, parse_tools,
};
use super::{
    boolean, integer, object, object_for_model, reject_leftovers, require, string, take,
    wrong_type, StreamOptions, ValidationError,
};

/// Most alternatives per token a chat request may ask for.
const MAX_TOP_LOGPROBS: i128 = 20;

/// Fields the OpenAI chat API has and mlxcel does not implement yet. They are
/// accepted only with a default value.
const UNSUPPORTED_FIELDS: &[&str] = &[
    "audio",
    "function_call",
    "functions",
    "modalities",
    "prediction",
    "reasoning_effort",
    "safety_identifier",
    "service_tier",
    "verbosity",
    "web_search_options",
];

/// A chat completion request that passed every rule.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedChatRequest {
    /// What the engine runs.
    pub generation: GenerationRequest,
    /// `Some` for `"stream": true`.
    pub stream: Option<StreamOptions>,
    /// `parallel_tool_calls` (default true); false keeps only the first
    /// tool call of each choice.
    pub parallel_tool_calls: bool,
    /// The client's opaque end-user id, for the logs.
    pub user: Option<String>,
    /// `prompt_cache_key`: a routing hint for OpenAI's cache, logged only
    /// (mlxcel's prefix cache finds shared prefixes by content).
    pub prompt_cache_key: Option<String>,
}

impl ValidatedChatRequest {
    /// Checks a parsed body. `model_id` is the served model;
    /// `default_max_tokens` applies when neither `max_tokens` nor
    /// `max_completion_tokens` is given.
    pub fn parse(
        body: Value,
        model_id: &str,
        default_max_tokens: usize,
    ) -> Result<Self, ValidationError> {
        let mut body = object_for_model(body, model_id)?;
        let messages = parse_messages(require(&mut body, "messages", "messages")?)?;
        let max_tokens = parse_max_tokens(&mut body)?.unwrap_or(default_max_tokens);
        let shared = SharedParams::parse(&mut body)?;
        let logprobs = parse_logprobs(&mut body)?;
        let response_format = match take(&mut body, "response_format") {
            Some(format) => parse_response_format(format)?,
            None => None,
        };
        let tools = match take(&mut body, "tools") {
            Some(tools) => parse_tools(tools)?,
            None => Vec::new(),
        };
        let tool_choice = match take(&mut body, "tool_choice") {
            Some(choice) => parse_tool_choice(choice, &tools)?,
            None => ToolChoice::Auto,
        };
        let parallel_tool_calls = match take(&mut body, "parallel_tool_calls") {
            Some(value) => boolean("parallel_tool_calls", value)?,
            None => true,
        };
        let chat_template_kwargs = match take(&mut body, "chat_template_kwargs") {
            Some(value) => parse_template_kwargs(value)?,
            None => Map::new(),
        };
        if let Some(metadata) = take(&mut body, "metadata") {
            check_metadata(metadata)?;
        }
        // Nothing is stored either way (README: "API").
        if let Some(store) = take(&mut body, "store") {
            boolean("store", store)?;
        }
        let prompt_cache_key = take(&mut body, "prompt_cache_key")
            .map(|key| string("prompt_cache_key", key))
            .transpose()?;
        shared.check_min_tokens(max_tokens)?;
        reject_leftovers(body, UNSUPPORTED_FIELDS, "")?;
        Ok(Self {
            generation: GenerationRequest {
                logprobs,
                response_format,
                tools,
                tool_choice,
                parallel_tool_calls,
                chat_template_kwargs,
                ..shared.request(Prompt::Chat(messages), max_tokens)
            },
            stream: shared.stream,
            parallel_tool_calls,
            user: shared.user,
            prompt_cache_key,
        })
    }
}

/// `chat_template_kwargs`: an object of extra template variables, none of
/// them one the server sets itself.
fn parse_template_kwargs(value: Value) -> Result<Map<String, Value>, ValidationError> {
    let kwargs = object("chat_template_kwargs", value)?;
    let reserved = mlxcel_engine_api::RESERVED_TEMPLATE_VARIABLES;
    match kwargs.keys().find(|k| reserved.contains(&k.as_str())) {
        Some(key) => Err(ValidationError::ReservedTemplateVariable(key.clone())),
        None => Ok(kwargs),
    }
}

/// `metadata`: at most 16 string pairs, keys of at most 64 characters and
/// values of at most 512 (OpenAI's limits). Accepted and not stored.
fn check_metadata(value: Value) -> Result<(), ValidationError> {
    let map = object("metadata", value)?;
    if map.len() > 16 {
        return Err(ValidationError::MetadataLimit {
            param: "metadata".into(),
            limit: "at most 16 key-value pairs",
        });
    }
    for (key, value) in map {
        let param = format!("metadata.{key}");
        let value = string(&param, value)?;
        if key.chars().count() > 64 {
            return Err(ValidationError::MetadataLimit {
                param,
                limit: "keys are at most 64 characters",
            });
        }
        if value.chars().count() > 512 {
            return Err(ValidationError::MetadataLimit {
                param,
                limit: "values are at most 512 characters",
            });
        }
    }
    Ok(())
}

fn parse_max_tokens(body: &mut Map<String, Value>) -> Result<Option<usize>, ValidationError> {
    let mut read = |param: &'static str| {
        take(body, param)
            .map(|value| max_tokens(param, value))
            .transpose()
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

/// `logprobs: bool` and `top_logprobs: 0..=20` (only with logprobs true).
fn parse_logprobs(body: &mut Map<String, Value>) -> Result<Option<usize>, ValidationError> {
    let logprobs = match take(body, "logprobs") {
        Some(value) => boolean("logprobs", value)?,
        None => false,
    };
    let top = match take(body, "top_logprobs") {
        Some(value) => {
            let top = integer("top_logprobs", value)?;
            if !logprobs {
                return Err(ValidationError::TopLogprobsWithoutLogprobs);
            }
            if !(0..=MAX_TOP_LOGPROBS).contains(&top) {
                return Err(ValidationError::TopLogprobsOutOfRange(top));
            }
            top as usize
        }
        None => 0,
    };
    Ok(logprobs.then_some(top))
}

fn parse_messages(value: Value) -> Result<Vec<ChatMessage>, ValidationError> {
    let Value::Array(items) = value else {
        return Err(wrong_type("messages", "an array of messages"));
    };
    if items.is_empty() {
        return Err(ValidationError::EmptyMessages);
    }
    let messages = items
        .into_iter()
        .enumerate()
        .map(|(i, item)| parse_message(&format!("messages[{i}]"), item))
        .collect::<Result<Vec<_>, _>>()?;
    check_tool_call_ids(&messages)?;
    Ok(messages)
}

/// Every `tool` message answers a call made by an earlier assistant
/// message (its `tool_call_id` is that call's `id`).
fn check_tool_call_ids(messages: &[ChatMessage]) -> Result<(), ValidationError> {
    for (i, m) in messages.iter().enumerate() {
        let Some(id) = m.tool_call_id.as_deref().filter(|_| m.role == "tool") else {
            continue;
        };
        let answered = messages[..i]
            .iter()
            .filter(|earlier| earlier.role == "assistant")
            .any(|earlier| earlier.tool_calls.iter().any(|call| call.id == id));
        if !answered {
            return Err(ValidationError::UnknownToolCallId {
                param: format!("messages[{i}].tool_call_id"),
                id: id.to_owned(),
            });
        }
    }
    Ok(())
}

fn parse_message(at: &str, value: Value) -> Result<ChatMessage, ValidationError> {
    let mut message = object(at, value)?;
    let role_param = format!("{at}.role");
    let role = string(&role_param, require(&mut message, "role", &role_param)?)?;
    // OpenAI's newer name for the system role; chat templates know "system".
    let role = if role == "developer" {
        "system".to_owned()
    } else {
        role
    };
    if !matches!(role.as_str(), "system" | "user" | "assistant" | "tool") {
        return Err(ValidationError::UnsupportedRole {
            param: role_param,
            role,
        });
    }
    let tool_calls = match take(&mut message, "tool_calls") {
        Some(_) if role != "assistant" => return Err(misplaced(at, "tool_calls", role)),
        Some(calls) => parse_message_tool_calls(at, calls)?,
        None => Vec::new(),
    };
    let tool_call_id_param = format!("{at}.tool_call_id");
    let tool_call_id = match take(&mut message, "tool_call_id") {
        Some(_) if role != "tool" => return Err(misplaced(at, "tool_call_id", role)),
        Some(id) => Some(string(&tool_call_id_param, id)?),
        None if role == "tool" => return Err(ValidationError::Missing(tool_call_id_param)),
        None => None,
    };
    let content_param = format!("{at}.content");
    let content = match take(&mut message, "content") {
        Some(content) => Some(parse_content(&content_param, content)?),
        // Only an assistant message that calls tools may leave it out.
        None if !tool_calls.is_empty() => None,
        None => return Err(ValidationError::Missing(content_param)),
    };
    let name = take(&mut message, "name")
        .map(|name| string(&format!("{at}.name"), name))
        .transpose()?;
    reject_leftovers(message, &[], &format!("{at}."))?;
    Ok(ChatMessage {
        role,
        content,
        tool_calls,
        tool_call_id,
        name,
    })
}

fn misplaced(at: &str, field: &str, role: String) -> ValidationError {
    ValidationError::MisplacedMessageField {
        param: format!("{at}.{field}"),
        role,
    }
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
        let mut part = object(&at, part)?;
        let type_param = format!("{at}.type");
        let kind = string(&type_param, require(&mut part, "type", &type_param)?)?;
        if kind != "text" {
            return Err(ValidationError::UnsupportedContentPart {
                param: type_param,
                kind,
            });
        }
        let text_param = format!("{at}.text");
        content.push_str(&string(
            &text_param,
            require(&mut part, "text", &text_param)?,
        )?);
        reject_leftovers(part, &[], &format!("{at}."))?;
    }
    Ok(content)
}
