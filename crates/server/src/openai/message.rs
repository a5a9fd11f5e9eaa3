//! The parts of a chat request: `messages`, `tools`, `tool_choice` and
//! `response_format` (see [`super::request`] for the conventions).
//!
//! A message's fields, and `response_format`'s, depend on its `role` (or
//! `type`). serde can only pick a variant by such a tag after reading the
//! whole object into a buffer, and errors inside a buffered object lose the
//! field's path (`messages[0].content[1].text` would become `messages[0]`).
//! So [`ChatMessage`] and [`ResponseFormat`] read every field of every
//! shape, validation applies the rules of each role or type, and their
//! schemas are the per-shape ones of [`shapes`], written for the document
//! only.

use std::fmt;

use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};
use utoipa::openapi::{RefOr, Schema};
use utoipa::{PartialSchema, ToSchema};

use super::request::{Tag, Unknown};

/// A message's `role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions for the model.
    System,
    /// OpenAI's newer name for `system`, read as `system`.
    Developer,
    /// The user's turn.
    User,
    /// The model's turn.
    Assistant,
    /// A tool's answer to a call.
    Tool,
}

/// One message of `messages`, with every field any role may carry;
/// validation checks which its role allows and needs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: Tag<Role>,
    /// What is said; only an assistant message with tool calls may leave it
    /// out.
    pub content: Option<MessageContent>,
    /// A participant name (on a tool message: the function's).
    pub name: Option<String>,
    /// An assistant message's tool calls.
    pub tool_calls: Option<Vec<ToolCallRequest>>,
    /// A tool message's answered call.
    pub tool_call_id: Option<String>,
    /// An assistant reply's reasoning, as this server returned it (clients
    /// send replies back unchanged); passed to the chat template.
    pub reasoning_content: Option<String>,
    /// Keys that are not fields.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `content`: a string, or text parts joined without a separator.
#[derive(Debug, Clone, PartialEq, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    /// The text.
    Text(String),
    /// Text parts.
    Parts(Vec<ContentPart>),
}

/// What [`MessageContent`] expects.
pub const CONTENT_TYPES: &str = "a string or an array of text parts";

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor;
        impl<'de> Visitor<'de> for ContentVisitor {
            type Value = MessageContent;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(CONTENT_TYPES)
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<MessageContent, E> {
                Ok(MessageContent::Text(value.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<MessageContent, A::Error> {
                Vec::deserialize(SeqAccessDeserializer::new(seq)).map(MessageContent::Parts)
            }
        }
        deserializer.deserialize_any(ContentVisitor)
    }
}

/// The type of a content part: only text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentPartType {
    /// `{"type": "text", "text": ...}`.
    Text,
}

/// One part of a message's `content`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct ContentPart {
    /// Only `text`.
    #[serde(rename = "type")]
    #[schema(schema_with = text_part_type)]
    pub kind: Tag<ContentPartType>,
    /// The part's text.
    #[schema(required = true, value_type = String)]
    pub text: Option<String>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// The schema of a `type` that is always `function`.
fn function_type() -> RefOr<Schema> {
    super::constant("function")
}

/// The schema of a content part's `type`: only `text`.
fn text_part_type() -> RefOr<Schema> {
    super::constant("text")
}

/// The type of a tool, tool call or named tool choice: only function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FunctionType {
    /// A function.
    Function,
}

/// A tool call of an earlier assistant message.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct ToolCallRequest {
    /// The call's id, which a later tool message answers.
    pub id: String,
    /// Only `function`.
    #[serde(rename = "type")]
    #[schema(schema_with = function_type)]
    pub kind: Tag<FunctionType>,
    /// What was called.
    pub function: FunctionCallRequest,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// The function and arguments of a [`ToolCallRequest`].
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct FunctionCallRequest {
    /// The function's name.
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// One of `tools`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct Tool {
    /// Only `function`.
    #[serde(rename = "type")]
    #[schema(schema_with = function_type)]
    pub kind: Tag<FunctionType>,
    /// The function.
    pub function: FunctionDefinition,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct FunctionDefinition {
    /// 1 to 64 letters, digits, `_` or `-`.
    #[schema(pattern = "^[a-zA-Z0-9_-]{1,64}$")]
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// A JSON schema of the arguments; default
    /// {"type":"object","properties":{}}.
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Map<String, Value>>,
    /// Accepted either way: calls follow the schema only as far as the
    /// model does unless a tool choice forces them.
    pub strict: Option<bool>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `tool_choice`: a mode, or one named function.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// `none`, `auto` or `required`.
    Mode(Tag<ToolChoiceMode>),
    /// `{"type": "function", "function": {"name": ...}}`.
    Function(NamedToolChoice),
}

/// What [`ToolChoice`] expects.
pub const TOOL_CHOICE_TYPES: &str = "a string or an object";

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ChoiceVisitor;
        impl<'de> Visitor<'de> for ChoiceVisitor {
            type Value = ToolChoice;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(TOOL_CHOICE_TYPES)
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<ToolChoice, E> {
                let mode = de::value::StrDeserializer::<E>::new(value);
                Tag::deserialize(mode).map(ToolChoice::Mode)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ToolChoice, A::Error> {
                NamedToolChoice::deserialize(MapAccessDeserializer::new(map))
                    .map(ToolChoice::Function)
            }
        }
        deserializer.deserialize_any(ChoiceVisitor)
    }
}

/// The modes of `tool_choice`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoiceMode {
    /// No tools.
    None,
    /// The model decides.
    Auto,
    /// At least one call.
    Required,
}

/// A `tool_choice` naming the one function to call.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct NamedToolChoice {
    /// Only `function`.
    #[serde(rename = "type")]
    #[schema(schema_with = function_type)]
    pub kind: Tag<FunctionType>,
    /// The function (required with `type: "function"`; read as optional
    /// so that another `type`, such as `allowed_tools` or `custom`, is
    /// refused for its type rather than for a missing `function`).
    #[schema(required = true)]
    pub function: Option<FunctionName>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// The function of a [`NamedToolChoice`].
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct FunctionName {
    /// One of `tools`.
    pub name: String,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// The type of a `response_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponseFormatType {
    /// Plain text (no grammar).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against `json_schema.schema`.
    JsonSchema,
}

/// `response_format`, with the fields of every type; validation checks
/// that `json_schema` comes with (and only with) `type: json_schema`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ResponseFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: Tag<ResponseFormatType>,
    /// The schema, for `json_schema`.
    pub json_schema: Option<JsonSchemaFormat>,
    /// Keys that are not fields.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct JsonSchemaFormat {
    /// The schema's name.
    pub name: String,
    /// The JSON schema; absent: any JSON value.
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Map<String, Value>>,
    /// Accepted either way: the grammar is always enforced.
    pub strict: Option<bool>,
    /// What the schema is for.
    pub description: Option<String>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// Gives `$ty` the schema of `$shape` under the name `$name`.
macro_rules! schema_of_shape {
    ($ty:ty, $shape:ty, $name:literal) => {
        impl PartialSchema for $ty {
            fn schema() -> RefOr<Schema> {
                <$shape as PartialSchema>::schema()
            }
        }

        impl ToSchema for $ty {
            fn name() -> std::borrow::Cow<'static, str> {
                std::borrow::Cow::Borrowed($name)
            }

            fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
                <$shape as ToSchema>::schemas(schemas);
            }
        }
    };
}

schema_of_shape!(ChatMessage, shapes::ChatMessageShape, "ChatMessage");
schema_of_shape!(
    ResponseFormat,
    shapes::ResponseFormatShape,
    "ResponseFormat"
);
schema_of_shape!(ToolChoice, shapes::ToolChoiceShape, "ToolChoice");

/// The schemas of [`ChatMessage`] and [`ResponseFormat`], one object per
/// role or type, and of [`ToolChoice`] (whose mode is a [`Tag`]): written
/// for the document only (see the module docs).
#[allow(dead_code)]
mod shapes {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    use utoipa::openapi::{RefOr, Schema};
    use utoipa::ToSchema;

    use super::{
        JsonSchemaFormat, MessageContent, NamedToolChoice, ToolCallRequest, ToolChoiceMode,
    };

    /// A string schema of the values `values`.
    fn one_of_strings(values: &[&str]) -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(values.iter().copied()))
            .into()
    }

    fn system_roles() -> RefOr<Schema> {
        one_of_strings(&["system", "developer"])
    }
    fn user_role() -> RefOr<Schema> {
        one_of_strings(&["user"])
    }
    fn assistant_role() -> RefOr<Schema> {
        one_of_strings(&["assistant"])
    }
    fn tool_role() -> RefOr<Schema> {
        one_of_strings(&["tool"])
    }
    fn text_type() -> RefOr<Schema> {
        one_of_strings(&["text"])
    }
    fn json_object_type() -> RefOr<Schema> {
        one_of_strings(&["json_object"])
    }
    fn json_schema_type() -> RefOr<Schema> {
        one_of_strings(&["json_schema"])
    }

    /// One message of `messages`.
    #[derive(ToSchema)]
    #[serde(untagged)]
    pub enum ChatMessageShape {
        /// Instructions.
        System(SystemMessage),
        /// The user's turn.
        User(UserMessage),
        /// The model's turn.
        Assistant(AssistantMessage),
        /// A tool's answer.
        Tool(ToolMessage),
    }

    /// developer is read as system.
    #[derive(ToSchema)]
    pub struct SystemMessage {
        #[schema(schema_with = system_roles)]
        role: String,
        content: MessageContent,
        name: Option<String>,
    }

    /// The user's turn.
    #[derive(ToSchema)]
    pub struct UserMessage {
        #[schema(schema_with = user_role)]
        role: String,
        content: MessageContent,
        name: Option<String>,
    }

    /// content may be null only when the message carries tool_calls.
    #[derive(ToSchema)]
    pub struct AssistantMessage {
        #[schema(schema_with = assistant_role)]
        role: String,
        content: Option<MessageContent>,
        name: Option<String>,
        tool_calls: Option<Vec<ToolCallRequest>>,
    }

    /// A tool's answer to the call `tool_call_id` of an earlier assistant
    /// message.
    #[derive(ToSchema)]
    pub struct ToolMessage {
        #[schema(schema_with = tool_role)]
        role: String,
        content: MessageContent,
        name: Option<String>,
        tool_call_id: String,
    }

    /// `response_format`.
    #[derive(ToSchema)]
    #[serde(untagged)]
    pub enum ResponseFormatShape {
        /// Plain text.
        Text(TextFormat),
        /// Any JSON object.
        JsonObject(JsonObjectFormat),
        /// JSON valid against a schema.
        JsonSchema(JsonSchemaResponseFormat),
    }

    /// Plain text (no grammar).
    #[derive(ToSchema)]
    pub struct TextFormat {
        #[serde(rename = "type")]
        #[schema(schema_with = text_type)]
        kind: String,
    }

    /// Any JSON object.
    #[derive(ToSchema)]
    pub struct JsonObjectFormat {
        #[serde(rename = "type")]
        #[schema(schema_with = json_object_type)]
        kind: String,
    }

    /// JSON valid against `json_schema.schema`.
    #[derive(ToSchema)]
    pub struct JsonSchemaResponseFormat {
        #[serde(rename = "type")]
        #[schema(schema_with = json_schema_type)]
        kind: String,
        json_schema: JsonSchemaFormat,
    }

    /// `tool_choice`.
    #[derive(ToSchema)]
    #[serde(untagged)]
    #[schema(
        description = "`required` and a named function need `tools`; a named function must be among them."
    )]
    pub enum ToolChoiceShape {
        /// `none`, `auto` or `required`.
        Mode(ToolChoiceMode),
        /// One named function.
        Function(NamedToolChoice),
    }
}
