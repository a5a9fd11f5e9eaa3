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
//! The tests below hold the document to the router: every route of
//! [`crate::route_table`] is documented, and every documented operation is
//! routed.

use std::borrow::Cow;
use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Content, Ref, RefOr, Schema};
use utoipa::{Modify, OpenApi, PartialSchema, ToResponse, ToSchema};

use crate::error::{ErrorBody, ErrorDetail};
use crate::openai::chat::{
    AssistantMessage, ChatChoice, ChatLogprobs, ChatTokenLogprob, ChunkChoice, ChunkDelta,
    FunctionCall, FunctionDelta, ToolCallBody, ToolCallDelta, TopLogprob,
};
use crate::openai::completion::{finished_text_choice, LegacyLogprobs, TextChoice};
use crate::openai::request::{json_schema, ChatCompletionRequest, CompletionRequest};
use crate::openai::response_object::{
    stream_event_json, FunctionCallItem, IncompleteDetails, InputTokensDetails, ItemStatus,
    OutputItem, OutputMessage, OutputText, OutputTokensDetails, ResponseError, ResponseObject,
    ResponseStatus, ResponseUsage,
};
use crate::openai::responses::{
    InputItem, InputPart, NamedFunction, ResponseStreamOptions, ResponseTool, ResponsesRequest,
    TextConfig, TextFormat,
};
use crate::openai::tokenize::{DetokenizeBody, DetokenizeResponse, TokenizeBody, TokenizeResponse};
use crate::openai::{
    BlockCounts, CacheReset, CacheStats, Completion, CompletionKind, Health, ModelCard, ModelList,
    PromptTokensDetails, UsageBody,
};
use crate::responses::ResponseDeleted;

/// The document's operations and schemas.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "mlxcel",
        description = "OpenAI-compatible LLM inference server on MLX. Every error is an ErrorResponse. Every response carries an `x-request-id` header (the client's, or a new UUID). With --api-key, every operation but GET /health needs `Authorization: Bearer <key>`.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        crate::completions::chat_completions,
        crate::completions::completions,
        crate::responses::create_response,
        crate::responses::retrieve_response,
        crate::responses::delete_response,
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
            BlockCounts,
            CacheReset,
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
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme("bearerAuth", SecurityScheme::Http(scheme));
        let bearer = || vec![SecurityRequirement::new("bearerAuth", Vec::<String>::new())];
        openapi.security = Some(bearer());
        for (path, item) in openapi.paths.paths.iter_mut() {
            let public = path == crate::auth::PUBLIC_HEALTH_PATH;
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
                        RefOr::Ref(Ref::from_response_name(Unauthorized::response().0)),
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

/// Declares `$name`, a reusable response with an [`ErrorBody`].
macro_rules! error_response {
    ($(#[$doc:meta])* $name:ident, $description:literal) => {
        $(#[$doc])*
        pub struct $name;

        impl<'r> ToResponse<'r> for $name {
            fn response() -> (&'r str, RefOr<utoipa::openapi::Response>) {
                (stringify!($name), error_response($description).build().into())
            }
        }
    };
}

fn error_response(description: &str) -> ResponseBuilder {
    let body = Content::new(Some(Ref::from_schema_name(ErrorBody::name())));
    ResponseBuilder::new()
        .description(description)
        .content("application/json", body)
}

error_response!(
    /// 400.
    BadRequest,
    "The body broke a rule of the schema, is not JSON, or the engine refused it (e.g. the prompt is longer than the context: code context_length_exceeded)."
);
error_response!(
    /// 403.
    ForbiddenOrigin,
    "A state-changing request from a web page whose origin --allowed-origins does not allow (code `origin_not_allowed`)"
);
error_response!(
    /// 404 on a model.
    ModelNotFound,
    "The model is not the one this server serves (code model_not_found)."
);
error_response!(
    /// 404 on a response id.
    ResponseNotFound,
    "No stored response has this id (never stored, store false, evicted from the bounded store, or deleted)."
);
error_response!(
    /// 413.
    PayloadTooLarge,
    "The body is larger than the server's limit."
);
error_response!(
    /// 415.
    UnsupportedMediaType,
    "The Content-Type is not JSON (no Content-Type, application/json, application/*+json and application/x-www-form-urlencoded are read as JSON); or a Content-Encoding other than gzip (code `unsupported_content_encoding`)"
);
error_response!(
    /// 500.
    InternalError,
    "The server or the engine failed."
);
error_response!(
    /// 503.
    Unavailable,
    "The engine is unavailable or shutting down (code service_unavailable)."
);

/// 401, with its `WWW-Authenticate` header.
pub struct Unauthorized;

impl<'r> ToResponse<'r> for Unauthorized {
    fn response() -> (&'r str, RefOr<utoipa::openapi::Response>) {
        let bearer = ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(["Bearer"]));
        let header = HeaderBuilder::new()
            .schema(bearer)
            .description(Some("Always `Bearer`."))
            .build();
        let response = error_response(
            "An API key is configured and the request lacks `Authorization: Bearer <key>`. Missing, malformed and wrong keys get this same body (code invalid_api_key).",
        )
        .header("WWW-Authenticate", header);
        ("Unauthorized", response.build().into())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    use super::*;

    const METHODS: &[&str] = &["get", "put", "post", "delete", "options", "head", "patch"];

    fn document() -> Value {
        super::document().clone()
    }

    fn documented() -> BTreeSet<(String, String)> {
        let doc = document();
        let paths = doc["paths"].as_object().expect("paths is an object");
        paths
            .iter()
            .flat_map(|(path, item)| {
                let item = item.as_object().expect("a path item is an object");
                item.keys()
                    .filter(|key| METHODS.contains(&key.as_str()))
                    .map(|method| (method.clone(), path.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn routed() -> BTreeSet<(String, String)> {
        crate::route_table()
            .into_iter()
            .map(|(method, path)| (method.as_str().to_ascii_lowercase(), openapi_path(path)))
            .collect()
    }

    #[test]
    fn every_route_is_documented() {
        let missing: Vec<_> = routed().difference(&documented()).cloned().collect();
        assert!(
            missing.is_empty(),
            "routes missing from openapi.json: {missing:?}"
        );
    }

    #[test]
    fn every_documented_operation_is_routed() {
        let extra: Vec<_> = documented().difference(&routed()).cloned().collect();
        assert!(extra.is_empty(), "documented but not routed: {extra:?}");
    }

    #[test]
    fn the_document_is_openapi_3_1_with_bearer_auth() {
        let doc = document();
        assert_eq!(doc["openapi"], "3.1.0");
        assert_eq!(
            doc["components"]["securitySchemes"]["bearerAuth"]["scheme"],
            "bearer"
        );
        for (method, path) in documented() {
            let op = &doc["paths"][&path][&method];
            let security = op.get("security");
            if (method.as_str(), path.as_str()) == ("get", crate::auth::PUBLIC_HEALTH_PATH) {
                assert_eq!(security, Some(&serde_json::json!([])), "{method} {path}");
            } else {
                assert_eq!(
                    security,
                    Some(&serde_json::json!([{"bearerAuth": []}])),
                    "{method} {path}"
                );
                assert!(op["responses"].get("401").is_some(), "{method} {path}: 401");
            }
            assert!(
                op["operationId"].is_string(),
                "{method} {path}: operationId"
            );
            assert!(op["responses"].get("200").is_some(), "{method} {path}: 200");
        }
    }

    /// Every `$ref` points at a schema or response the document defines.
    #[test]
    fn every_reference_resolves() {
        fn walk(value: &Value, doc: &Value, bad: &mut Vec<String>) {
            match value {
                Value::Object(map) => {
                    if let Some(Value::String(target)) = map.get("$ref") {
                        let pointer = target.trim_start_matches('#');
                        if doc.pointer(pointer).is_none() {
                            bad.push(target.clone());
                        }
                    }
                    map.values().for_each(|v| walk(v, doc, bad));
                }
                Value::Array(items) => items.iter().for_each(|v| walk(v, doc, bad)),
                _ => {}
            }
        }
        let doc = document();
        let mut bad = Vec::new();
        walk(&doc, &doc, &mut bad);
        assert!(bad.is_empty(), "dangling $ref: {bad:?}");
    }

    /// Request objects refuse other keys (validation names them), free-form
    /// values and response objects say nothing of them.
    #[test]
    fn request_objects_are_closed() {
        let doc = document();
        let schemas = &doc["components"]["schemas"];
        for name in [
            "CreateChatCompletionRequest",
            "CreateCompletionRequest",
            "StreamOptions",
            "SystemMessage",
            "ContentPart",
            "NamedToolChoice",
            "JsonSchemaFormat",
        ] {
            assert_eq!(schemas[name]["additionalProperties"], false, "{name}");
        }
        let function = &schemas["FunctionDefinition"];
        assert_eq!(function["additionalProperties"], false);
        assert_eq!(
            function["properties"]["parameters"].get("additionalProperties"),
            None
        );
        let chat = &schemas["CreateChatCompletionRequest"]["properties"];
        assert_eq!(
            chat["chat_template_kwargs"].get("additionalProperties"),
            None
        );
        assert_eq!(chat["logit_bias"]["additionalProperties"]["maximum"], 100);
        for name in ["ChatCompletion", "ChatChoice", "ErrorResponse"] {
            assert_eq!(schemas[name].get("additionalProperties"), None, "{name}");
        }
    }

    #[test]
    fn catch_all_paths_use_openapi_syntax() {
        assert_eq!(openapi_path("/v1/models/{*id}"), "/v1/models/{id}");
        assert_eq!(openapi_path("/v1/models"), "/v1/models");
    }
}
