//! A JSON body extractor whose rejections are [`ApiError`]s, so axum's
//! plain-text rejections never reach a client.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use serde_json::Value;

use crate::error::ApiError;
use crate::AppState;

/// The request body parsed as JSON (any JSON value; the route checks its
/// shape), within the body limit. Like other OpenAI-compatible servers, a
/// body sent without a `Content-Type`, or with the form type `curl -d`
/// sends by default, is read as JSON too; any other non-JSON type is a 415.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonBody(pub Value);

impl FromRequest<AppState> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        if !has_json_content_type(req.headers()) {
            return Err(ApiError::UnsupportedMediaType);
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge {
                    limit_bytes: state.config().body_limit_bytes,
                }
            } else {
                ApiError::BodyRead(rejection.body_text())
            }
        })?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|err| ApiError::MalformedJson(err.to_string()))
    }
}

/// No `Content-Type`, `application/json`, any `application/*+json`, or
/// `application/x-www-form-urlencoded` (`curl -d` without `-H`), with any
/// parameters.
fn has_json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return true;
    };
    let Ok(value) = value.to_str() else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence == "application/x-www-form-urlencoded"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}
