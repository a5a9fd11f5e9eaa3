//! Anthropic's Messages API: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens` (what Claude Code and agents on the
//! Anthropic SDK speak).
//!
//! There is no generation path of its own: a Messages body is validated
//! into the engine request a chat completion makes
//! ([`crate::validate::ValidatedMessagesRequest`]: system and messages
//! through the chat template, `tool_use`/`tool_result` blocks as the chat
//! path's tool calls and tool messages, `tool_choice` `any`/`tool` by
//! constrained decoding, tool calls parsed in the model's own format). The
//! one choice's pieces are assembled into content blocks ([`assemble`]),
//! streamed as Anthropic's events or answered whole. Errors on these
//! routes are answered in Anthropic's shape ([`error`]).
//!
//! - wire.rs: the request, the `message`, the stream events, the error body.
//! - assemble.rs: pieces to content blocks and events.
//! - error.rs: Anthropic's error body, and the layer that answers with it.

mod assemble;
pub mod error;
pub mod wire;

use std::time::Instant;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxcel_engine_api::Usage;

use crate::choices::{Choices, Piece};
use crate::completions::submit_one;
use crate::error::{ApiError, Route, SERIALIZATION_FAILED_BODY};
use crate::extract::JsonBody;
use crate::openapi::{
    AnthropicBadRequest, AnthropicForbidden, AnthropicInternalError, AnthropicNotFound,
    AnthropicPayloadTooLarge, AnthropicUnavailable, AnthropicUnsupportedMediaType,
    MessageStreamSse,
};
use crate::sse::{stream_response, ChunkFormat};
use crate::validate::ValidatedMessagesRequest;
use crate::AppState;
use assemble::Assembler;
use wire::{Message, MessageUsage, MessagesRequest, StreamEvent, TokenCount};

/// `POST /v1/messages`.
#[utoipa::path(
    post,
    path = "/v1/messages",
    operation_id = "createMessage",
    summary = "Create a message (Anthropic Messages API)",
    description = "Generates the assistant's next message with the served model's chat template, as /v1/chat/completions does. Text, tool_use and tool_result blocks; tools with input_schema; tool_choice auto, any, tool (constrained decoding) and none; stop_sequences; thinking (a reasoning model's reasoning as thinking blocks). Image and document blocks and server tools are a 400. Errors are Anthropic error bodies. The `anthropic-version` header is accepted and not required; with --api-key, `x-api-key: <key>` works as `Authorization: Bearer <key>` does.",
    request_body = MessagesRequest,
    params(("anthropic-version" = Option<String>, Header, description = "Accepted, not required.")),
    responses(
        (status = 200, description = "The message; with stream true, server-sent events (`event: <type>`, `data: <event JSON>`): message_start, ping, then per block content_block_start, content_block_delta, content_block_stop, then message_delta and message_stop (or an error event).", content(
            (Message = "application/json"),
            (inline(MessageStreamSse) = "text/event-stream"),
        )),
        (status = 400, response = AnthropicBadRequest),
        (status = 403, response = AnthropicForbidden),
        (status = 404, response = AnthropicNotFound),
        (status = 413, response = AnthropicPayloadTooLarge),
        (status = 415, response = AnthropicUnsupportedMediaType),
        (status = 500, response = AnthropicInternalError),
        (status = 503, response = AnthropicUnavailable),
    ),
)]
pub async fn create_message(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let service = state.service();
    let request = ValidatedMessagesRequest::parse(body, service.model_id())?;
    if let Some(user) = &request.user_id {
        tracing::Span::current().record("user", user.as_str());
    }
    let id = format!("msg_{}", uuid::Uuid::new_v4().simple());
    let generation = request.generation;
    tracing::info!(
        %id,
        user = request.user_id.as_deref().unwrap_or("-"),
        stream = request.stream,
        max_tokens = generation.max_tokens,
        tools = generation.tools.len(),
        thinking = request.thinking,
        anthropic_version = headers
            .get("anthropic-version")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-"),
        "message"
    );
    let parallel_tool_calls = generation.parallel_tool_calls;
    let events = submit_one(&state, generation, Route::Chat, arrived).await?;
    let mut choices = Choices::new(vec![events], 1, parallel_tool_calls);
    let message = Message {
        id,
        kind: "message",
        role: "assistant",
        model: service.model_id().to_owned(),
        content: Vec::new(),
        stop_reason: None,
        stop_sequence: None,
        usage: MessageUsage {
            input_tokens: 0,
            output_tokens: 0,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: 0,
        },
    };
    let mut assembler = Assembler::new(message, request.thinking);
    if request.stream {
        return Ok(stream_response(
            choices,
            MessageEvents { assembler },
            state.keep_alive(),
        ));
    }
    while let Some(piece) = choices.next().await? {
        assembler.piece(piece);
    }
    assembler.finish(choices.usage());
    Ok(Json(assembler.message()).into_response())
}

/// `POST /v1/messages/count_tokens`.
#[utoipa::path(
    post,
    path = "/v1/messages/count_tokens",
    operation_id = "countMessageTokens",
    summary = "Count a message request's input tokens (Anthropic Messages API)",
    description = "Renders system, messages and tools through the chat template and encodes them as /v1/messages would run them; input_tokens is that request's usage input_tokens plus cache_read_input_tokens (a forced tool_choice adds the few tokens of the call's opening, which the server writes). Takes the /v1/messages body; max_tokens may be left out.",
    request_body = MessagesRequest,
    params(("anthropic-version" = Option<String>, Header, description = "Accepted, not required.")),
    responses(
        (status = 200, description = "The count", body = TokenCount),
        (status = 400, response = AnthropicBadRequest),
        (status = 403, response = AnthropicForbidden),
        (status = 404, response = AnthropicNotFound),
        (status = 413, response = AnthropicPayloadTooLarge),
        (status = 415, response = AnthropicUnsupportedMediaType),
        (status = 500, response = AnthropicInternalError),
        (status = 503, response = AnthropicUnavailable),
    ),
)]
pub async fn count_tokens(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let request = ValidatedMessagesRequest::parse_count(body, state.service().model_id())?;
    let handle = state.service_handle();
    let tokens = tokio::task::spawn_blocking(move || handle.tokenize(&request))
        .await
        .map_err(|e| ApiError::Internal(format!("counting tokens: {e}")))?
        .map_err(|e| ApiError::from_submit(e, Route::Chat))?;
    Ok(Json(TokenCount {
        input_tokens: tokens.len(),
    })
    .into_response())
}

/// The events of a streamed message: `event: <type>` and the event's JSON
/// as data; no `[DONE]`.
struct MessageEvents {
    assembler: Assembler,
}

impl ChunkFormat for MessageEvents {
    fn opening(&mut self) -> Vec<Event> {
        self.assembler.opening().iter().map(sse_event).collect()
    }

    fn piece(&mut self, piece: Piece) -> Vec<Event> {
        self.assembler.piece(piece).iter().map(sse_event).collect()
    }

    fn usage(&self, _usage: Usage) -> Option<Event> {
        None
    }

    fn closing(&mut self, usage: Usage) -> Vec<Event> {
        self.assembler.finish(usage).iter().map(sse_event).collect()
    }

    fn failure(&mut self, error: ApiError) -> Event {
        tracing::error!(error = %error, "message stream failed");
        let body = error::error_body(&error);
        sse_event(&StreamEvent::Error { error: body.error })
    }
}

fn sse_event(event: &StreamEvent) -> Event {
    Event::default()
        .event(event.name())
        .json_data(event)
        .unwrap_or_else(|err| {
            tracing::error!(error = %err, "could not serialize a message event");
            Event::default()
                .event("error")
                .data(SERIALIZATION_FAILED_BODY)
        })
}
