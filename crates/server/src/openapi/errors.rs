//! The document's reusable error responses, each an [`ErrorBody`] (401
//! with its `WWW-Authenticate` header).

use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::{Content, Ref, RefOr};
use utoipa::{ToResponse, ToSchema};

use crate::error::ErrorBody;

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
            "An API key is configured and the request carries neither `Authorization: Bearer <key>` nor `x-api-key: <key>`. Missing, malformed and wrong keys get this same body (code invalid_api_key).",
        )
        .header("WWW-Authenticate", header);
        ("Unauthorized", response.build().into())
    }
}

/// Declares `$name`, a reusable response with an Anthropic error body
/// (the `/v1/messages` routes).
macro_rules! anthropic_error_response {
    ($(#[$doc:meta])* $name:ident, $description:literal) => {
        $(#[$doc])*
        pub struct $name;

        impl<'r> ToResponse<'r> for $name {
            fn response() -> (&'r str, RefOr<utoipa::openapi::Response>) {
                (stringify!($name), anthropic_error($description).build().into())
            }
        }
    };
}

fn anthropic_error(description: &str) -> ResponseBuilder {
    let body = Content::new(Some(Ref::from_schema_name(
        crate::anthropic::wire::ErrorResponse::name(),
    )));
    ResponseBuilder::new()
        .description(description)
        .content("application/json", body)
}

anthropic_error_response!(
    /// 400 on a Messages route.
    AnthropicBadRequest,
    "invalid_request_error: the body broke a rule of the schema (the message names the field), is not JSON, or the engine refused it (e.g. the prompt is longer than the context)."
);
anthropic_error_response!(
    /// 401 on a Messages route.
    AnthropicUnauthorized,
    "authentication_error: an API key is configured and the request carries neither `x-api-key: <key>` nor `Authorization: Bearer <key>`."
);
anthropic_error_response!(
    /// 403 on a Messages route.
    AnthropicForbidden,
    "permission_error: a request from a web page whose origin --allowed-origins does not allow."
);
anthropic_error_response!(
    /// 404 on a Messages route.
    AnthropicNotFound,
    "not_found_error: the model is not the one this server serves."
);
anthropic_error_response!(
    /// 413 on a Messages route.
    AnthropicPayloadTooLarge,
    "request_too_large: the body is larger than the server's limit."
);
anthropic_error_response!(
    /// 415 on a Messages route.
    AnthropicUnsupportedMediaType,
    "invalid_request_error: the Content-Type is not JSON, or the Content-Encoding is not gzip."
);
anthropic_error_response!(
    /// 500 on a Messages route.
    AnthropicInternalError,
    "api_error: the server or the engine failed."
);
anthropic_error_response!(
    /// 503 on a Messages route.
    AnthropicUnavailable,
    "overloaded_error: the engine is unavailable, out of memory or shutting down."
);
