//! Errors in Anthropic's shape for the `/v1/messages` routes.
//!
//! Every error is still an [`ApiError`], made where it happens (the API
//! key check, the origin check, the body extractor, validation, the
//! engine); its response carries the error as an extension, and
//! [`reshape_errors`], around every layer, rewrites the body of such a
//! response to a path under `/v1/messages` as
//! `{"type": "error", "error": {"type", "message"}}`, keeping its status
//! and headers. The error's type follows the status, as Anthropic's do.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use super::wire::{ErrorDetail, ErrorResponse};
use crate::error::{ApiError, SERIALIZATION_FAILED_BODY};

/// The path prefix whose errors are answered in Anthropic's shape.
pub const MESSAGES_PATH: &str = "/v1/messages";

/// Anthropic's error `type` for an answer of `status`.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// `error` in Anthropic's shape. The field at fault, where the message
/// does not name it already, is put first (`messages: ...`).
pub fn error_body(error: &ApiError) -> ErrorResponse {
    let mut message = error.to_string();
    if let Some(param) = error.body().error.param {
        if !message.contains(param.as_str()) {
            message = format!("{param}: {message}");
        }
    }
    ErrorResponse {
        kind: "error",
        error: ErrorDetail {
            kind: error_type(error.status()),
            message,
        },
    }
}

/// Whether `path` is one of the Messages routes (or under them).
fn is_messages_path(path: &str) -> bool {
    path == MESSAGES_PATH
        || path
            .strip_prefix(MESSAGES_PATH)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Middleware: an error answered to a `/v1/messages` path gets
/// Anthropic's error body (same status and headers).
pub async fn reshape_errors(request: Request, next: Next) -> Response {
    let messages = is_messages_path(request.uri().path());
    let response = next.run(request).await;
    if !messages {
        return response;
    }
    let Some(error) = response.extensions().get::<ApiError>().cloned() else {
        return response;
    };
    let (mut parts, _) = response.into_parts();
    let body = serde_json::to_vec(&error_body(&error))
        .unwrap_or_else(|_| SERIALIZATION_FAILED_BODY.as_bytes().to_vec());
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_follow_the_status() {
        assert_eq!(error_type(StatusCode::BAD_REQUEST), "invalid_request_error");
        assert_eq!(error_type(StatusCode::UNAUTHORIZED), "authentication_error");
        assert_eq!(error_type(StatusCode::FORBIDDEN), "permission_error");
        assert_eq!(error_type(StatusCode::NOT_FOUND), "not_found_error");
        assert_eq!(
            error_type(StatusCode::PAYLOAD_TOO_LARGE),
            "request_too_large"
        );
        assert_eq!(
            error_type(StatusCode::UNSUPPORTED_MEDIA_TYPE),
            "invalid_request_error"
        );
        assert_eq!(error_type(StatusCode::INTERNAL_SERVER_ERROR), "api_error");
        assert_eq!(
            error_type(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error"
        );
    }

    #[test]
    fn only_the_messages_routes_are_reshaped() {
        assert!(is_messages_path("/v1/messages"));
        assert!(is_messages_path("/v1/messages/count_tokens"));
        assert!(is_messages_path("/v1/messages/batches"));
        assert!(!is_messages_path("/v1/messagesx"));
        assert!(!is_messages_path("/v1/chat/completions"));
    }

    #[test]
    fn the_field_at_fault_is_named() {
        let error = ApiError::EngineRejected {
            message: "this model has no chat template".into(),
            param: Some("messages".into()),
        };
        let body = error_body(&error);
        assert_eq!(body.error.kind, "invalid_request_error");
        assert_eq!(
            body.error.message,
            "messages: this model has no chat template"
        );
    }
}
