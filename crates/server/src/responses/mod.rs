//! `POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE
//! /v1/responses/{id}`.
//!
//! A Responses request is translated into the engine request a chat
//! completion makes (`crate::validate::ValidatedResponsesRequest`: the
//! instructions, the stored conversation it continues and its input
//! items become chat messages; function tools, `tool_choice` and
//! `text.format` become the same tools and grammar), so it runs through
//! the one generation path. Its one choice's pieces are assembled into
//! output items ([`assemble`]), streamed as typed events or answered
//! whole, and kept in the bounded [`store`] unless `store` is false.

mod assemble;
pub mod store;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxcel_engine_api::Usage;
use serde::Serialize;
use utoipa::ToSchema;

use crate::choices::{Choices, Piece};
use crate::completions::submit_one;
use crate::error::{ApiError, Route, SERIALIZATION_FAILED_BODY};
use crate::extract::JsonBody;
use crate::openai::response_object::{ResponseObject, ResponseStatus, StreamEvent};
use crate::openai::responses::ResponsesRequest;
use crate::openai::unix_now;
use crate::openapi::{
    BadRequest, ForbiddenOrigin, InternalError, ModelNotFound, PayloadTooLarge, ResponseNotFound,
    ResponseStreamSse, Unavailable, UnsupportedMediaType,
};
use crate::sse::{stream_response, ChunkFormat};
use crate::validate::{ConversationItem, ValidatedResponsesRequest, ValidationError};
use crate::AppState;
use assemble::Assembler;
use store::{ResponseStore, StoredResponse};

/// `POST /v1/responses`.
#[utoipa::path(
    post,
    path = "/v1/responses",
    operation_id = "createResponse",
    summary = "Create a model response (Responses API)",
    description = "Generates the assistant's answer to `input` (after `instructions` and, with previous_response_id, the stored conversation) with the served model's chat template, as /v1/chat/completions does. Function tools, tool_choice and text.format (json_object, json_schema: constrained decoding) are served; built-in tools, reasoning, background and other OpenAI fields are a 400 unless left at their default. Responses are kept in a bounded in-memory store (--responses-store-size, oldest evicted) unless store is false.",
    request_body = ResponsesRequest,
    responses(
        (status = 200, description = "The response; with stream true, server-sent events (`event: <type>`, `data: <event JSON>`), without a [DONE] marker.", content(
            (ResponseObject = "application/json"),
            (inline(ResponseStreamSse) = "text/event-stream"),
        )),
        (status = 400, response = BadRequest),
        (status = 403, response = ForbiddenOrigin),
        (status = 404, response = ModelNotFound),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 500, response = InternalError),
        (status = 503, response = Unavailable),
    ),
)]
pub async fn create_response(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let service = state.service();
    let mut request = ValidatedResponsesRequest::parse(
        body,
        service.model_id(),
        state.config().default_max_tokens,
    )?;
    let responses = state.responses();
    let store = match request.store {
        Some(true) if !responses.enabled() => {
            return Err(ValidationError::StoreDisabled("store").into())
        }
        Some(store) => store,
        // OpenAI's default: stored.
        None => responses.enabled(),
    };
    let parent = match &request.previous_response_id {
        None => None,
        Some(_) if !responses.enabled() => {
            return Err(ValidationError::StoreDisabled("previous_response_id").into())
        }
        Some(id) => Some(
            responses
                .get(id)
                .ok_or_else(|| ValidationError::PreviousResponseNotFound(id.clone()))?,
        ),
    };
    request.set_prompt(parent.iter().flat_map(|p| p.conversation()))?;
    let response = new_response(&request, service.model_id(), store);
    let user = request.user.as_deref().unwrap_or("-");
    if let Some(user) = &request.user {
        tracing::Span::current().record("user", user.as_str());
    }
    let generation = request.generation;
    tracing::info!(
        id = %response.id,
        user,
        stream = request.stream,
        max_tokens = generation.max_tokens,
        tools = generation.tools.len(),
        previous_response_id = request.previous_response_id.as_deref().unwrap_or("-"),
        store,
        prompt_cache_key = request.prompt_cache_key.as_deref().unwrap_or("-"),
        "response"
    );
    let events = submit_one(&state, generation, Route::Responses, arrived).await?;
    let mut choices = Choices::new(vec![events], 1, request.parallel_tool_calls);
    let keep = store.then(|| Keep {
        store: Arc::clone(responses),
        parent,
        input: request.input,
    });
    let mut assembler = Assembler::new(response);
    if request.stream {
        let format = ResponseEvents { assembler, keep };
        return Ok(stream_response(choices, format, state.keep_alive()));
    }
    while let Some(piece) = choices.next().await? {
        assembler.piece(piece);
    }
    assembler.finish(choices.usage());
    let response = assembler.response().clone();
    if let Some(keep) = keep {
        keep.store(response.clone());
    }
    Ok(Json(response).into_response())
}

/// `GET /v1/responses/{id}`.
#[utoipa::path(
    get,
    path = "/v1/responses/{id}",
    operation_id = "getResponse",
    summary = "A stored response",
    params(("id" = String, Path, description = "The response's id (`resp_...`).")),
    responses(
        (status = 200, description = "The response as it was answered", body = ResponseObject),
        (status = 404, response = ResponseNotFound),
    ),
)]
pub async fn retrieve_response(
    State(state): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = path_id(id)?;
    let stored = state
        .responses()
        .get(&id)
        .ok_or(ApiError::UnknownResponse(id))?;
    Ok(Json(&stored.response).into_response())
}

/// `DELETE /v1/responses/{id}`.
#[utoipa::path(
    delete,
    path = "/v1/responses/{id}",
    operation_id = "deleteResponse",
    summary = "Forget a stored response",
    description = "Responses that continued it keep their conversation.",
    params(("id" = String, Path, description = "The response's id (`resp_...`).")),
    responses(
        (status = 200, description = "The response was forgotten", body = ResponseDeleted),
        (status = 403, response = ForbiddenOrigin),
        (status = 404, response = ResponseNotFound),
    ),
)]
pub async fn delete_response(
    State(state): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = path_id(id)?;
    if !state.responses().delete(&id) {
        return Err(ApiError::UnknownResponse(id));
    }
    Ok(Json(ResponseDeleted {
        id,
        object: "response.deleted",
        deleted: true,
    })
    .into_response())
}

/// A path id; one with bad percent-encoding names no response.
fn path_id(id: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    id.map(|Path(id)| id)
        .map_err(|_| ApiError::UnknownResponse(String::new()))
}

/// The answer of `DELETE /v1/responses/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ResponseDeleted {
    /// The forgotten response's id.
    pub id: String,
    /// Always `response.deleted`.
    #[schema(schema_with = deleted_object)]
    pub object: &'static str,
    /// Always true.
    pub deleted: bool,
}

fn deleted_object() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
    crate::openai::constant("response.deleted")
}

/// The response of `request` before anything is generated: status
/// `in_progress`, no output, no usage.
fn new_response(request: &ValidatedResponsesRequest, model: &str, store: bool) -> ResponseObject {
    let sampling = request.generation.sampling;
    ResponseObject {
        id: format!("resp_{}", uuid::Uuid::new_v4().simple()),
        object: "response",
        created_at: unix_now(),
        status: ResponseStatus::InProgress,
        background: false,
        error: None,
        incomplete_details: None,
        instructions: request.instructions.clone(),
        max_output_tokens: request.max_output_tokens,
        max_tool_calls: None,
        model: model.to_owned(),
        output: Vec::new(),
        parallel_tool_calls: request.parallel_tool_calls,
        previous_response_id: request.previous_response_id.clone(),
        reasoning: serde_json::json!({"effort": null, "summary": null}),
        service_tier: "default",
        store,
        temperature: f64::from(sampling.temperature),
        text: request.echo.text.clone(),
        tool_choice: request.echo.tool_choice.clone(),
        tools: request.echo.tools.clone(),
        top_logprobs: 0,
        top_p: f64::from(sampling.top_p),
        truncation: "disabled",
        usage: None,
        user: request.user.clone(),
        metadata: request.metadata.clone(),
    }
}

/// What storing a finished response needs.
struct Keep {
    store: Arc<ResponseStore>,
    parent: Option<Arc<StoredResponse>>,
    input: Vec<ConversationItem>,
}

impl Keep {
    /// Stores `response` (a failed one is not kept).
    fn store(self, response: ResponseObject) {
        if response.status == ResponseStatus::Failed {
            return;
        }
        self.store
            .insert(StoredResponse::new(self.parent, self.input, response));
    }
}

/// The typed events of a streamed response: `event: <type>` and the
/// event's JSON as data; no `[DONE]`.
struct ResponseEvents {
    assembler: Assembler,
    keep: Option<Keep>,
}

impl ChunkFormat for ResponseEvents {
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
        let events = self.assembler.finish(usage);
        if let Some(keep) = self.keep.take() {
            keep.store(self.assembler.response().clone());
        }
        events.iter().map(sse_event).collect()
    }

    fn failure(&mut self, error: ApiError) -> Event {
        tracing::error!(error = %error, "response stream failed");
        sse_event(&self.assembler.fail(error.to_string()))
    }
}

fn sse_event(event: &StreamEvent) -> Event {
    Event::default()
        .event(event.kind)
        .json_data(event)
        .unwrap_or_else(|err| {
            tracing::error!(error = %err, "could not serialize a response event");
            Event::default()
                .event("error")
                .data(SERIALIZATION_FAILED_BODY)
        })
}
