//! The document's schemas that are no Rust type of their own: the four
//! completion objects as one envelope ([`crate::openai::Completion::schema`]),
//! the server-sent events that carry chunks, the streamed response's
//! events, and the document itself.

use std::borrow::Cow;

use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::{RefOr, Schema};
use utoipa::{PartialSchema, ToSchema};

use crate::openai::chat::{ChatChoice, ChunkChoice};
use crate::openai::completion::{finished_text_choice, TextChoice};
use crate::openai::request::json_schema;
use crate::openai::response_object::stream_event_json;
use crate::openai::{Completion, CompletionKind};

/// Declares `$ty`, a schema of the document that is no Rust type of its
/// own, named `$name`.
macro_rules! document_schema {
    ($(#[$doc:meta])* $ty:ident = $name:literal, $schema:expr) => {
        $(#[$doc])*
        pub struct $ty;

        impl PartialSchema for $ty {
            fn schema() -> RefOr<Schema> {
                $schema
            }
        }

        impl ToSchema for $ty {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed($name)
            }
        }
    };
}

document_schema!(
    /// `chat.completion`: the envelope of [`ChatChoice`]s.
    ChatCompletionObject = "ChatCompletion",
    Completion::<ChatChoice>::schema(
        CompletionKind::Chat,
        false,
        None,
        "A chat completion: the answer of a non-streamed request.",
    )
    .into()
);

document_schema!(
    /// `chat.completion.chunk`: the envelope of [`ChunkChoice`]s.
    ChatCompletionChunkObject = "ChatCompletionChunk",
    Completion::<ChunkChoice>::schema(
        CompletionKind::Chat,
        true,
        None,
        "One `data:` event of a streamed chat completion. First a chunk with delta {role: assistant, content: \"\"} per choice (when the request offered tools, a choice's first chunk waits for its first piece, and one that opens with a tool call opens with delta {role: assistant, content: null, tool_calls: [the call's first piece]}), then content and tool-call chunks (a call's first piece carries index, id, type and function.name with empty arguments; the next ones index and function.arguments fragments, whose concatenation is the call's arguments), one finishing chunk per choice (delta {}), then with stream_options.include_usage a chunk with no choices and the usage (usage is null on the others), then `data: [DONE]`. A failure mid-stream sends an ErrorResponse as the last data event.",
    )
    .into()
);

document_schema!(
    /// `text_completion`, whole: the envelope of finished [`TextChoice`]s.
    TextCompletionObject = "TextCompletion",
    Completion::<TextChoice>::schema(
        CompletionKind::Text,
        false,
        Some(finished_text_choice()),
        "A text completion: the answer of a non-streamed request.",
    )
    .into()
);

document_schema!(
    /// `text_completion`, streamed: the envelope of [`TextChoice`]s.
    TextCompletionChunkObject = "TextCompletionChunk",
    Completion::<TextChoice>::schema(
        CompletionKind::Text,
        true,
        None,
        "One `data:` event of a streamed completion: text chunks, one finishing chunk per choice, then with stream_options.include_usage a chunk with no choices and the usage, then `data: [DONE]`. A failure mid-stream sends an ErrorResponse as the last data event.",
    )
    .into()
);

document_schema!(
    /// A server-sent event of a streamed chat completion.
    ChatCompletionEvent = "ChatCompletionEvent",
    event_schema("ChatCompletionChunk")
);

document_schema!(
    /// A server-sent event of a streamed text completion.
    TextCompletionEvent = "TextCompletionEvent",
    event_schema("TextCompletionChunk")
);

document_schema!(
    /// The data of one event of a streamed response.
    ResponseStreamEvent = "ResponseStreamEvent",
    RefOr::T(json_schema(stream_event_json()))
);

document_schema!(
    /// A server-sent event of a streamed response: `event: <type>` and
    /// the event as data.
    ResponseStreamSse = "ResponseStreamSse",
    ObjectBuilder::new()
        .description(Some(
            "One server-sent event of a streamed response (comment lines keep the connection alive): `event: <type>` and `data: <ResponseStreamEvent JSON>`; the stream ends after response.completed, response.incomplete or response.failed, without [DONE].",
        ))
        .property("event", ObjectBuilder::new().schema_type(Type::String))
        .property(
            "data",
            json_schema(serde_json::json!({
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"$ref": "#/components/schemas/ResponseStreamEvent"},
            })),
        )
        .required("event")
        .required("data")
        .into()
);

document_schema!(
    /// A server-sent event of a streamed Anthropic message.
    MessageStreamSse = "AnthropicMessageStreamSse",
    ObjectBuilder::new()
        .description(Some(
            "One server-sent event of a streamed message (comment lines keep the connection alive): `event: <type>` and `data: <AnthropicStreamEvent JSON>`; the stream ends after message_stop or an error event, without [DONE].",
        ))
        .property("event", ObjectBuilder::new().schema_type(Type::String))
        .property(
            "data",
            json_schema(serde_json::json!({
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"$ref": "#/components/schemas/AnthropicStreamEvent"},
            })),
        )
        .required("event")
        .required("data")
        .into()
);

document_schema!(
    /// The body of `GET /openapi.json`.
    OpenApiDocument = "OpenApiDocument",
    ObjectBuilder::new()
        .required("openapi")
        .required("info")
        .required("paths")
        .into()
);

/// One server-sent event of a stream of `chunk` objects: JSON data, then
/// `[DONE]`.
fn event_schema(chunk: &str) -> RefOr<Schema> {
    let data = json_schema(serde_json::json!({
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [
                {"$ref": format!("#/components/schemas/{chunk}")},
                {"$ref": "#/components/schemas/ErrorResponse"},
            ]},
        },
    }));
    ObjectBuilder::new()
        .description(Some(format!(
            "One server-sent event (comment lines keep the connection alive): `data: <{chunk} JSON>` events, then `data: [DONE]`. A failure mid-stream sends an ErrorResponse as the last data event."
        )))
        .property(
            "event",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(["message"])),
        )
        .property("data", data)
        .required("data")
        .into()
}
