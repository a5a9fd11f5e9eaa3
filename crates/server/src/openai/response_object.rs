//! The `response` object of the Responses API (the answer of
//! `POST /v1/responses`, `GET /v1/responses/{id}`, and the snapshot the
//! stream's lifecycle events carry) and the events of a streamed response.

use std::collections::BTreeMap;

use mlxcel_engine_api::Usage;
use serde::Serialize;
use serde_json::Value;
use utoipa::openapi::{RefOr, Schema};
use utoipa::ToSchema;

use super::constant;
use super::request::json_schema;

/// A response: its settings (as the request set them, defaults filled
/// in), its status, output items and usage.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = Response)]
pub struct ResponseObject {
    /// `resp_` followed by a random UUID.
    pub id: String,
    /// Always `response`.
    #[schema(schema_with = response_object)]
    pub object: &'static str,
    /// Unix seconds.
    pub created_at: u64,
    /// `in_progress` (stream snapshots), `completed`, `incomplete`
    /// (max_output_tokens reached) or `failed`.
    pub status: ResponseStatus,
    /// Always false.
    pub background: bool,
    /// Set when the status is `failed`.
    #[schema(required = true)]
    pub error: Option<ResponseError>,
    /// Set when the status is `incomplete`.
    #[schema(required = true)]
    pub incomplete_details: Option<IncompleteDetails>,
    /// The request's instructions.
    #[schema(required = true)]
    pub instructions: Option<String>,
    /// The request's max_output_tokens.
    #[schema(required = true)]
    pub max_output_tokens: Option<usize>,
    /// Always null.
    #[schema(required = true, value_type = Option<u64>)]
    pub max_tool_calls: Option<()>,
    /// The served model.
    pub model: String,
    /// Messages and function calls, in the order generated.
    pub output: Vec<OutputItem>,
    /// The request's parallel_tool_calls.
    pub parallel_tool_calls: bool,
    /// The request's previous_response_id.
    #[schema(required = true)]
    pub previous_response_id: Option<String>,
    /// Always `{"effort": null, "summary": null}`.
    #[schema(schema_with = reasoning_schema)]
    pub reasoning: Value,
    /// Always `default`.
    #[schema(schema_with = default_tier)]
    pub service_tier: &'static str,
    /// Whether the response is kept in the server's store.
    pub store: bool,
    /// The sampling temperature.
    pub temperature: f64,
    /// `{"format": ...}` as the request set it.
    #[schema(value_type = Object)]
    pub text: Value,
    /// The request's tool_choice.
    #[schema(schema_with = any_value)]
    pub tool_choice: Value,
    /// The request's tools.
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    /// Always 0.
    pub top_logprobs: u32,
    /// The nucleus sampling mass.
    pub top_p: f64,
    /// Always `disabled`.
    #[schema(schema_with = truncation_disabled)]
    pub truncation: &'static str,
    /// Token accounting; null until the response has ended.
    #[schema(required = true)]
    pub usage: Option<ResponseUsage>,
    /// The request's user.
    #[schema(required = true)]
    pub user: Option<String>,
    /// The request's metadata.
    pub metadata: BTreeMap<String, String>,
}

/// A response's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResponseStatus {
    /// Still generating (stream snapshots).
    InProgress,
    /// Ended normally.
    Completed,
    /// Ended at max_output_tokens (or the context length).
    Incomplete,
    /// The engine failed.
    Failed,
}

/// `error` of a failed response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[schema(as = ResponseErrorDetail)]
pub struct ResponseError {
    /// Always `server_error`.
    pub code: &'static str,
    /// What failed.
    pub message: String,
}

/// `incomplete_details` of an incomplete response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct IncompleteDetails {
    /// Always `max_output_tokens`.
    pub reason: &'static str,
}

/// `usage` of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct ResponseUsage {
    /// Tokens of the rendered prompt (instructions, earlier turns, input).
    pub input_tokens: usize,
    /// Breakdown of the input tokens.
    pub input_tokens_details: InputTokensDetails,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Breakdown of the output tokens.
    pub output_tokens_details: OutputTokensDetails,
    /// `input_tokens + output_tokens`.
    pub total_tokens: usize,
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct InputTokensDetails {
    /// Input tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct OutputTokensDetails {
    /// Always 0 (reasoning is not returned as reasoning items).
    pub reasoning_tokens: usize,
}

impl From<Usage> for ResponseUsage {
    fn from(usage: Usage) -> Self {
        Self {
            input_tokens: usage.prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: usage.cached_tokens,
            },
            output_tokens: usage.completion_tokens,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: 0,
            },
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
        }
    }
}

/// One output item: a message or a function call.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum OutputItem {
    /// Text the model wrote.
    Message(OutputMessage),
    /// A function call the model made.
    FunctionCall(FunctionCallItem),
}

impl OutputItem {
    /// The item's `id`.
    pub fn id(&self) -> &str {
        match self {
            Self::Message(m) => &m.id,
            Self::FunctionCall(c) => &c.id,
        }
    }
}

/// An output item's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ItemStatus {
    /// Still generating.
    InProgress,
    /// Done.
    Completed,
    /// Cut by max_output_tokens.
    Incomplete,
}

/// A `message` output item.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct OutputMessage {
    /// Always `message`.
    #[serde(rename = "type")]
    #[schema(schema_with = message_type)]
    pub kind: &'static str,
    /// `msg_` followed by a random UUID.
    pub id: String,
    /// The item's status.
    pub status: ItemStatus,
    /// Always `assistant`.
    #[schema(schema_with = assistant_role)]
    pub role: &'static str,
    /// One `output_text` part (none in the snapshot of `output_item.added`).
    pub content: Vec<OutputText>,
}

/// An `output_text` content part.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct OutputText {
    /// Always `output_text`.
    #[serde(rename = "type")]
    #[schema(schema_with = output_text_type)]
    pub kind: &'static str,
    /// The text.
    pub text: String,
    /// Always empty.
    #[schema(value_type = Vec<Object>)]
    pub annotations: Vec<Value>,
    /// Always empty.
    #[schema(value_type = Vec<Object>)]
    pub logprobs: Vec<Value>,
}

impl OutputText {
    /// A part of `text`.
    pub fn new(text: String) -> Self {
        Self {
            kind: "output_text",
            text,
            annotations: Vec::new(),
            logprobs: Vec::new(),
        }
    }
}

/// A `function_call` output item.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct FunctionCallItem {
    /// Always `function_call`.
    #[serde(rename = "type")]
    #[schema(schema_with = function_call_type)]
    pub kind: &'static str,
    /// `fc_` followed by a random UUID.
    pub id: String,
    /// `call_...`: a `function_call_output` item answers it with this id.
    pub call_id: String,
    /// The function.
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
    /// The item's status.
    pub status: ItemStatus,
}

/// One event of a streamed response: its `type`, its place in the stream
/// (`sequence_number`, from 0) and its fields.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamEvent {
    /// `response.created`, `response.output_text.delta`, ...
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// 0, 1, 2, ... in the order sent.
    pub sequence_number: u64,
    /// The event's own fields.
    #[serde(flatten)]
    pub body: EventBody,
}

/// The fields of a [`StreamEvent`], by kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum EventBody {
    /// `response.created`, `.in_progress`, `.completed`, `.incomplete`,
    /// `.failed`: the response's snapshot.
    Response { response: Box<ResponseObject> },
    /// `response.output_item.added` / `.done`.
    Item {
        output_index: usize,
        item: OutputItem,
    },
    /// `response.content_part.added` / `.done`.
    Part {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputText,
    },
    /// `response.output_text.delta`.
    TextDelta {
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
        logprobs: Vec<Value>,
    },
    /// `response.output_text.done`.
    TextDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
        logprobs: Vec<Value>,
    },
    /// `response.function_call_arguments.delta`.
    ArgumentsDelta {
        item_id: String,
        output_index: usize,
        delta: String,
    },
    /// `response.function_call_arguments.done`.
    ArgumentsDone {
        item_id: String,
        output_index: usize,
        name: String,
        arguments: String,
    },
}

fn response_object() -> RefOr<Schema> {
    constant("response")
}

fn default_tier() -> RefOr<Schema> {
    constant("default")
}

fn truncation_disabled() -> RefOr<Schema> {
    constant("disabled")
}

fn message_type() -> RefOr<Schema> {
    constant("message")
}

fn assistant_role() -> RefOr<Schema> {
    constant("assistant")
}

fn output_text_type() -> RefOr<Schema> {
    constant("output_text")
}

fn function_call_type() -> RefOr<Schema> {
    constant("function_call")
}

fn any_value() -> RefOr<Schema> {
    RefOr::T(json_schema(serde_json::json!({})))
}

fn reasoning_schema() -> RefOr<Schema> {
    RefOr::T(json_schema(serde_json::json!({
        "type": "object",
        "properties": {"effort": {"type": "null"}, "summary": {"type": "null"}},
    })))
}

/// The schema of one streamed event's data (see [`StreamEvent`]), for the
/// document.
pub fn stream_event_json() -> Value {
    let response = serde_json::json!({"$ref": "#/components/schemas/Response"});
    let item = serde_json::json!({"$ref": "#/components/schemas/OutputItem"});
    let part = serde_json::json!({"$ref": "#/components/schemas/OutputText"});
    let event = |kinds: &[&str], fields: Value| {
        let mut properties = serde_json::json!({
            "type": {"type": "string", "enum": kinds},
            "sequence_number": {"type": "integer", "minimum": 0},
        });
        let mut required = vec![Value::from("type"), Value::from("sequence_number")];
        for (key, schema) in fields.as_object().into_iter().flatten() {
            properties[key] = schema.clone();
            required.push(key.as_str().into());
        }
        serde_json::json!({"type": "object", "properties": properties, "required": required})
    };
    let int = serde_json::json!({"type": "integer", "minimum": 0});
    let string = serde_json::json!({"type": "string"});
    let list = serde_json::json!({"type": "array"});
    serde_json::json!({
        "description": "One event of a streamed response: response.created and response.in_progress (snapshots, status in_progress), then per output item response.output_item.added, for a message response.content_part.added, response.output_text.delta..., response.output_text.done, response.content_part.done, for a function call response.function_call_arguments.delta..., response.function_call_arguments.done, then response.output_item.done; last response.completed, response.incomplete (max_output_tokens reached) or response.failed, with the whole response. sequence_number counts from 0.",
        "oneOf": [
            event(&["response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"], serde_json::json!({"response": response})),
            event(&["response.output_item.added", "response.output_item.done"], serde_json::json!({"output_index": int, "item": item})),
            event(&["response.content_part.added", "response.content_part.done"], serde_json::json!({"item_id": string, "output_index": int, "content_index": int, "part": part})),
            event(&["response.output_text.delta"], serde_json::json!({"item_id": string, "output_index": int, "content_index": int, "delta": string, "logprobs": list})),
            event(&["response.output_text.done"], serde_json::json!({"item_id": string, "output_index": int, "content_index": int, "text": string, "logprobs": list})),
            event(&["response.function_call_arguments.delta"], serde_json::json!({"item_id": string, "output_index": int, "delta": string})),
            event(&["response.function_call_arguments.done"], serde_json::json!({"item_id": string, "output_index": int, "name": string, "arguments": string})),
        ],
    })
}
