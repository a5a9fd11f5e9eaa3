//! The one place where an error becomes an OpenAI error body.
//!
//! Every failure a client can see — a validation rule, a malformed body, an
//! unknown route, an engine refusal or failure — is an [`ApiError`]. Its
//! [`IntoResponse`] impl and [`ApiError::body`] (used for the error event of a
//! stream) are the only code that builds
//! `{"error":{"message","type","param","code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxcel_engine_api::{FailureKind, RequestField, SubmitError};
use serde::Serialize;

use crate::validate::ValidationError;

/// OpenAI's `type` for errors the client caused.
const INVALID_REQUEST: &str = "invalid_request_error";
/// OpenAI's `type` for errors on the server's side.
const SERVER_ERROR: &str = "server_error";

/// The error body sent if serializing a response ever fails (it cannot for
/// the plain structs of this crate, but a stream must still end with a body).
pub const SERIALIZATION_FAILED_BODY: &str = r#"{"error":{"message":"The server could not serialize its response","type":"server_error","param":null,"code":null}}"#;

/// Everything that can go wrong with a request, as the client sees it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The body parsed as JSON but broke a rule of the request schema.
    #[error(transparent)]
    Validation(#[from] ValidationError),
    /// The body is not valid JSON.
    #[error("We could not parse the JSON body of your request: {0}")]
    MalformedJson(String),
    /// The body could not be read (connection error, bad framing).
    #[error("Failed to read the request body: {0}")]
    BodyRead(String),
    /// The `Content-Type` is not JSON.
    #[error("Unsupported Content-Type: expected `application/json`")]
    UnsupportedMediaType,
    /// The body is larger than the configured limit.
    #[error("The request body is larger than the limit of {limit_bytes} bytes")]
    PayloadTooLarge {
        /// The configured limit.
        limit_bytes: usize,
    },
    /// The server requires an API key and the request did not present it as
    /// `Authorization: Bearer <key>` or `x-api-key: <key>`: missing,
    /// malformed and wrong keys are one error with one body, so a client
    /// learns nothing from the answer.
    #[error("Incorrect API key provided.")]
    InvalidApiKey,
    /// A state-changing request from a browser page of an origin that
    /// `--allowed-origins` does not allow (a cross-site request).
    #[error("Requests from the web origin `{0}` are not allowed; start the server with --allowed-origins to allow a web page to call it")]
    OriginNotAllowed(String),
    /// The body has a `Content-Encoding` the server does not decode.
    #[error("Unsupported Content-Encoding `{0}`: send the body uncompressed or gzip-compressed")]
    UnsupportedContentEncoding(String),
    /// `GET /v1/models/{id}` for a model this server does not serve.
    #[error("The model `{0}` does not exist")]
    UnknownModel(String),
    /// `GET`/`DELETE /v1/responses/{id}` for a response the store does
    /// not hold (never stored, evicted, or deleted).
    #[error("Response with id '{0}' not found")]
    UnknownResponse(String),
    /// No route matches the path.
    #[error("Invalid URL ({method} {path})")]
    RouteNotFound {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The path exists but not for this method.
    #[error("Method {method} is not allowed for {path}")]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The engine refused the request as asked (e.g. the prompt is longer
    /// than the context).
    #[error("{message}")]
    EngineRejected {
        /// The engine's explanation.
        message: String,
        /// The offending field, where there is one.
        param: Option<String>,
    },
    /// The prompt does not fit the model's context.
    #[error("{message}")]
    ContextLengthExceeded {
        /// The engine's explanation.
        message: String,
        /// The field holding the prompt (`messages`, `prompt`, `prompt[i]`).
        param: String,
    },
    /// The engine is gone or shutting down.
    #[error("The engine is unavailable: {0}")]
    Unavailable(String),
    /// The engine failed while generating this request, by a failure of
    /// `kind`: 503 when the server cannot serve it now (out of memory, a
    /// broken tensor-parallel group), 500 otherwise (a shutdown that cut
    /// it, a model or engine failure); the kind is the error's `code`.
    #[error("The engine failed while generating: {message}")]
    GenerationFailed {
        /// What failed.
        kind: FailureKind,
        /// The engine's explanation.
        message: String,
    },
    /// A server-side failure outside generation (metrics, a task join).
    #[error("Internal server error: {0}")]
    Internal(String),
}

/// The OpenAI error body: `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[schema(as = ErrorResponse)]
pub struct ErrorBody {
    /// The error itself.
    pub error: ErrorDetail,
}

/// The inside of an OpenAI error body.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Human-readable description.
    pub message: String,
    /// `invalid_request_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, if any.
    #[schema(required = true)]
    pub param: Option<String>,
    /// A machine-readable code, if any (e.g. `model_not_found`,
    /// `invalid_api_key`, `context_length_exceeded`).
    #[schema(required = true)]
    pub code: Option<&'static str>,
}

impl ApiError {
    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Validation(ValidationError::ModelNotFound(_)) | Self::UnknownModel(_) => {
                StatusCode::NOT_FOUND
            }
            Self::Validation(_)
            | Self::MalformedJson(_)
            | Self::BodyRead(_)
            | Self::EngineRejected { .. }
            | Self::ContextLengthExceeded { .. } => StatusCode::BAD_REQUEST,
            Self::InvalidApiKey => StatusCode::UNAUTHORIZED,
            Self::OriginNotAllowed(_) => StatusCode::FORBIDDEN,
            Self::UnsupportedMediaType | Self::UnsupportedContentEncoding(_) => {
                StatusCode::UNSUPPORTED_MEDIA_TYPE
            }
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::RouteNotFound { .. } | Self::UnknownResponse(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::GenerationFailed {
                kind: FailureKind::OutOfMemory | FailureKind::GroupBroken,
                ..
            } => StatusCode::SERVICE_UNAVAILABLE,
            Self::GenerationFailed { .. } | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Unavailable(_) | Self::GenerationFailed { .. } | Self::Internal(_) => {
                SERVER_ERROR
            }
            _ => INVALID_REQUEST,
        }
    }

    fn param(&self) -> Option<String> {
        match self {
            Self::Validation(err) => err.param(),
            Self::EngineRejected { param, .. } => param.clone(),
            Self::UnknownModel(_) => Some("model".to_owned()),
            Self::ContextLengthExceeded { param, .. } => Some(param.clone()),
            _ => None,
        }
    }

    fn code(&self) -> Option<&'static str> {
        match self {
            Self::Validation(ValidationError::ModelNotFound(_)) | Self::UnknownModel(_) => {
                Some("model_not_found")
            }
            Self::Validation(ValidationError::UnsupportedParameter { .. }) => {
                Some("unsupported_parameter")
            }
            Self::Validation(ValidationError::UnrecognizedParameter { .. }) => {
                Some("unrecognized_parameter")
            }
            Self::Validation(ValidationError::PreviousResponseNotFound(_)) => {
                Some("previous_response_not_found")
            }
            Self::InvalidApiKey => Some("invalid_api_key"),
            Self::OriginNotAllowed(_) => Some("origin_not_allowed"),
            Self::UnsupportedContentEncoding(_) => Some("unsupported_content_encoding"),
            Self::Unavailable(_) => Some("service_unavailable"),
            Self::ContextLengthExceeded { .. } => Some("context_length_exceeded"),
            Self::GenerationFailed { kind, .. } => Some(kind.as_str()),
            _ => None,
        }
    }

    /// The OpenAI error body of this error.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.kind(),
                param: self.param(),
                code: self.code(),
            },
        }
    }
}

/// The route a request came through, which decides what its fields are
/// called in error bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `/v1/chat/completions`: OpenAI's chat names.
    Chat,
    /// `/v1/completions`; `prompt` is the index of the prompt submitted
    /// when the request had several (`prompt[i]`).
    Completions { prompt: Option<usize> },
    /// `/v1/responses`: the prompt is `input`, the output format
    /// `text.format`.
    Responses,
    /// `/detokenize`: the prompt is `tokens`.
    Detokenize,
    /// `/infill` (llama-server's names): the prompt is `input_prefix`, the
    /// suffix `input_suffix`.
    Infill,
    /// `/v1/embeddings`: the prompt is `input`, or `input[i]` when the
    /// request had several.
    Embeddings { input: Option<usize> },
}

impl Route {
    /// What this route calls `field`.
    pub fn param(self, field: RequestField) -> String {
        match (self, field) {
            (Self::Completions { prompt: Some(i) }, RequestField::Prompt) => format!("prompt[{i}]"),
            (Self::Completions { .. }, RequestField::Prompt) => "prompt".to_owned(),
            (Self::Responses, RequestField::Prompt) => "input".to_owned(),
            (Self::Responses, RequestField::ResponseFormat) => "text.format".to_owned(),
            (Self::Detokenize, _) => "tokens".to_owned(),
            (Self::Infill, RequestField::Prompt) => "input_prefix".to_owned(),
            (Self::Infill, RequestField::Suffix) => "input_suffix".to_owned(),
            (Self::Embeddings { input: Some(i) }, _) => format!("input[{i}]"),
            (Self::Embeddings { input: None }, _) => "input".to_owned(),
            (_, field) => field.chat_name().to_owned(),
        }
    }
}

impl ApiError {
    /// The engine's refusal of a request that came through `route`, its
    /// field named as that route names it.
    pub fn from_submit(err: SubmitError, route: Route) -> Self {
        match err {
            SubmitError::InvalidRequest { message, field } => Self::EngineRejected {
                message,
                param: field.map(|f| route.param(f)),
            },
            SubmitError::ContextLengthExceeded { .. } => Self::ContextLengthExceeded {
                message: err.to_string(),
                param: route.param(RequestField::Prompt),
            },
            SubmitError::Unavailable(reason) => Self::Unavailable(reason),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(status = status.as_u16(), error = %self, "request failed");
        } else {
            tracing::debug!(status = status.as_u16(), error = %self, "request rejected");
        }
        let mut response = (status, Json(self.body())).into_response();
        if matches!(self, Self::InvalidApiKey) {
            // RFC 6750: a 401 names the scheme the client should use.
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        // The Messages routes answer the same error in Anthropic's shape
        // (`crate::anthropic::error`).
        response.extensions_mut().insert(self);
        response
    }
}
