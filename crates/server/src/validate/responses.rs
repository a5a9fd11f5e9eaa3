//! `POST /v1/responses` bodies: the Responses API translated into the one
//! engine request chat completions use (messages through the chat
//! template, tools, tool choice, constrained output).

use std::collections::{BTreeMap, HashMap};

use mlxcel_engine_api::{
    ChatMessage, GenerationRequest, Prompt, ResponseFormat, ToolCall, ToolChoice, ToolDefinition,
};
use serde_json::{json, Value};

use super::chat::check_metadata;
use super::params::{max_tokens, SharedParams};
use super::tools::{check_function_type, check_name};
use super::{check_model, from_value, reject_unknown, ValidationError};
use crate::openai::message::{ResponseFormatType, ToolChoiceMode};
use crate::openai::request::{SharedFields, Tag};
use crate::openai::responses::{
    Input, InputItem, ItemContent, ItemRole, ItemType, PartType, ResponseTool, ResponseToolChoice,
    ResponsesRequest, TextConfig,
};

/// OpenAI fields mlxcel does not implement; accepted only with a default
/// value (`false`, `[]`, `{}`, `""`, `0`, `service_tier: auto|default`,
/// `truncation: disabled`).
const UNSUPPORTED_FIELDS: &[&str] = &[
    "background",
    "context_management",
    "conversation",
    "include",
    "prompt",
    "prompt_cache_retention",
    "reasoning",
    "service_tier",
    "top_logprobs",
    "truncation",
];

/// One item of a conversation in the Responses API's terms: what a
/// request's `input` adds and what a stored response keeps (its input,
/// then its output).
#[derive(Debug, Clone, PartialEq)]
pub enum ConversationItem {
    /// A message: `system`, `user` or `assistant`, and its text.
    Message { role: &'static str, text: String },
    /// A function call the model made.
    FunctionCall {
        call_id: String,
        name: String,
        arguments: String,
    },
    /// The result of the call `call_id`.
    FunctionCallOutput { call_id: String, output: String },
}

/// A Responses request that passed every rule. Its prompt is made by
/// [`ValidatedResponsesRequest::set_prompt`] once the conversation it
/// continues is known.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedResponsesRequest {
    /// What the engine runs (the prompt is empty until `set_prompt`).
    pub generation: GenerationRequest,
    /// `instructions`: a system message put first.
    pub instructions: Option<String>,
    /// The items `input` adds.
    pub input: Vec<ConversationItem>,
    /// `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// `store`, as sent.
    pub store: Option<bool>,
    /// `max_output_tokens`, as sent.
    pub max_output_tokens: Option<usize>,
    /// `parallel_tool_calls` (default true).
    pub parallel_tool_calls: bool,
    /// The `tools`, `tool_choice` and `text` the response echoes.
    pub echo: Echo,
    /// `metadata` (echoed).
    pub metadata: BTreeMap<String, String>,
    /// `user`, or else `safety_identifier`, for the logs.
    pub user: Option<String>,
    /// `prompt_cache_key`, logged only.
    pub prompt_cache_key: Option<String>,
}

/// The settings a response shows as the request set them.
#[derive(Debug, Clone, PartialEq)]
pub struct Echo {
    /// `tools`, each `{"type": "function", "name", ...}`.
    pub tools: Vec<Value>,
    /// `tool_choice` (default `auto`).
    pub tool_choice: Value,
    /// `text` (default `{"format": {"type": "text"}}`).
    pub text: Value,
}

impl ValidatedResponsesRequest {
    /// Checks a parsed body. `model_id` is the served model;
    /// `default_max_tokens` applies without `max_output_tokens`.
    pub fn parse(
        body: Value,
        model_id: &str,
        default_max_tokens: usize,
    ) -> Result<Self, ValidationError> {
        let request: ResponsesRequest = from_value(body)?;
        check_model(request.model.clone(), model_id)?;
        Self::check(request, default_max_tokens)
    }

    /// Applies the rules to a request read from the wire.
    pub fn check(
        request: ResponsesRequest,
        default_max_tokens: usize,
    ) -> Result<Self, ValidationError> {
        let input = match request.input {
            Some(Input::Text(text)) => vec![ConversationItem::Message { role: "user", text }],
            Some(Input::Items(items)) => parse_items(items)?,
            None => return Err(ValidationError::Missing("input".into())),
        };
        let max_output_tokens = request
            .max_output_tokens
            .map(|value| max_tokens("max_output_tokens", value))
            .transpose()?;
        let shared = SharedParams::parse(SharedFields {
            temperature: request.temperature,
            top_p: request.top_p,
            seed: request.seed,
            ..SharedFields::default()
        })?;
        let stream = request.stream.unwrap_or(false);
        if let Some(options) = request.stream_options {
            if !stream {
                return Err(ValidationError::StreamOptionsWithoutStream);
            }
            // `include_obfuscation`: events are never padded.
            reject_unknown(options.unknown, &[], "stream_options.")?;
        }
        let (tools, tools_echo) = parse_tools(request.tools.unwrap_or_default())?;
        let (tool_choice, tool_choice_echo) = parse_tool_choice(request.tool_choice, &tools)?;
        let (response_format, text_echo) = parse_text(request.text)?;
        let metadata = request.metadata.unwrap_or_default();
        check_metadata(&metadata)?;
        reject_unknown(request.unknown, UNSUPPORTED_FIELDS, "")?;
        let parallel_tool_calls = request.parallel_tool_calls.unwrap_or(true);
        let budget = max_output_tokens.unwrap_or(default_max_tokens);
        Ok(Self {
            generation: GenerationRequest {
                response_format,
                tools,
                tool_choice,
                parallel_tool_calls,
                ..shared.request(Prompt::Chat(Vec::new()), budget)
            },
            instructions: request.instructions,
            input,
            previous_response_id: request.previous_response_id,
            stream,
            store: request.store,
            max_output_tokens,
            parallel_tool_calls,
            echo: Echo {
                tools: tools_echo,
                tool_choice: tool_choice_echo,
                text: text_echo,
            },
            metadata,
            user: request.user.or(request.safety_identifier),
            prompt_cache_key: request.prompt_cache_key,
        })
    }

    /// Sets the engine's prompt: the instructions, the items of the
    /// conversation this request continues (`history`, oldest first), then
    /// its input. Every `function_call_output` of the input must answer a
    /// call made before it.
    pub fn set_prompt<'a>(
        &mut self,
        history: impl IntoIterator<Item = &'a ConversationItem>,
    ) -> Result<(), ValidationError> {
        let mut messages = Vec::new();
        if let Some(instructions) = &self.instructions {
            messages.push(ChatMessage::text("system", instructions.clone()));
        }
        let mut names: HashMap<String, String> = HashMap::new();
        for item in history {
            push_item(&mut messages, &mut names, item);
        }
        for (i, item) in self.input.iter().enumerate() {
            if let ConversationItem::FunctionCallOutput { call_id, .. } = item {
                if !names.contains_key(call_id) {
                    return Err(ValidationError::UnknownCallId {
                        param: format!("input[{i}].call_id"),
                        call_id: call_id.clone(),
                    });
                }
            }
            push_item(&mut messages, &mut names, item);
        }
        self.generation.prompt = Prompt::Chat(messages);
        Ok(())
    }
}

/// Adds `item` to the chat `messages`: a function call joins the assistant
/// message before it (or opens one), an output becomes a `tool` message
/// named after its function. `names` maps call ids to functions.
fn push_item(
    messages: &mut Vec<ChatMessage>,
    names: &mut HashMap<String, String>,
    item: &ConversationItem,
) {
    match item {
        ConversationItem::Message { role, text } => {
            messages.push(ChatMessage::text(*role, text.clone()));
        }
        ConversationItem::FunctionCall {
            call_id,
            name,
            arguments,
        } => {
            names.insert(call_id.clone(), name.clone());
            let call = ToolCall {
                id: call_id.clone(),
                name: name.clone(),
                arguments: arguments.clone(),
            };
            match messages.last_mut() {
                Some(last) if last.role == "assistant" => last.tool_calls.push(call),
                _ => messages.push(ChatMessage {
                    role: "assistant".into(),
                    tool_calls: vec![call],
                    ..ChatMessage::default()
                }),
            }
        }
        ConversationItem::FunctionCallOutput { call_id, output } => {
            messages.push(ChatMessage {
                role: "tool".into(),
                content: Some(output.clone()),
                tool_call_id: Some(call_id.clone()),
                name: names.get(call_id).cloned(),
                ..ChatMessage::default()
            });
        }
    }
}

/// The items of `input`, each checked for the fields of its type.
fn parse_items(items: Vec<InputItem>) -> Result<Vec<ConversationItem>, ValidationError> {
    if items.is_empty() {
        return Err(ValidationError::EmptyPrompt {
            param: "input".into(),
        });
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| parse_item(&format!("input[{i}]"), item))
        .collect()
}

fn parse_item(at: &str, item: InputItem) -> Result<ConversationItem, ValidationError> {
    let kind = match item.kind {
        None | Some(Tag::Known(ItemType::Message)) => ItemType::Message,
        Some(Tag::Known(kind)) => kind,
        Some(Tag::Other(kind)) => {
            return Err(ValidationError::UnsupportedItemType {
                param: format!("{at}.type"),
                kind,
                supported: "message, function_call, function_call_output",
            })
        }
    };
    let required = |value: Option<String>, field: &str| {
        value.ok_or_else(|| ValidationError::Missing(format!("{at}.{field}")))
    };
    let misplaced = |field: &str, with: &'static str| ValidationError::OnlyWith {
        param: format!("{at}.{field}"),
        with,
    };
    // Which fields each type carries (`id` and `status` go with any).
    let given = [
        ("role", item.role.is_some(), "type: message"),
        ("content", item.content.is_some(), "type: message"),
        ("name", item.name.is_some(), "type: function_call"),
        ("arguments", item.arguments.is_some(), "type: function_call"),
        (
            "output",
            item.output.is_some(),
            "type: function_call_output",
        ),
        (
            "call_id",
            item.call_id.is_some(),
            "type: function_call or function_call_output",
        ),
    ];
    let allowed: &[&str] = match kind {
        ItemType::Message => &["role", "content"],
        ItemType::FunctionCall => &["name", "arguments", "call_id"],
        ItemType::FunctionCallOutput => &["output", "call_id"],
    };
    if let Some((field, _, with)) = given
        .iter()
        .find(|(field, given, _)| *given && !allowed.contains(field))
    {
        return Err(misplaced(field, with));
    }
    reject_unknown(item.unknown, &[], &format!("{at}."))?;
    Ok(match kind {
        ItemType::Message => {
            let role = match item.role {
                Some(Tag::Known(ItemRole::User)) => "user",
                Some(Tag::Known(ItemRole::Assistant)) => "assistant",
                Some(Tag::Known(ItemRole::System | ItemRole::Developer)) => "system",
                Some(Tag::Other(role)) => {
                    return Err(ValidationError::UnsupportedRole {
                        param: format!("{at}.role"),
                        role,
                    })
                }
                None => return Err(ValidationError::Missing(format!("{at}.role"))),
            };
            let Some(content) = item.content else {
                return Err(ValidationError::Missing(format!("{at}.content")));
            };
            ConversationItem::Message {
                role,
                text: join_parts(&format!("{at}.content"), content)?,
            }
        }
        ItemType::FunctionCall => ConversationItem::FunctionCall {
            call_id: required(item.call_id, "call_id")?,
            name: required(item.name, "name")?,
            arguments: required(item.arguments, "arguments")?,
        },
        ItemType::FunctionCallOutput => {
            let call_id = required(item.call_id, "call_id")?;
            let Some(output) = item.output else {
                return Err(ValidationError::Missing(format!("{at}.output")));
            };
            ConversationItem::FunctionCallOutput {
                call_id,
                output: join_parts(&format!("{at}.output"), output)?,
            }
        }
    })
}

/// The text of `content` at `at`: text parts joined without a separator.
fn join_parts(at: &str, content: ItemContent) -> Result<String, ValidationError> {
    let parts = match content {
        ItemContent::Text(text) => return Ok(text),
        ItemContent::Parts(parts) => parts,
    };
    let mut joined = String::new();
    for (j, part) in parts.into_iter().enumerate() {
        let at = format!("{at}[{j}]");
        match part.kind {
            Tag::Known(PartType::InputText | PartType::OutputText) => {}
            Tag::Other(kind) => {
                return Err(ValidationError::UnsupportedItemType {
                    param: format!("{at}.type"),
                    kind,
                    supported: "input_text, output_text",
                })
            }
        }
        let Some(text) = part.text else {
            return Err(ValidationError::Missing(format!("{at}.text")));
        };
        // Annotations and logprobs of an earlier output are not part of
        // the prompt.
        reject_unknown(part.unknown, &[], &format!("{at}."))?;
        joined.push_str(&text);
    }
    Ok(joined)
}

/// `tools`: functions only; with the echo of each.
fn parse_tools(
    tools: Vec<ResponseTool>,
) -> Result<(Vec<ToolDefinition>, Vec<Value>), ValidationError> {
    let mut definitions = Vec::with_capacity(tools.len());
    let mut echo = Vec::with_capacity(tools.len());
    for (i, tool) in tools.into_iter().enumerate() {
        let at = format!("tools[{i}]");
        check_function_type(&tool.kind, &at)?;
        let name = tool
            .name
            .ok_or_else(|| ValidationError::Missing(format!("{at}.name")))?;
        let name = check_name(name, &format!("{at}."))?;
        reject_unknown(tool.unknown, &[], &format!("{at}."))?;
        let parameters = tool.parameters.map_or_else(
            || json!({"type": "object", "properties": {}}),
            Value::Object,
        );
        echo.push(json!({
            "type": "function",
            "name": name,
            "description": tool.description,
            "parameters": parameters,
            "strict": tool.strict,
        }));
        definitions.push(ToolDefinition {
            name,
            description: tool.description,
            parameters,
        });
    }
    Ok((definitions, echo))
}

/// `tool_choice`: a mode or `{"type": "function", "name"}` naming one of
/// `tools`; with its echo.
fn parse_tool_choice(
    choice: Option<ResponseToolChoice>,
    tools: &[ToolDefinition],
) -> Result<(ToolChoice, Value), ValidationError> {
    let (choice, echo) = match choice {
        None => (ToolChoice::Auto, json!("auto")),
        Some(ResponseToolChoice::Mode(Tag::Known(mode))) => match mode {
            ToolChoiceMode::None => (ToolChoice::None, json!("none")),
            ToolChoiceMode::Auto => (ToolChoice::Auto, json!("auto")),
            ToolChoiceMode::Required => (ToolChoice::Required, json!("required")),
        },
        Some(ResponseToolChoice::Mode(Tag::Other(mode))) => {
            return Err(ValidationError::UnsupportedToolChoice(mode))
        }
        Some(ResponseToolChoice::Function(named)) => {
            check_function_type(&named.kind, "tool_choice")?;
            let name = named
                .name
                .ok_or_else(|| ValidationError::Missing("tool_choice.name".into()))?;
            reject_unknown(named.unknown, &[], "tool_choice.")?;
            let echo = json!({"type": "function", "name": name});
            (ToolChoice::Function(name), echo)
        }
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Function(_) if tools.is_empty() => {
            Err(ValidationError::ToolChoiceWithoutTools)
        }
        ToolChoice::Function(name) if !tools.iter().any(|t| &t.name == name) => {
            Err(ValidationError::NotAmongTools {
                param: "tool_choice.name",
                name: name.clone(),
            })
        }
        _ => Ok((choice, echo)),
    }
}

/// `text`: its `format` as the engine's grammar (`None` for plain text),
/// with its echo.
fn parse_text(
    text: Option<TextConfig>,
) -> Result<(Option<ResponseFormat>, Value), ValidationError> {
    let plain = json!({"format": {"type": "text"}});
    let Some(text) = text else {
        return Ok((None, plain));
    };
    if text.verbosity.as_deref().is_some_and(|v| v != "medium") {
        return Err(ValidationError::UnsupportedParameter {
            param: "text.verbosity".into(),
        });
    }
    reject_unknown(text.unknown, &[], "text.")?;
    let Some(format) = text.format else {
        return Ok((None, plain));
    };
    const AT: &str = "text.format.";
    let kind = match format.kind {
        Tag::Known(kind) => kind,
        Tag::Other(kind) => {
            return Err(ValidationError::UnsupportedItemType {
                param: "text.format.type".into(),
                kind,
                supported: "text, json_object, json_schema",
            })
        }
    };
    let schema_fields = [
        ("name", format.name.is_some()),
        ("schema", format.schema.is_some()),
        ("strict", format.strict.is_some()),
        ("description", format.description.is_some()),
    ];
    if kind != ResponseFormatType::JsonSchema {
        if let Some((field, _)) = schema_fields.iter().find(|(_, given)| *given) {
            return Err(ValidationError::OnlyWith {
                param: format!("{AT}{field}"),
                with: "text.format.type: json_schema",
            });
        }
    }
    reject_unknown(format.unknown, &[], AT)?;
    Ok(match kind {
        ResponseFormatType::Text => (None, plain),
        ResponseFormatType::JsonObject => (
            Some(ResponseFormat::JsonObject),
            json!({"format": {"type": "json_object"}}),
        ),
        ResponseFormatType::JsonSchema => {
            let name = format
                .name
                .ok_or_else(|| ValidationError::Missing(format!("{AT}name")))?;
            // No schema: any JSON value.
            let schema = Value::Object(format.schema.unwrap_or_default());
            let echo = json!({"format": {
                "type": "json_schema",
                "name": name,
                "schema": schema,
                "strict": format.strict,
                "description": format.description,
            }});
            (Some(ResponseFormat::JsonSchema(schema)), echo)
        }
    })
}
