//! `GET /openapi.json`: the OpenAPI 3.1 description of every route,
//! generated from the code: the schemas from the wire types' `ToSchema`
//! derives (`crate::openai`, [`crate::error::ErrorBody`]), the operations
//! from the `#[utoipa::path]` of each handler, listed in [`ApiDoc`].
//!
//! What the derives cannot say is written here once: the four completion
//! objects are one envelope ([`crate::openai::Completion::schema`]), the
//! server-sent event that carries a chunk, the reusable error responses,
//! the API key (every operation but `GET /health`, from
//! [`crate::auth::PUBLIC_HEALTH_PATH`]), and `additionalProperties: false`
//! on every object of a request body (the wire types take other keys into
//! an `Unknown`, which validation refuses; see `crate::openai::request`).
//!
//! The tests (tests.rs) hold the document to the router: every route of
//! [`crate::route_table`] is documented, and every documented operation is
//! routed.
//!
//! - schemas.rs: the document's schemas that are no Rust type of their own
//!   (the completion envelopes, the server-sent events).
//! - errors.rs: the reusable error responses.
//! - tests.rs: the document against the router.

mod errors;
mod schemas;
#[cfg(test)]
mod tests;

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use utoipa::openapi::security::{
    ApiKey as ApiKeyScheme, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement,
    SecurityScheme,
};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{Modify, OpenApi, ToResponse, ToSchema};

use crate::anthropic::wire::{
    BlockDelta, ContentBlock, ErrorDetail as AnthropicErrorDetail,
    ErrorResponse as AnthropicErrorResponse, InputBlock, InputMessage, Message, MessageDeltaBody,
    MessageUsage, MessagesRequest, Metadata, StopReason, StreamEvent, TextBlock, ThinkingParam,
    TokenCount, Tool, ToolChoiceParam,
};
use crate::error::{ErrorBody, ErrorDetail};
use crate::openai::chat::{
    AssistantMessage, ChatChoice, ChatLogprobs, ChatTokenLogprob, ChunkChoice, ChunkDelta,
    FunctionCall, FunctionDelta, ToolCallBody, ToolCallDelta, TopLogprob,
};
use crate::openai::completion::{LegacyLogprobs, TextChoice};
use crate::openai::embeddings::{
    EmbeddingList, EmbeddingObject, EmbeddingUsage, EmbeddingVector, EmbeddingsBody,
};
use crate::openai::infill::{InfillBody, InfillExtraFile, InfillResponse};
use crate::openai::request::{ChatCompletionRequest, CompletionRequest};
use crate::openai::response_object::{
    FunctionCallItem, IncompleteDetails, InputTokensDetails, ItemStatus, OutputItem, OutputMessage,
    OutputText, OutputTokensDetails, ResponseError, ResponseObject, ResponseStatus, ResponseUsage,
};
use crate::openai::responses::{
    InputItem, InputPart, NamedFunction, ResponseStreamOptions, ResponseTool, ResponsesRequest,
    TextConfig, TextFormat,
};
use crate::openai::tokenize::{DetokenizeBody, DetokenizeResponse, TokenizeBody, TokenizeResponse};
use crate::openai::{
    BlockCounts, CacheReset, CacheResetRequest, CacheStats, DiskCacheStats, Health, ModelCard,
    ModelList, PromptTokensDetails, RecurrentStateStats, UsageBody,
};
use crate::responses::ResponseDeleted;

pub use errors::{
    AnthropicBadRequest, AnthropicForbidden, AnthropicInternalError, AnthropicNotFound,
    AnthropicPayloadTooLarge, AnthropicUnauthorized, AnthropicUnavailable,
    AnthropicUnsupportedMediaType, BadRequest, ForbiddenOrigin, InternalError, ModelNotFound,
    PayloadTooLarge, ResponseNotFound, Unauthorized, Unavailable, UnsupportedMediaType,
};
pub use schemas::{
    ChatCompletionChunkObject, ChatCompletionEvent, ChatCompletionObject, MessageStreamSse,
    OpenApiDocument, ResponseStreamEvent, ResponseStreamSse, TextCompletionChunkObject,
    TextCompletionEvent, TextCompletionObject,
};

/// The document's operations and schemas.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "mlxcel",
        description = "OpenAI-compatible LLM inference server on MLX, with Anthropic's Messages API at /v1/messages. Every error is an ErrorResponse (an AnthropicErrorResponse on /v1/messages and below). Every response carries an `x-request-id` header (the client's, or a new UUID). With --api-key, every operation but GET /health needs `Authorization: Bearer <key>` or `x-api-key: <key>`.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        crate::completions::chat_completions,
        crate::completions::completions,
        crate::responses::create_response,
        crate::responses::retrieve_response,
        crate::responses::delete_response,
        crate::infill::infill,
        crate::embeddings::embeddings,
        crate::anthropic::create_message,
        crate::anthropic::count_tokens,
        crate::tokenize::tokenize,
        crate::tokenize::detokenize,
        crate::routes::list_models,
        crate::routes::retrieve_model,
        crate::routes::cache_stats,
        crate::routes::cache_reset,
        crate::routes::metrics,
        crate::routes::health,
        openapi_json,
    ),
    components(
        schemas(
            ChatCompletionRequest,
            CompletionRequest,
            InfillBody,
            InfillExtraFile,
            InfillResponse,
            EmbeddingsBody,
            EmbeddingList,
            EmbeddingObject,
            EmbeddingVector,
            EmbeddingUsage,
            ChatCompletionObject,
            ChatCompletionChunkObject,
            TextCompletionObject,
            TextCompletionChunkObject,
            ChatChoice,
            AssistantMessage,
            ToolCallBody,
            FunctionCall,
            ChatLogprobs,
            ChatTokenLogprob,
            TopLogprob,
            ChunkChoice,
            ChunkDelta,
            ToolCallDelta,
            FunctionDelta,
            TextChoice,
            LegacyLogprobs,
            UsageBody,
            PromptTokensDetails,
            ModelList,
            ModelCard,
            CacheStats,
            DiskCacheStats,
            RecurrentStateStats,
            BlockCounts,
            CacheReset,
            CacheResetRequest,
            Health,
            ErrorBody,
            ErrorDetail,
            ResponsesRequest,
            InputItem,
            InputPart,
            ResponseTool,
            NamedFunction,
            TextConfig,
            TextFormat,
            ResponseStreamOptions,
            ResponseObject,
            ResponseStatus,
            ResponseError,
            IncompleteDetails,
            ResponseUsage,
            InputTokensDetails,
            OutputTokensDetails,
            OutputItem,
            ItemStatus,
            OutputMessage,
            OutputText,
            FunctionCallItem,
            ResponseStreamEvent,
            ResponseDeleted,
            TokenizeBody,
            TokenizeResponse,
            DetokenizeBody,
            DetokenizeResponse,
            MessagesRequest,
            InputMessage,
            InputBlock,
            TextBlock,
            Tool,
            ToolChoiceParam,
            ThinkingParam,
            Metadata,
            Message,
            ContentBlock,
            StopReason,
            MessageUsage,
            BlockDelta,
            MessageDeltaBody,
            StreamEvent,
            AnthropicErrorResponse,
            AnthropicErrorDetail,
            TokenCount,
        ),
        responses(
            BadRequest,
            Unauthorized,
            ForbiddenOrigin,
            ModelNotFound,
            PayloadTooLarge,
            UnsupportedMediaType,
            InternalError,
            Unavailable,
            ResponseNotFound,
            AnthropicBadRequest,
            AnthropicUnauthorized,
            AnthropicForbidden,
            AnthropicNotFound,
            AnthropicPayloadTooLarge,
            AnthropicUnsupportedMediaType,
            AnthropicInternalError,
            AnthropicUnavailable,
        ),
    ),
    modifiers(&ApiKey),
)]
pub struct ApiDoc;

/// The document, as served.
pub fn document() -> &'static Value {
    static DOCUMENT: OnceLock<Value> = OnceLock::new();
    DOCUMENT.get_or_init(|| {
        let mut document = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
        close_request_objects(&mut document);
        document
    })
}

/// The document as JSON text, as served.
pub fn document_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| document().to_string())
}

/// `GET /openapi.json`.
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "getOpenApi",
    summary = "This document",
    responses((status = 200, description = "This document", body = OpenApiDocument)),
)]
pub async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        document_json(),
    )
        .into_response()
}

/// An axum path template in OpenAPI's syntax: a catch-all `{*id}` becomes
/// `{id}`.
pub fn openapi_path(axum_path: &str) -> String {
    axum_path.replace("{*", "{")
}

/// The API key: the `bearerAuth` scheme, required (with its 401) by every
/// operation but the public health check.
struct ApiKey;

impl Modify for ApiKey {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let scheme = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .description(Some(
                "The server's --api-key (MLXCEL_API_KEY); not needed when none is configured.",
            ))
            .build();
        let header = ApiKeyValue::with_description(
            crate::auth::API_KEY_HEADER,
            "The server's --api-key, as Anthropic's clients send it; accepted wherever `Authorization: Bearer` is.",
        );
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearerAuth", SecurityScheme::Http(scheme));
        components.add_security_scheme(
            "apiKeyHeader",
            SecurityScheme::ApiKey(ApiKeyScheme::Header(header)),
        );
        // Either scheme will do.
        let bearer = || {
            vec![
                SecurityRequirement::new("bearerAuth", Vec::<String>::new()),
                SecurityRequirement::new("apiKeyHeader", Vec::<String>::new()),
            ]
        };
        openapi.security = Some(bearer());
        for (path, item) in openapi.paths.paths.iter_mut() {
            let public = path == crate::auth::PUBLIC_HEALTH_PATH;
            let unauthorized = if path.starts_with(crate::anthropic::error::MESSAGES_PATH) {
                AnthropicUnauthorized::response().0
            } else {
                Unauthorized::response().0
            };
            let operations = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.options,
                &mut item.head,
                &mut item.patch,
                &mut item.trace,
            ];
            for operation in operations.into_iter().flatten() {
                if public {
                    operation.security = Some(Vec::new());
                } else {
                    operation.security = Some(bearer());
                    operation.responses.responses.insert(
                        "401".to_owned(),
                        RefOr::Ref(Ref::from_response_name(unauthorized)),
                    );
                }
            }
        }
    }
}

/// Sets `additionalProperties: false` on every object schema with
/// `properties` that a request body reaches (through `$ref`s too) and that
/// says nothing of other keys: such keys are refused (see the module docs).
fn close_request_objects(document: &mut Value) {
    let mut pending: Vec<String> = vec![
        ChatCompletionRequest::name().into_owned(),
        CompletionRequest::name().into_owned(),
        ResponsesRequest::name().into_owned(),
        MessagesRequest::name().into_owned(),
        TokenizeBody::name().into_owned(),
        DetokenizeBody::name().into_owned(),
    ];
    let mut seen = std::collections::BTreeSet::new();
    while let Some(name) = pending.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        if let Some(schema) = document.pointer_mut(&format!("/components/schemas/{name}")) {
            close(schema, &mut pending);
        }
    }
}

/// Closes the objects of `schema`, and queues the schemas it references.
fn close(schema: &mut Value, references: &mut Vec<String>) {
    match schema {
        Value::Object(map) => {
            if let Some(Value::String(target)) = map.get("$ref") {
                if let Some(name) = target.strip_prefix("#/components/schemas/") {
                    references.push(name.to_owned());
                }
            }
            if map.contains_key("properties") && !map.contains_key("additionalProperties") {
                map.insert("additionalProperties".into(), Value::Bool(false));
            }
            for (key, value) in map.iter_mut() {
                // Free-form values (a tool's JSON schema, template
                // variables) keep whatever keys they have.
                if key != "additionalProperties" {
                    close(value, references);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| close(v, references)),
        _ => {}
    }
}
