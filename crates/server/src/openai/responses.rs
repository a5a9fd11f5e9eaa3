//! The body of `POST /v1/responses` (OpenAI's Responses API), as it comes
//! over the wire (see [`super::request`] for the conventions: `null` is
//! absent, other keys land in an [`Unknown`] that validation refuses, a
//! fixed set of strings is a [`Tag`]).
//!
//! An input item's fields depend on its `type` (a message, a
//! `function_call`, a `function_call_output`); like a chat message,
//! [`InputItem`] reads the fields of every shape and validation applies
//! the rules of each, so an error keeps its path (`input[2].call_id`).

use std::collections::BTreeMap;
use std::fmt;

use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};
use utoipa::openapi::{RefOr, Schema};
use utoipa::ToSchema;

use super::message::{FunctionType, ResponseFormatType, ToolChoiceMode};
use super::request::{json_schema, Tag, Unknown};

/// The body of `POST /v1/responses`. OpenAI fields mlxcel lacks
/// (background, conversation, include, max_tool_calls, prompt, reasoning,
/// service_tier, top_logprobs, truncation, ...) are accepted only with
/// their default value.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = CreateResponseRequest)]
pub struct ResponsesRequest {
    /// Must be the served model's id (see GET /v1/models); another name is
    /// a 404.
    pub model: Option<String>,
    /// The new turn: a user message as a string, or input items.
    #[schema(schema_with = input_schema, required = true)]
    pub input: Option<Input>,
    /// A system message put first; not carried over to a response that
    /// continues this one with previous_response_id.
    pub instructions: Option<String>,
    /// Most tokens to generate (default: the server's
    /// --default-max-tokens).
    #[schema(minimum = 1)]
    pub max_output_tokens: Option<i128>,
    /// Sampling temperature; 0 is greedy.
    #[schema(minimum = 0, maximum = 2)]
    pub temperature: Option<f64>,
    /// Nucleus sampling mass.
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// Seed of the sampler (mlxcel extension).
    pub seed: Option<i128>,
    /// Functions the model may call.
    pub tools: Option<Vec<ResponseTool>>,
    /// Whether and which function the model must call.
    #[schema(schema_with = tool_choice_schema)]
    pub tool_choice: Option<ResponseToolChoice>,
    /// false: at most one function call.
    #[schema(default = true)]
    pub parallel_tool_calls: Option<bool>,
    /// The output's format.
    pub text: Option<TextConfig>,
    /// Answer with server-sent events.
    #[schema(default = false)]
    pub stream: Option<bool>,
    /// Only with `stream: true`.
    pub stream_options: Option<ResponseStreamOptions>,
    /// Keep the response (default true) in the server's bounded in-memory
    /// store, for GET /v1/responses/{id} and previous_response_id.
    #[schema(default = true)]
    pub store: Option<bool>,
    /// Continue a stored response: its input and output come before
    /// `input` (its instructions do not).
    pub previous_response_id: Option<String>,
    /// Echoed in the response.
    #[schema(schema_with = metadata_schema)]
    pub metadata: Option<BTreeMap<String, String>>,
    /// An opaque end-user id (logged only).
    pub user: Option<String>,
    /// An opaque end-user id (logged only).
    pub safety_identifier: Option<String>,
    /// Logged only; the prefix cache finds shared prefixes by content.
    pub prompt_cache_key: Option<String>,
    /// Keys that are not fields of the request.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `input`: a user message's text, or items.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// One user message.
    Text(String),
    /// Messages, function calls and their outputs, in order.
    Items(Vec<InputItem>),
}

/// What [`Input`] expects.
pub const INPUT_TYPES: &str = "a string or an array of input items";

impl<'de> Deserialize<'de> for Input {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct InputVisitor;
        impl<'de> Visitor<'de> for InputVisitor {
            type Value = Input;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(INPUT_TYPES)
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<Input, E> {
                Ok(Input::Text(value.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Input, A::Error> {
                Vec::deserialize(SeqAccessDeserializer::new(seq)).map(Input::Items)
            }
        }
        deserializer.deserialize_any(InputVisitor)
    }
}

/// The `type` of an input item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemType {
    /// A message (the default when `type` is absent).
    Message,
    /// A function call the model made.
    FunctionCall,
    /// A function call's result.
    FunctionCallOutput,
}

/// The `role` of a message item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemRole {
    /// The user's turn.
    User,
    /// The model's earlier turn.
    Assistant,
    /// Instructions.
    System,
    /// Instructions (read as system).
    Developer,
}

/// One input item, with the fields of every type; validation checks which
/// its `type` needs and allows.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct InputItem {
    /// `message` (default), `function_call` or `function_call_output`.
    #[serde(rename = "type")]
    #[schema(schema_with = item_type_schema)]
    pub kind: Option<Tag<ItemType>>,
    /// Messages: `user`, `assistant`, `system` or `developer`.
    #[schema(schema_with = item_role_schema)]
    pub role: Option<Tag<ItemRole>>,
    /// Messages: the text, or text parts.
    #[schema(schema_with = content_schema)]
    pub content: Option<ItemContent>,
    /// The item's id (ignored).
    pub id: Option<String>,
    /// The item's status (ignored).
    pub status: Option<String>,
    /// Function calls and outputs: the call's id.
    pub call_id: Option<String>,
    /// Function calls: the function.
    pub name: Option<String>,
    /// Function calls: the arguments as JSON text.
    pub arguments: Option<String>,
    /// Function call outputs: the result, as text or text parts.
    #[schema(schema_with = content_schema)]
    pub output: Option<ItemContent>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// A message's `content` or a function call's `output`: text, or parts
/// whose texts are joined.
#[derive(Debug, Clone, PartialEq)]
pub enum ItemContent {
    /// The text.
    Text(String),
    /// Text parts.
    Parts(Vec<InputPart>),
}

/// What [`ItemContent`] expects.
pub const ITEM_CONTENT_TYPES: &str = "a string or an array of content parts";

impl<'de> Deserialize<'de> for ItemContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor;
        impl<'de> Visitor<'de> for ContentVisitor {
            type Value = ItemContent;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(ITEM_CONTENT_TYPES)
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<ItemContent, E> {
                Ok(ItemContent::Text(value.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<ItemContent, A::Error> {
                Vec::deserialize(SeqAccessDeserializer::new(seq)).map(ItemContent::Parts)
            }
        }
        deserializer.deserialize_any(ContentVisitor)
    }
}

/// The type of a content part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartType {
    /// Text the user (or a tool) wrote.
    InputText,
    /// Text the model wrote (an earlier response's output).
    OutputText,
}

/// One content part.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct InputPart {
    /// `input_text` or `output_text`.
    #[serde(rename = "type")]
    #[schema(schema_with = part_type_schema)]
    pub kind: Tag<PartType>,
    /// The text.
    #[schema(required = true, value_type = String)]
    pub text: Option<String>,
    /// `output_text`: annotations (ignored).
    #[schema(value_type = Option<Vec<Object>>)]
    pub annotations: Option<Vec<Value>>,
    /// `output_text`: logprobs (ignored).
    #[schema(value_type = Option<Vec<Object>>)]
    pub logprobs: Option<Vec<Value>>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// One of `tools`: a function (`{"type": "function", "name", ...}`; the
/// built-in tools are not served).
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = ResponseFunctionTool)]
pub struct ResponseTool {
    /// Only `function`.
    #[serde(rename = "type")]
    #[schema(schema_with = function_type)]
    pub kind: Tag<FunctionType>,
    /// 1 to 64 letters, digits, `_` or `-`.
    #[schema(pattern = "^[a-zA-Z0-9_-]{1,64}$", required = true, value_type = String)]
    pub name: Option<String>,
    /// What it does, for the model.
    pub description: Option<String>,
    /// A JSON schema of the arguments; default
    /// {"type":"object","properties":{}}.
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Map<String, Value>>,
    /// Accepted either way: calls follow the schema only as far as the
    /// model does unless tool_choice forces them.
    pub strict: Option<bool>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `tool_choice`: a mode, or `{"type": "function", "name": ...}`.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseToolChoice {
    /// `none`, `auto` or `required`.
    Mode(Tag<ToolChoiceMode>),
    /// One named function.
    Function(NamedFunction),
}

impl<'de> Deserialize<'de> for ResponseToolChoice {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ChoiceVisitor;
        impl<'de> Visitor<'de> for ChoiceVisitor {
            type Value = ResponseToolChoice;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(super::message::TOOL_CHOICE_TYPES)
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<ResponseToolChoice, E> {
                let mode = de::value::StrDeserializer::<E>::new(value);
                Tag::deserialize(mode).map(ResponseToolChoice::Mode)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ResponseToolChoice, A::Error> {
                NamedFunction::deserialize(MapAccessDeserializer::new(map))
                    .map(ResponseToolChoice::Function)
            }
        }
        deserializer.deserialize_any(ChoiceVisitor)
    }
}

/// A `tool_choice` naming the function to call.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = ResponseNamedToolChoice)]
pub struct NamedFunction {
    /// Only `function`.
    #[serde(rename = "type")]
    #[schema(schema_with = function_type)]
    pub kind: Tag<FunctionType>,
    /// One of `tools`.
    #[schema(required = true, value_type = String)]
    pub name: Option<String>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `text`: the output's format.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct TextConfig {
    /// `text` (default), `json_object` or `json_schema`.
    pub format: Option<TextFormat>,
    /// Only `medium` (the default).
    #[schema(schema_with = verbosity_schema)]
    pub verbosity: Option<String>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `text.format`, with the fields of every type: `name` and `schema` only
/// with `json_schema`. JSON output is enforced by constrained decoding.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct TextFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    #[schema(schema_with = format_type_schema)]
    pub kind: Tag<ResponseFormatType>,
    /// `json_schema`: the schema's name.
    pub name: Option<String>,
    /// `json_schema`: the JSON schema; absent: any JSON value.
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Map<String, Value>>,
    /// `json_schema`: accepted either way (the grammar is always enforced).
    pub strict: Option<bool>,
    /// `json_schema`: what the schema is for.
    pub description: Option<String>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `stream_options` of a Responses request.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
pub struct ResponseStreamOptions {
    /// Accepted either way; events are never padded.
    pub include_obfuscation: Option<bool>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

fn with_json(value: Value) -> RefOr<Schema> {
    RefOr::T(json_schema(value))
}

fn strings(values: &[&str]) -> Value {
    serde_json::json!({"type": "string", "enum": values})
}

fn function_type() -> RefOr<Schema> {
    super::constant("function")
}

fn item_type_schema() -> RefOr<Schema> {
    with_json(strings(&[
        "message",
        "function_call",
        "function_call_output",
    ]))
}

fn item_role_schema() -> RefOr<Schema> {
    with_json(strings(&["user", "assistant", "system", "developer"]))
}

fn part_type_schema() -> RefOr<Schema> {
    with_json(strings(&["input_text", "output_text"]))
}

fn format_type_schema() -> RefOr<Schema> {
    with_json(strings(&["text", "json_object", "json_schema"]))
}

fn verbosity_schema() -> RefOr<Schema> {
    with_json(strings(&["medium"]))
}

fn content_schema() -> RefOr<Schema> {
    with_json(serde_json::json!({
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"$ref": "#/components/schemas/InputPart"}},
        ],
    }))
}

fn input_schema() -> RefOr<Schema> {
    with_json(input_json())
}

fn input_json() -> Value {
    serde_json::json!({
        "anyOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/InputItem"}},
        ],
        "description": "The new turn: a user message as a string, or input items (messages, function calls and their outputs).",
    })
}

fn tool_choice_schema() -> RefOr<Schema> {
    with_json(serde_json::json!({
        "anyOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"$ref": "#/components/schemas/ResponseNamedToolChoice"},
        ],
        "description": "`required` and a named function need `tools`; a named function must be among them.",
    }))
}

fn metadata_schema() -> RefOr<Schema> {
    with_json(serde_json::json!({
        "type": "object",
        "maxProperties": 16,
        "propertyNames": {"maxLength": 64},
        "additionalProperties": {"type": "string", "maxLength": 512},
        "description": "Echoed in the response.",
    }))
}
