//! `POST /v1/messages` bodies (Anthropic's Messages API) translated into
//! the one engine request chat completions use: `system` and the messages
//! become chat messages for the chat template (a `tool_use` block an
//! assistant tool call, a `tool_result` block a `tool` message), `tools`
//! and `tool_choice` the chat path's tools and constrained decoding.

use std::collections::HashMap;

use mlxcel_engine_api::{
    ChatMessage, GenerationRequest, Prompt, SamplingParams, TokenizeRequest, ToolCall, ToolChoice,
    ToolDefinition,
};
use serde_json::Value;

use super::tools::check_name;
use super::{check_model, from_value, reject_unknown, ValidationError};
use crate::anthropic::wire::{
    BlockType, InputBlock, MessageRole, MessagesRequest, TextBlock, TextOrBlocks, ThinkingDisplay,
    ThinkingParam, ThinkingType, Tool, ToolChoiceParam, ToolChoiceType,
};
use crate::openai::request::Tag;

/// Most `stop_sequences`.
const MAX_STOP_SEQUENCES: usize = 16;
/// Anthropic's least `thinking.budget_tokens`.
const MIN_THINKING_BUDGET: i128 = 1024;
/// Fields of Anthropic's API that mlxcel does not implement; accepted only
/// with a default value (`service_tier: auto`, empty lists and objects).
const UNSUPPORTED_FIELDS: &[&str] = &["service_tier", "container", "mcp_servers"];
/// Text blocks of one message (or of `system`) are joined with this.
const BLOCK_SEPARATOR: &str = "\n\n";
/// Put before the text of a `tool_result` with `is_error: true` (chat
/// templates have no field for it).
const ERROR_RESULT_PREFIX: &str = "Error: ";

/// A Messages request that passed every rule.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedMessagesRequest {
    /// What the engine runs.
    pub generation: GenerationRequest,
    /// `stream: true`.
    pub stream: bool,
    /// `thinking.type: enabled` or `adaptive` (and `display` not
    /// `omitted`): reasoning comes back as `thinking` blocks; otherwise it
    /// is dropped. Without thinking the chat template is asked not to
    /// reason (`enable_thinking: false`, which Qwen3-style templates read).
    pub thinking: bool,
    /// `metadata.user_id`, for the logs.
    pub user_id: Option<String>,
}

impl ValidatedMessagesRequest {
    /// Checks a `/v1/messages` body; `model_id` is the served model.
    pub fn parse(body: Value, model_id: &str) -> Result<Self, ValidationError> {
        let request: MessagesRequest = from_value(body)?;
        check_model(Some(request.model.clone()), model_id)?;
        let max_tokens = match request.max_tokens {
            None => return Err(ValidationError::Missing("max_tokens".into())),
            Some(value) if value < 1 => {
                return Err(out_of_range("max_tokens", value, "at least 1"))
            }
            Some(value) => usize::try_from(value).unwrap_or(usize::MAX),
        };
        Self::check(request, Some(max_tokens))
    }

    /// Checks a `/v1/messages/count_tokens` body (the same body,
    /// `max_tokens` optional) into the engine's tokenize request.
    pub fn parse_count(body: Value, model_id: &str) -> Result<TokenizeRequest, ValidationError> {
        let request: MessagesRequest = from_value(body)?;
        check_model(Some(request.model.clone()), model_id)?;
        if let Some(value) = request.max_tokens {
            if value < 1 {
                return Err(out_of_range("max_tokens", value, "at least 1"));
            }
        }
        let checked = Self::check(request, None)?;
        let generation = checked.generation;
        let tools = if generation.tool_choice == ToolChoice::None {
            Vec::new()
        } else {
            generation.tools
        };
        Ok(TokenizeRequest {
            prompt: generation.prompt,
            add_generation_prompt: true,
            add_special_tokens: true,
            tools,
            chat_template_kwargs: generation.chat_template_kwargs,
        })
    }

    /// The rules shared by both routes; `max_tokens` is the budget (none
    /// for a count).
    fn check(request: MessagesRequest, max_tokens: Option<usize>) -> Result<Self, ValidationError> {
        let sampling = parse_sampling(&request)?;
        let messages = parse_messages(request.system, request.messages)?;
        let tools = parse_tools(request.tools.unwrap_or_default())?;
        let (tool_choice, parallel_tool_calls) = parse_tool_choice(request.tool_choice, &tools)?;
        let stop = parse_stop(request.stop_sequences.unwrap_or_default())?;
        let (reason, thinking) = parse_thinking(request.thinking, max_tokens)?;
        let user_id = match request.metadata {
            None => None,
            Some(metadata) => {
                reject_unknown(metadata.unknown, &[], "metadata.")?;
                metadata.user_id
            }
        };
        reject_unknown(request.unknown, UNSUPPORTED_FIELDS, "")?;
        let mut chat_template_kwargs = serde_json::Map::new();
        // Qwen3-style templates read it; others ignore it.
        chat_template_kwargs.insert("enable_thinking".into(), Value::Bool(reason));
        let generation = GenerationRequest {
            stop,
            tools,
            tool_choice,
            parallel_tool_calls,
            chat_template_kwargs,
            ..GenerationRequest::new(Prompt::Chat(messages), sampling, max_tokens.unwrap_or(1))
        };
        Ok(Self {
            generation,
            stream: request.stream.unwrap_or(false),
            thinking,
            user_id,
        })
    }
}

/// `thinking`: whether the model is asked to reason, and whether its
/// reasoning comes back as `thinking` blocks. `max_tokens` is the request's
/// budget (none for a count).
fn parse_thinking(
    thinking: Option<ThinkingParam>,
    max_tokens: Option<usize>,
) -> Result<(bool, bool), ValidationError> {
    match thinking {
        None => Ok((false, false)),
        Some(thinking) => {
            reject_unknown(thinking.unknown, &[], "thinking.")?;
            match thinking.kind {
                Tag::Known(ThinkingType::Disabled) => {
                    if thinking.display.is_some() {
                        return Err(ValidationError::OnlyWith {
                            param: "thinking.display".into(),
                            with: "thinking.type: enabled or adaptive",
                        });
                    }
                    if thinking.budget_tokens.is_some() {
                        return Err(ValidationError::OnlyWith {
                            param: "thinking.budget_tokens".into(),
                            with: "thinking.type: enabled",
                        });
                    }
                    Ok((false, false))
                }
                Tag::Known(ThinkingType::Adaptive) => {
                    if thinking.budget_tokens.is_some() {
                        return Err(ValidationError::OnlyWith {
                            param: "thinking.budget_tokens".into(),
                            with: "thinking.type: enabled",
                        });
                    }
                    Ok((true, shown(thinking.display)?))
                }
                Tag::Known(ThinkingType::Enabled) => {
                    let Some(budget) = thinking.budget_tokens else {
                        return Err(ValidationError::Missing("thinking.budget_tokens".into()));
                    };
                    if budget < MIN_THINKING_BUDGET {
                        return Err(out_of_range(
                            "thinking.budget_tokens",
                            budget,
                            "at least 1024",
                        ));
                    }
                    if let Some(max) = max_tokens {
                        if usize::try_from(budget).is_ok_and(|b| b >= max) {
                            return Err(out_of_range(
                                "thinking.budget_tokens",
                                budget,
                                "less than max_tokens",
                            ));
                        }
                    }
                    Ok((true, shown(thinking.display)?))
                }
                Tag::Other(kind) => Err(ValidationError::UnsupportedItemType {
                    param: "thinking.type".into(),
                    kind,
                    supported: "enabled, adaptive, disabled",
                }),
            }
        }
    }
}

/// Whether reasoning comes back as `thinking` blocks, by
/// `thinking.display`.
fn shown(display: Option<Tag<ThinkingDisplay>>) -> Result<bool, ValidationError> {
    match display {
        None | Some(Tag::Known(ThinkingDisplay::Summarized)) => Ok(true),
        Some(Tag::Known(ThinkingDisplay::Omitted)) => Ok(false),
        Some(Tag::Other(kind)) => Err(ValidationError::UnsupportedItemType {
            param: "thinking.display".into(),
            kind,
            supported: "summarized, omitted",
        }),
    }
}

fn out_of_range(param: &str, value: impl ToString, range: &str) -> ValidationError {
    ValidationError::ValueOutOfRange {
        param: param.to_owned(),
        value: value.to_string(),
        range: range.to_owned(),
    }
}

/// `temperature` in [0, 1], `top_p` in (0, 1], `top_k` at least 0.
fn parse_sampling(request: &MessagesRequest) -> Result<SamplingParams, ValidationError> {
    let mut sampling = SamplingParams::default();
    if let Some(t) = request.temperature {
        if !(t.is_finite() && (0.0..=1.0).contains(&t)) {
            return Err(out_of_range("temperature", t, "between 0 and 1"));
        }
        sampling.temperature = t as f32;
    }
    if let Some(p) = request.top_p {
        if !(p.is_finite() && p > 0.0 && p <= 1.0) {
            return Err(out_of_range("top_p", p, "greater than 0 and at most 1"));
        }
        sampling.top_p = p as f32;
    }
    if let Some(k) = request.top_k {
        if k < 0 {
            return Err(out_of_range("top_k", k, "at least 0; 0 turns it off"));
        }
        sampling.top_k = usize::try_from(k).unwrap_or(usize::MAX);
    }
    Ok(sampling)
}

/// Up to 16 non-empty stop sequences.
fn parse_stop(stop: Vec<String>) -> Result<Vec<String>, ValidationError> {
    if stop.len() > MAX_STOP_SEQUENCES {
        return Err(ValidationError::TooMany {
            param: "stop_sequences",
            count: stop.len(),
            max: MAX_STOP_SEQUENCES,
        });
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ValidationError::EmptyStop {
            param: format!("stop_sequences[{i}]"),
        });
    }
    Ok(stop)
}

/// `system` and `messages` as chat messages.
fn parse_messages(
    system: Option<TextOrBlocks<TextBlock>>,
    messages: Vec<crate::anthropic::wire::InputMessage>,
) -> Result<Vec<ChatMessage>, ValidationError> {
    if messages.is_empty() {
        return Err(ValidationError::EmptyMessages);
    }
    let mut chat = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = system {
        chat.push(ChatMessage::text("system", join_text(system, "system")?));
    }
    // Tool names by call id, for the `tool` messages that answer them.
    let mut calls: HashMap<String, String> = HashMap::new();
    let last = messages.len() - 1;
    for (i, message) in messages.into_iter().enumerate() {
        let at = format!("messages[{i}]");
        reject_unknown(message.unknown, &[], &format!("{at}."))?;
        let role = match message.role {
            Tag::Known(role) => role,
            Tag::Other(role) => {
                return Err(ValidationError::UnsupportedItemType {
                    param: format!("{at}.role"),
                    kind: role,
                    supported: "user, assistant",
                })
            }
        };
        if i == last && role == MessageRole::Assistant {
            // Anthropic continues a final assistant message (prefill); the
            // chat path always opens a new turn, so it is refused, as
            // Anthropic refuses it on models without prefill.
            return Err(ValidationError::UnsupportedItemType {
                param: format!("{at}.role"),
                kind: "assistant".into(),
                supported: "user (a final assistant message, prefill, is not supported)",
            });
        }
        let blocks = match message.content {
            TextOrBlocks::Text(text) => {
                let role = match role {
                    MessageRole::User => "user",
                    MessageRole::Assistant => "assistant",
                };
                push_merged(&mut chat, ChatMessage::text(role, text));
                continue;
            }
            TextOrBlocks::Blocks(blocks) => blocks,
        };
        match role {
            MessageRole::User => user_blocks(&at, blocks, &calls, &mut chat)?,
            MessageRole::Assistant => {
                push_merged(&mut chat, assistant_blocks(&at, blocks, &mut calls)?);
            }
        }
    }
    Ok(chat)
}

/// Adds `message` to `chat`, joined to the message before it when both are
/// the same role's turn (consecutive user texts, consecutive assistant
/// messages), as Anthropic combines consecutive turns.
fn push_merged(chat: &mut Vec<ChatMessage>, message: ChatMessage) {
    let same_turn = |last: &ChatMessage| {
        last.role == message.role
            && (message.role == "assistant"
                || (message.role == "user" && last.tool_call_id.is_none()))
    };
    let Some(last) = chat.last_mut().filter(|last| same_turn(last)) else {
        chat.push(message);
        return;
    };
    let join = |a: Option<String>, b: Option<String>| match (a, b) {
        (Some(mut a), Some(b)) => {
            a.push_str(BLOCK_SEPARATOR);
            a.push_str(&b);
            Some(a)
        }
        (a, b) => a.or(b),
    };
    last.content = join(last.content.take(), message.content);
    last.reasoning_content = join(last.reasoning_content.take(), message.reasoning_content);
    last.tool_calls.extend(message.tool_calls);
}

/// The fields a block of each type may carry (`cache_control` goes with
/// any).
fn check_fields(at: &str, block: &InputBlock, kind: BlockType) -> Result<(), ValidationError> {
    let given = [
        ("text", block.text.is_some(), "type: text"),
        ("id", block.id.is_some(), "type: tool_use"),
        ("name", block.name.is_some(), "type: tool_use"),
        ("input", block.input.is_some(), "type: tool_use"),
        (
            "tool_use_id",
            block.tool_use_id.is_some(),
            "type: tool_result",
        ),
        ("content", block.content.is_some(), "type: tool_result"),
        ("is_error", block.is_error.is_some(), "type: tool_result"),
        ("thinking", block.thinking.is_some(), "type: thinking"),
        ("signature", block.signature.is_some(), "type: thinking"),
    ];
    let allowed: &[&str] = match kind {
        BlockType::Text => &["text"],
        BlockType::ToolUse => &["id", "name", "input"],
        BlockType::ToolResult => &["tool_use_id", "content", "is_error"],
        BlockType::Thinking => &["thinking", "signature"],
    };
    if let Some((field, _, with)) = given
        .iter()
        .find(|(field, given, _)| *given && !allowed.contains(field))
    {
        return Err(ValidationError::OnlyWith {
            param: format!("{at}.{field}"),
            with,
        });
    }
    Ok(())
}

/// A block's type, among those a message of its role may carry.
fn block_type(
    at: &str,
    block: &InputBlock,
    allowed: &[BlockType],
    supported: &'static str,
) -> Result<BlockType, ValidationError> {
    match &block.kind {
        Tag::Known(kind) if allowed.contains(kind) => {
            check_fields(at, block, *kind)?;
            Ok(*kind)
        }
        Tag::Known(_) => Err(ValidationError::UnsupportedItemType {
            param: format!("{at}.type"),
            kind: type_name(&block.kind),
            supported,
        }),
        Tag::Other(kind) => Err(ValidationError::UnsupportedItemType {
            param: format!("{at}.type"),
            kind: kind.clone(),
            supported,
        }),
    }
}

fn type_name(kind: &Tag<BlockType>) -> String {
    match kind {
        Tag::Known(BlockType::Text) => "text".into(),
        Tag::Known(BlockType::ToolUse) => "tool_use".into(),
        Tag::Known(BlockType::ToolResult) => "tool_result".into(),
        Tag::Known(BlockType::Thinking) => "thinking".into(),
        Tag::Other(kind) => kind.clone(),
    }
}

/// A user message's blocks: runs of text blocks become user messages, each
/// `tool_result` a `tool` message, in order.
fn user_blocks(
    at: &str,
    blocks: Vec<InputBlock>,
    calls: &HashMap<String, String>,
    chat: &mut Vec<ChatMessage>,
) -> Result<(), ValidationError> {
    let mut text: Option<String> = None;
    for (j, block) in blocks.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let kind = block_type(
            &at,
            &block,
            &[BlockType::Text, BlockType::ToolResult],
            "text, tool_result",
        )?;
        reject_unknown(block.unknown, &["citations"], &format!("{at}."))?;
        match kind {
            BlockType::Text => {
                let Some(t) = block.text else {
                    return Err(ValidationError::Missing(format!("{at}.text")));
                };
                append(&mut text, &t);
            }
            _ => {
                if let Some(text) = text.take() {
                    push_merged(chat, ChatMessage::text("user", text));
                }
                let Some(id) = block.tool_use_id else {
                    return Err(ValidationError::Missing(format!("{at}.tool_use_id")));
                };
                let Some(name) = calls.get(&id) else {
                    return Err(ValidationError::UnknownToolCallId {
                        param: format!("{at}.tool_use_id"),
                        id,
                    });
                };
                let mut content = match block.content {
                    None => String::new(),
                    Some(content) => join_text(content, &format!("{at}.content"))?,
                };
                if block.is_error == Some(true) {
                    content.insert_str(0, ERROR_RESULT_PREFIX);
                }
                chat.push(ChatMessage {
                    role: "tool".into(),
                    content: Some(content),
                    tool_call_id: Some(id),
                    name: Some(name.clone()),
                    ..ChatMessage::default()
                });
            }
        }
    }
    if let Some(text) = text {
        push_merged(chat, ChatMessage::text("user", text));
    }
    Ok(())
}

/// An assistant message's blocks: text, tool calls (their ids recorded in
/// `calls`) and earlier reasoning.
fn assistant_blocks(
    at: &str,
    blocks: Vec<InputBlock>,
    calls: &mut HashMap<String, String>,
) -> Result<ChatMessage, ValidationError> {
    let mut text: Option<String> = None;
    let mut reasoning: Option<String> = None;
    let mut tool_calls = Vec::new();
    for (j, block) in blocks.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let kind = block_type(
            &at,
            &block,
            &[BlockType::Text, BlockType::ToolUse, BlockType::Thinking],
            "text, tool_use, thinking",
        )?;
        reject_unknown(block.unknown, &["citations"], &format!("{at}."))?;
        let required = |value: Option<String>, field: &str| {
            value.ok_or_else(|| ValidationError::Missing(format!("{at}.{field}")))
        };
        match kind {
            BlockType::Text => append(&mut text, &required(block.text, "text")?),
            BlockType::Thinking => append(&mut reasoning, &required(block.thinking, "thinking")?),
            _ => {
                let id = required(block.id, "id")?;
                let name = check_name(required(block.name, "name")?, &format!("{at}."))?;
                let Some(input) = block.input else {
                    return Err(ValidationError::Missing(format!("{at}.input")));
                };
                calls.insert(id.clone(), name.clone());
                tool_calls.push(ToolCall {
                    id,
                    name,
                    arguments: Value::Object(input).to_string(),
                });
            }
        }
    }
    let content = match text {
        None if !tool_calls.is_empty() => None,
        text => Some(text.unwrap_or_default()),
    };
    Ok(ChatMessage {
        role: "assistant".into(),
        content,
        tool_calls,
        reasoning_content: reasoning,
        ..ChatMessage::default()
    })
}

fn append(text: &mut Option<String>, more: &str) {
    match text {
        Some(text) => {
            text.push_str(BLOCK_SEPARATOR);
            text.push_str(more);
        }
        None => *text = Some(more.to_owned()),
    }
}

/// A string, or text blocks joined with a blank line.
fn join_text(content: TextOrBlocks<TextBlock>, at: &str) -> Result<String, ValidationError> {
    let blocks = match content {
        TextOrBlocks::Text(text) => return Ok(text),
        TextOrBlocks::Blocks(blocks) => blocks,
    };
    let mut text: Option<String> = None;
    for (j, block) in blocks.into_iter().enumerate() {
        let at = format!("{at}[{j}]");
        if let Tag::Other(kind) = block.kind {
            return Err(ValidationError::UnsupportedItemType {
                param: format!("{at}.type"),
                kind,
                supported: "text",
            });
        }
        let Some(t) = block.text else {
            return Err(ValidationError::Missing(format!("{at}.text")));
        };
        reject_unknown(block.unknown, &["citations"], &format!("{at}."))?;
        append(&mut text, &t);
    }
    Ok(text.unwrap_or_default())
}

/// `tools`: custom tools, each with an `input_schema`.
fn parse_tools(tools: Vec<Tool>) -> Result<Vec<ToolDefinition>, ValidationError> {
    tools
        .into_iter()
        .enumerate()
        .map(|(i, tool)| {
            let at = format!("tools[{i}]");
            if let Some(Tag::Other(kind)) = tool.kind {
                return Err(ValidationError::UnsupportedItemType {
                    param: format!("{at}.type"),
                    kind,
                    supported: "custom",
                });
            }
            let name = check_name(tool.name, &format!("{at}."))?;
            let Some(schema) = tool.input_schema else {
                return Err(ValidationError::Missing(format!("{at}.input_schema")));
            };
            reject_unknown(tool.unknown, &[], &format!("{at}."))?;
            Ok(ToolDefinition {
                name,
                description: tool.description,
                parameters: Value::Object(schema),
            })
        })
        .collect()
}

/// `tool_choice` as the engine's choice, and whether several calls may be
/// made.
fn parse_tool_choice(
    choice: Option<ToolChoiceParam>,
    tools: &[ToolDefinition],
) -> Result<(ToolChoice, bool), ValidationError> {
    let Some(choice) = choice else {
        return Ok((ToolChoice::Auto, true));
    };
    reject_unknown(choice.unknown, &[], "tool_choice.")?;
    let kind = match choice.kind {
        Tag::Known(kind) => kind,
        Tag::Other(kind) => {
            return Err(ValidationError::UnsupportedItemType {
                param: "tool_choice.type".into(),
                kind,
                supported: "auto, any, tool, none",
            })
        }
    };
    if choice.name.is_some() && kind != ToolChoiceType::Tool {
        return Err(ValidationError::OnlyWith {
            param: "tool_choice.name".into(),
            with: "tool_choice.type: tool",
        });
    }
    if choice.disable_parallel_tool_use.is_some() && kind == ToolChoiceType::None {
        return Err(ValidationError::OnlyWith {
            param: "tool_choice.disable_parallel_tool_use".into(),
            with: "tool_choice.type: auto, any or tool",
        });
    }
    let parallel = !choice.disable_parallel_tool_use.unwrap_or(false);
    let choice = match kind {
        ToolChoiceType::Auto => ToolChoice::Auto,
        ToolChoiceType::None => ToolChoice::None,
        ToolChoiceType::Any => ToolChoice::Required,
        ToolChoiceType::Tool => {
            let Some(name) = choice.name else {
                return Err(ValidationError::Missing("tool_choice.name".into()));
            };
            ToolChoice::Function(name)
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
        _ => Ok((choice, parallel)),
    }
}
