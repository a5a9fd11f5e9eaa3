//! `POST /tokenize` and `POST /detokenize` (vLLM's routes): count a prompt
//! against the served tokenizer and chat template, and decode token ids.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxcel_engine_api::Prompt;

use crate::error::{ApiError, Route};
use crate::extract::JsonBody;
use crate::openai::tokenize::{DetokenizeBody, DetokenizeResponse, TokenizeBody, TokenizeResponse};
use crate::openapi::{
    BadRequest, ForbiddenOrigin, InternalError, ModelNotFound, PayloadTooLarge, Unavailable,
    UnsupportedMediaType,
};
use crate::validate::{ValidatedDetokenizeRequest, ValidatedTokenizeRequest};
use crate::AppState;

/// `POST /tokenize`.
#[utoipa::path(
    post,
    path = "/tokenize",
    operation_id = "tokenize",
    summary = "Token ids of a prompt (vLLM extension)",
    description = "Encodes a text `prompt` as /v1/completions does, or chat `messages` (with `tools`) as /v1/chat/completions renders and encodes them, so `count` equals the `prompt_tokens` of the same chat request.",
    request_body = TokenizeBody,
    responses(
        (status = 200, description = "The token ids", body = TokenizeResponse),
        (status = 400, response = BadRequest),
        (status = 403, response = ForbiddenOrigin),
        (status = 404, response = ModelNotFound),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 500, response = InternalError),
        (status = 503, response = Unavailable),
    ),
)]
pub async fn tokenize(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let service = state.service();
    let request = ValidatedTokenizeRequest::parse(body, service.model_id())?.request;
    let route = match request.prompt {
        Prompt::Chat(_) => Route::Chat,
        _ => Route::Completions { prompt: None },
    };
    let handle = state.service_handle();
    let tokens = tokio::task::spawn_blocking(move || handle.tokenize(&request))
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizing: {e}")))?
        .map_err(|e| ApiError::from_submit(e, route))?;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: service.context_length(),
        tokens,
        token_strs: None,
    })
    .into_response())
}

/// `POST /detokenize`.
#[utoipa::path(
    post,
    path = "/detokenize",
    operation_id = "detokenize",
    summary = "The text of token ids (vLLM extension)",
    request_body = DetokenizeBody,
    responses(
        (status = 200, description = "The text, special tokens included", body = DetokenizeResponse),
        (status = 400, response = BadRequest),
        (status = 403, response = ForbiddenOrigin),
        (status = 404, response = ModelNotFound),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 500, response = InternalError),
        (status = 503, response = Unavailable),
    ),
)]
pub async fn detokenize(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let request = ValidatedDetokenizeRequest::parse(body, state.service().model_id())?;
    let handle = state.service_handle();
    let prompt = tokio::task::spawn_blocking(move || handle.detokenize(&request.tokens))
        .await
        .map_err(|e| ApiError::Internal(format!("detokenizing: {e}")))?
        .map_err(|e| ApiError::from_submit(e, Route::Detokenize))?;
    Ok(Json(DetokenizeResponse { prompt }).into_response())
}
