//! `POST /v1/chat/completions` bodies.

use std::collections::BTreeMap;

use mlxcel_engine_api::{ChatMessage, GenerationRequest, Prompt, ToolChoice};
use serde_json::{Map, Value};

use super::params::SharedParams;
use super::tools::{
    parse_message_tool_calls, parse_response_format, parse_tool_choice, parse_tools,
};
use super::{check_model, from_value, reject_unknown, StreamOptions, ValidationError};
use crate::openai::message::{self, MessageContent, Role};
use crate::openai::request::{ChatCompletionRequest, Tag};

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
        let mut request: ChatCompletionRequest = from_value(body)?;
        check_model(request.model.take(), model_id)?;
        Self::check(request, default_max_tokens)
    }

    /// Applies the rules to a request read from the wire.
    pub fn check(
        mut request: ChatCompletionRequest,
        default_max_tokens: usize,
    ) -> Result<Self, ValidationError> {
        let shared = request.take_shared();
        let messages = parse_messages(request.messages)?;
        let max_tokens = parse_max_tokens(request.max_tokens, request.max_completion_tokens)?
            .unwrap_or(default_max_tokens);
        let shared = SharedParams::parse(shared)?;
        let logprobs = parse_logprobs(request.logprobs, request.top_logprobs)?;
        let response_format = match request.response_format {
            Some(format) => parse_response_format(format)?,
            None => None,
        };
        let tools = match request.tools {
            Some(tools) => parse_tools(tools)?,
            None => Vec::new(),
        };
        let tool_choice = match request.tool_choice {
            Some(choice) => parse_tool_choice(choice, &tools)?,
            None => ToolChoice::Auto,
        };
        let parallel_tool_calls = request.parallel_tool_calls.unwrap_or(true);
        let chat_template_kwargs = match request.chat_template_kwargs {
            Some(kwargs) => check_template_kwargs(kwargs)?,
            None => Map::new(),
        };
        if let Some(metadata) = &request.metadata {
            check_metadata(metadata)?;
        }
        // `store`: nothing is stored either way (README: "API").
        shared.check_min_tokens(max_tokens)?;
        reject_unknown(request.unknown, UNSUPPORTED_FIELDS, "")?;
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
            prompt_cache_key: request.prompt_cache_key,
        })
    }
}

/// `chat_template_kwargs`: extra template variables, none of them one the
/// server sets itself.
pub(super) fn check_template_kwargs(
    kwargs: Map<String, Value>,
) -> Result<Map<String, Value>, ValidationError> {
    let reserved = mlxcel_engine_api::RESERVED_TEMPLATE_VARIABLES;
    match kwargs.keys().find(|k| reserved.contains(&k.as_str())) {
        Some(key) => Err(ValidationError::ReservedTemplateVariable(key.clone())),
        None => Ok(kwargs),
    }
}

/// `metadata`: at most 16 string pairs, keys of at most 64 characters and
/// values of at most 512 (OpenAI's limits). Accepted and not stored.
pub(super) fn check_metadata(map: &BTreeMap<String, String>) -> Result<(), ValidationError> {
    if map.len() > 16 {
        return Err(ValidationError::MetadataLimit {
            param: "metadata".into(),
            limit: "at most 16 key-value pairs",
        });
    }
    for (key, value) in map {
        let param = format!("metadata.{key}");
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

fn parse_max_tokens(
    max_tokens: Option<i128>,
    max_completion_tokens: Option<i128>,
) -> Result<Option<usize>, ValidationError> {
    let max_tokens = max_tokens
        .map(|value| super::params::max_tokens("max_tokens", value))
        .transpose()?;
    let max_completion_tokens = max_completion_tokens
        .map(|value| super::params::max_tokens("max_completion_tokens", value))
        .transpose()?;
    match (max_tokens, max_completion_tokens) {
        (Some(a), Some(b)) if a != b => Err(ValidationError::ConflictingMaxTokens {
            max_tokens: a,
            max_completion_tokens: b,
        }),
        (a, b) => Ok(b.or(a)),
    }
}

/// `logprobs: bool` and `top_logprobs: 0..=20` (only with logprobs true).
fn parse_logprobs(
    logprobs: Option<bool>,
    top_logprobs: Option<i128>,
) -> Result<Option<usize>, ValidationError> {
    let logprobs = logprobs.unwrap_or(false);
    let top = match top_logprobs {
        Some(_) if !logprobs => return Err(ValidationError::TopLogprobsWithoutLogprobs),
        Some(top) if !(0..=MAX_TOP_LOGPROBS).contains(&top) => {
            return Err(ValidationError::TopLogprobsOutOfRange(top))
        }
        Some(top) => top as usize,
        None => 0,
    };
    Ok(logprobs.then_some(top))
}

pub(super) fn parse_messages(
    items: Vec<message::ChatMessage>,
) -> Result<Vec<ChatMessage>, ValidationError> {
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

fn parse_message(at: &str, message: message::ChatMessage) -> Result<ChatMessage, ValidationError> {
    let role = match message.role {
        // OpenAI's newer name for the system role; chat templates know
        // "system".
        Tag::Known(Role::System | Role::Developer) => "system",
        Tag::Known(Role::User) => "user",
        Tag::Known(Role::Assistant) => "assistant",
        Tag::Known(Role::Tool) => "tool",
        Tag::Other(role) => {
            return Err(ValidationError::UnsupportedRole {
                param: format!("{at}.role"),
                role,
            })
        }
    };
    let tool_calls = match message.tool_calls {
        Some(_) if role != "assistant" => return Err(misplaced(at, "tool_calls", role)),
        Some(calls) => parse_message_tool_calls(at, calls)?,
        None => Vec::new(),
    };
    let tool_call_id = match message.tool_call_id {
        Some(_) if role != "tool" => return Err(misplaced(at, "tool_call_id", role)),
        None if role == "tool" => {
            return Err(ValidationError::Missing(format!("{at}.tool_call_id")))
        }
        id => id,
    };
    if message.reasoning_content.is_some() && role != "assistant" {
        return Err(misplaced(at, "reasoning_content", role));
    }
    let content = match message.content {
        Some(content) => Some(join_content(at, content)?),
        // Only an assistant message that calls tools may leave it out.
        None if !tool_calls.is_empty() => None,
        None => return Err(ValidationError::Missing(format!("{at}.content"))),
    };
    reject_unknown(message.unknown, &[], &format!("{at}."))?;
    Ok(ChatMessage {
        role: role.to_owned(),
        content,
        tool_calls,
        tool_call_id,
        name: message.name,
        reasoning_content: message.reasoning_content,
    })
}

fn misplaced(at: &str, field: &str, role: &str) -> ValidationError {
    ValidationError::MisplacedMessageField {
        param: format!("{at}.{field}"),
        role: role.to_owned(),
    }
}

/// The content's text: text parts joined without a separator.
fn join_content(at: &str, content: MessageContent) -> Result<String, ValidationError> {
    let parts = match content {
        MessageContent::Text(text) => return Ok(text),
        MessageContent::Parts(parts) => parts,
    };
    let mut joined = String::new();
    for (j, part) in parts.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        if let Tag::Other(kind) = part.kind {
            return Err(ValidationError::UnsupportedContentPart {
                param: format!("{at}.type"),
                kind,
            });
        }
        let Some(text) = part.text else {
            return Err(ValidationError::Missing(format!("{at}.text")));
        };
        joined.push_str(&text);
        reject_unknown(part.unknown, &[], &format!("{at}."))?;
    }
    Ok(joined)
}
