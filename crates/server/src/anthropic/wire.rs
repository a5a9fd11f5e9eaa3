//! The Anthropic Messages API on the wire: the body of `POST /v1/messages`
//! (and of `POST /v1/messages/count_tokens`), the `message` it answers,
//! the events of a streamed answer and the error body. Shapes follow
//! Anthropic's Messages API reference.
//!
//! Request types follow the conventions of [`crate::openai::request`]:
//! `null` is absent, keys that are not fields land in an [`Unknown`] that
//! validation refuses by name, and a string with a fixed set of values is a
//! [`Tag`]. A content block reads every field any block type may carry;
//! validation ([`super::request`]) applies the rules of its `type`, so an
//! error names the field's whole path (`messages[1].content[0].input`).

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::SeqAccessDeserializer;
use serde::de::{self, DeserializeOwned, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use utoipa::openapi::{RefOr, Schema};
use utoipa::ToSchema;

use crate::openai::request::{json_schema, Tag, Unknown};

/// What a string-or-blocks field expects (in type errors).
pub const TEXT_OR_BLOCKS: &str = "a string or an array of content blocks";

/// A field that is a string or an array of blocks (`system`, `content`,
/// a tool result's `content`).
#[derive(Debug, Clone, PartialEq)]
pub enum TextOrBlocks<T> {
    /// The text.
    Text(String),
    /// The blocks.
    Blocks(Vec<T>),
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for TextOrBlocks<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextOrBlocksVisitor<T>(PhantomData<T>);
        impl<'de, T: DeserializeOwned> Visitor<'de> for TextOrBlocksVisitor<T> {
            type Value = TextOrBlocks<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(TEXT_OR_BLOCKS)
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<TextOrBlocks<T>, E> {
                Ok(TextOrBlocks::Text(value.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<TextOrBlocks<T>, A::Error> {
                Vec::deserialize(SeqAccessDeserializer::new(seq)).map(TextOrBlocks::Blocks)
            }
        }
        deserializer.deserialize_any(TextOrBlocksVisitor(PhantomData))
    }
}

/// The type of a request content block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockType {
    /// `{"type": "text", "text"}`.
    Text,
    /// An assistant's call: `{"type": "tool_use", "id", "name", "input"}`.
    ToolUse,
    /// A user's answer to a call: `{"type": "tool_result", "tool_use_id",
    /// "content", "is_error"}`.
    ToolResult,
    /// An assistant's earlier reasoning: `{"type": "thinking", "thinking",
    /// "signature"}`.
    Thinking,
}

/// The type of a text block: only `text`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TextType {
    /// `{"type": "text", "text"}`.
    Text,
}

/// A message's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageRole {
    /// The user's turn (text and tool results).
    User,
    /// The model's turn (text, tool calls, thinking).
    Assistant,
}

/// `POST /v1/messages` (and `/v1/messages/count_tokens`, where
/// `max_tokens` may be left out).
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = CreateMessageRequest)]
pub struct MessagesRequest {
    /// The served model's id (`GET /v1/models`); another is a 404.
    pub model: String,
    /// Most tokens to generate, at least 1 (clamped to the context).
    /// Required by `/v1/messages`; ignored by `/v1/messages/count_tokens`.
    #[schema(minimum = 1)]
    pub max_tokens: Option<i128>,
    /// The conversation: `user` and `assistant` messages, oldest first.
    #[schema(min_items = 1)]
    pub messages: Vec<InputMessage>,
    /// The system prompt: a string or text blocks.
    #[schema(schema_with = system_schema)]
    pub system: Option<TextOrBlocks<TextBlock>>,
    /// Functions the model may call.
    pub tools: Option<Vec<Tool>>,
    /// Whether and which tool the model must call.
    pub tool_choice: Option<ToolChoiceParam>,
    /// Strings that end generation (not returned); the one met is the
    /// answer's `stop_sequence`. At most 16, none empty.
    #[schema(max_items = 16)]
    pub stop_sequences: Option<Vec<String>>,
    /// Sampling temperature in [0, 1] (default 1); 0 is greedy.
    #[schema(minimum = 0, maximum = 1)]
    pub temperature: Option<f64>,
    /// Nucleus sampling mass in (0, 1].
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens; 0 turns it off.
    #[schema(minimum = 0)]
    pub top_k: Option<i128>,
    /// `user_id` (logged only).
    pub metadata: Option<Metadata>,
    /// Answer with server-sent events.
    #[schema(default = false)]
    pub stream: Option<bool>,
    /// Extended thinking: with `enabled` or `adaptive`, a reasoning
    /// model's reasoning comes back as `thinking` blocks.
    pub thinking: Option<ThinkingParam>,
    /// Accepted and ignored (the prefix cache finds shared prefixes by
    /// content, whatever the request marks).
    pub cache_control: Option<Map<String, Value>>,
    /// Keys that are not fields of the request.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

fn system_schema() -> RefOr<Schema> {
    json_schema(serde_json::json!({
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"$ref": "#/components/schemas/AnthropicTextBlock"}},
        ]
    }))
    .into()
}

fn content_schema() -> RefOr<Schema> {
    json_schema(serde_json::json!({
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"$ref": "#/components/schemas/AnthropicInputBlock"}},
        ]
    }))
    .into()
}

/// One message of `messages`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = AnthropicInputMessage)]
pub struct InputMessage {
    /// `user` or `assistant`.
    #[schema(value_type = String, pattern = "^(user|assistant)$")]
    pub role: Tag<MessageRole>,
    /// A string, or content blocks: `text` and `tool_result` in a user
    /// message, `text`, `tool_use` and `thinking` in an assistant one.
    #[schema(schema_with = content_schema)]
    pub content: TextOrBlocks<InputBlock>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// A content block of a message, with the fields of every type it may
/// have; validation checks those its `type` allows and needs.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = AnthropicInputBlock)]
pub struct InputBlock {
    /// `text`, `tool_use`, `tool_result` or `thinking` (images and
    /// documents are a 400).
    #[serde(rename = "type")]
    #[schema(value_type = String, pattern = "^(text|tool_use|tool_result|thinking)$")]
    pub kind: Tag<BlockType>,
    /// `text`: the text.
    pub text: Option<String>,
    /// `tool_use`: the call's id (`toolu_...`), which a `tool_result`
    /// answers.
    pub id: Option<String>,
    /// `tool_use`: the function called.
    pub name: Option<String>,
    /// `tool_use`: the arguments, a JSON object.
    pub input: Option<Map<String, Value>>,
    /// `tool_result`: the id of the call it answers.
    pub tool_use_id: Option<String>,
    /// `tool_result`: the result, a string or text blocks.
    #[schema(schema_with = system_schema)]
    pub content: Option<TextOrBlocks<TextBlock>>,
    /// `tool_result`: the call failed.
    pub is_error: Option<bool>,
    /// `thinking`: the reasoning.
    pub thinking: Option<String>,
    /// `thinking`: accepted and ignored.
    pub signature: Option<String>,
    /// Accepted and ignored (the prefix cache finds shared prefixes by
    /// content).
    pub cache_control: Option<Map<String, Value>>,
    /// Keys that are not fields (`citations`: only empty).
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// A text block (of `system`, or of a tool result's `content`).
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = AnthropicTextBlock)]
pub struct TextBlock {
    /// Only `text`.
    #[serde(rename = "type")]
    #[schema(value_type = String, pattern = "^text$")]
    pub kind: Tag<TextType>,
    /// The text.
    #[schema(required = true, value_type = String)]
    pub text: Option<String>,
    /// Accepted and ignored.
    pub cache_control: Option<Map<String, Value>>,
    /// Keys that are not fields (`citations`: only empty).
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// A tool's type: only custom (client) tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolType {
    /// A function the client runs.
    Custom,
}

/// One of `tools`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = AnthropicTool)]
pub struct Tool {
    /// Only `custom` (the default); Anthropic's server tools are a 400.
    #[serde(rename = "type")]
    #[schema(value_type = Option<String>, pattern = "^custom$")]
    pub kind: Option<Tag<ToolType>>,
    /// `^[a-zA-Z0-9_-]{1,64}$`.
    pub name: String,
    /// What the tool does.
    pub description: Option<String>,
    /// The JSON Schema of its `input`.
    #[schema(required = true, value_type = Object)]
    pub input_schema: Option<Map<String, Value>>,
    /// Accepted and ignored.
    pub cache_control: Option<Map<String, Value>>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `tool_choice.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoiceType {
    /// The model decides.
    Auto,
    /// The model must call a tool (constrained decoding).
    Any,
    /// The model must call the tool `name` (constrained decoding).
    Tool,
    /// The tools are not shown to the model.
    None,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = AnthropicToolChoice)]
pub struct ToolChoiceParam {
    /// `auto`, `any`, `tool` or `none`.
    #[serde(rename = "type")]
    #[schema(value_type = String, pattern = "^(auto|any|tool|none)$")]
    pub kind: Tag<ToolChoiceType>,
    /// With `tool`: the tool to call.
    pub name: Option<String>,
    /// At most one call (`auto`), exactly one (`any`).
    pub disable_parallel_tool_use: Option<bool>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `thinking.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThinkingType {
    /// Reasoning on, returned as `thinking` blocks.
    Enabled,
    /// As `enabled`, without a budget.
    Adaptive,
    /// Reasoning off (the default).
    Disabled,
}

/// `thinking.display`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThinkingDisplay {
    /// The reasoning comes back (as generated; nothing is summarized).
    Summarized,
    /// No `thinking` blocks.
    Omitted,
}

/// `thinking`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = AnthropicThinking)]
pub struct ThinkingParam {
    /// `enabled`, `adaptive` or `disabled`.
    #[serde(rename = "type")]
    #[schema(value_type = String, pattern = "^(enabled|adaptive|disabled)$")]
    pub kind: Tag<ThinkingType>,
    /// With `enabled` (required there): at least 1024 and below
    /// `max_tokens` (checked, not enforced: the reasoning counts against
    /// `max_tokens`).
    #[schema(minimum = 1024)]
    pub budget_tokens: Option<i128>,
    /// `summarized` (the default: the reasoning as generated) or
    /// `omitted` (no `thinking` blocks).
    #[schema(value_type = Option<String>, pattern = "^(summarized|omitted)$")]
    pub display: Option<Tag<ThinkingDisplay>>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `metadata`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = AnthropicMetadata)]
pub struct Metadata {
    /// An opaque id of the end user (logged only).
    pub user_id: Option<String>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// Why the model stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model ended its turn (an end-of-sequence token, or a complete
    /// output grammar).
    EndTurn,
    /// `max_tokens` (or the context) ran out.
    MaxTokens,
    /// One of `stop_sequences` appeared; it is `stop_sequence`.
    StopSequence,
    /// The model called tools.
    ToolUse,
}

/// A block of the answer's `content`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
#[schema(as = AnthropicContentBlock)]
pub enum ContentBlock {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// A call of one of `tools`.
    ToolUse {
        /// `toolu_...`; the `tool_result` that answers it names it.
        id: String,
        /// The tool.
        name: String,
        /// Its arguments (`{}` when `max_tokens` cut them before they
        /// were a JSON object).
        #[schema(value_type = Object)]
        input: Value,
    },
    /// The model's reasoning (with `thinking` enabled).
    Thinking {
        /// The reasoning text.
        thinking: String,
        /// Always empty (nothing is signed).
        signature: String,
    },
}

/// Token accounting of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[schema(as = AnthropicUsage)]
pub struct MessageUsage {
    /// Prompt tokens that were computed (not read from the prefix cache).
    pub input_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Always 0: the prefix cache keeps blocks without being asked.
    pub cache_creation_input_tokens: usize,
    /// Prompt tokens read from the prefix cache; `input_tokens` plus this
    /// is the whole prompt.
    pub cache_read_input_tokens: usize,
}

/// The answer of `POST /v1/messages` (`type: message`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = AnthropicMessage)]
pub struct Message {
    /// `msg_...`.
    pub id: String,
    /// Always `message`.
    #[serde(rename = "type")]
    #[schema(schema_with = message_type)]
    pub kind: &'static str,
    /// Always `assistant`.
    #[schema(schema_with = assistant_role)]
    pub role: &'static str,
    /// The served model.
    pub model: String,
    /// The answer's blocks, in order.
    pub content: Vec<ContentBlock>,
    /// Why it ended; null in `message_start`.
    #[schema(required = true)]
    pub stop_reason: Option<StopReason>,
    /// The stop sequence met, with `stop_reason: stop_sequence`.
    #[schema(required = true)]
    pub stop_sequence: Option<String>,
    /// Tokens (zeros in `message_start`: the counts come with
    /// `message_delta`).
    pub usage: MessageUsage,
}

fn message_type() -> RefOr<Schema> {
    crate::openai::constant("message")
}

fn assistant_role() -> RefOr<Schema> {
    crate::openai::constant("assistant")
}

fn error_type() -> RefOr<Schema> {
    crate::openai::constant("error")
}

/// A change to the block being streamed.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
#[schema(as = AnthropicBlockDelta)]
pub enum BlockDelta {
    /// More text of a `text` block.
    TextDelta {
        /// The new text.
        text: String,
    },
    /// More of a `tool_use` block's arguments (JSON text; the block's
    /// `input` is their concatenation, parsed).
    InputJsonDelta {
        /// The new JSON text.
        partial_json: String,
    },
    /// More reasoning of a `thinking` block.
    ThinkingDelta {
        /// The new reasoning text.
        thinking: String,
    },
}

/// The end of an answer, in `message_delta`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = AnthropicMessageDeltaBody)]
pub struct MessageDeltaBody {
    /// Why the answer ended.
    #[schema(required = true)]
    pub stop_reason: Option<StopReason>,
    /// The stop sequence met, if one was.
    #[schema(required = true)]
    pub stop_sequence: Option<String>,
}

/// One event of a streamed answer (`event: <type>`, `data: <this>`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
#[schema(as = AnthropicStreamEvent)]
pub enum StreamEvent {
    /// First: the message with no content yet.
    MessageStart {
        /// The message so far.
        message: Message,
    },
    /// Keep-alive (one right after `message_start`).
    Ping {},
    /// A block begins (empty text, empty reasoning, or a call with
    /// `input: {}`).
    ContentBlockStart {
        /// The block's index in `content`.
        index: usize,
        /// The block as it starts.
        content_block: ContentBlock,
    },
    /// More of block `index`.
    ContentBlockDelta {
        /// The block's index.
        index: usize,
        /// What it adds.
        delta: BlockDelta,
    },
    /// Block `index` is complete.
    ContentBlockStop {
        /// The block's index.
        index: usize,
    },
    /// Why the answer ended, and its usage.
    MessageDelta {
        /// Stop reason and sequence.
        delta: MessageDeltaBody,
        /// The whole answer's usage.
        usage: MessageUsage,
    },
    /// Last event of a complete answer.
    MessageStop {},
    /// The answer failed; the stream ends.
    Error {
        /// What failed.
        error: ErrorDetail,
    },
}

impl StreamEvent {
    /// The event's `type` (the SSE `event:` name).
    pub fn name(&self) -> &'static str {
        match self {
            Self::MessageStart { .. } => "message_start",
            Self::Ping {} => "ping",
            Self::ContentBlockStart { .. } => "content_block_start",
            Self::ContentBlockDelta { .. } => "content_block_delta",
            Self::ContentBlockStop { .. } => "content_block_stop",
            Self::MessageDelta { .. } => "message_delta",
            Self::MessageStop {} => "message_stop",
            Self::Error { .. } => "error",
        }
    }
}

/// An error in Anthropic's shape: `{"type": "error", "error": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = AnthropicErrorResponse)]
pub struct ErrorResponse {
    /// Always `error`.
    #[serde(rename = "type")]
    #[schema(schema_with = error_type)]
    pub kind: &'static str,
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The inside of an Anthropic error body.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = AnthropicErrorDetail)]
pub struct ErrorDetail {
    /// `invalid_request_error` (400, 405, 415), `authentication_error`
    /// (401), `permission_error` (403), `not_found_error` (404),
    /// `request_too_large` (413), `api_error` (500) or `overloaded_error`
    /// (503).
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What went wrong; a field at fault is named first (`messages[0].role: ...`).
    pub message: String,
}

/// The answer of `POST /v1/messages/count_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[schema(as = AnthropicTokenCount)]
pub struct TokenCount {
    /// Tokens of the prompt the chat template renders from the request
    /// (system, messages, tools), as `/v1/messages` would run it.
    pub input_tokens: usize,
}
