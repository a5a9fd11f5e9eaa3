//! API-key authentication: with an API key configured, every request but
//! `GET /health` must carry `Authorization: Bearer <key>` or, as
//! Anthropic's clients send it, `x-api-key: <key>` (either on every route).
//!
//! Every refusal is the same [`ApiError::InvalidApiKey`], whatever was wrong
//! (no header, another scheme, a wrong key), and unmatched paths are refused
//! the same way before routing can answer 404, so an unauthenticated client
//! learns neither which routes exist nor why its key failed. The key is
//! compared as a SHA-256 digest in constant time: neither its bytes nor its
//! length show in the response time.

use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;

/// The path that answers without a key (load balancers and orchestrators
/// probe it without credentials).
pub const PUBLIC_HEALTH_PATH: &str = "/health";

/// The header Anthropic's clients send the key in (`x-api-key: <key>`).
pub const API_KEY_HEADER: &str = "x-api-key";

/// The configured API key, kept only as its SHA-256 digest.
#[derive(Clone)]
pub struct ApiKey {
    digest: [u8; 32],
}

impl ApiKey {
    /// The check for `key`.
    pub fn new(key: &str) -> Self {
        Self {
            digest: Sha256::digest(key.as_bytes()).into(),
        }
    }

    /// Whether `headers` carry `Authorization: Bearer <this key>` or
    /// `x-api-key: <this key>`. The scheme name is case-insensitive (RFC
    /// 7235); the key is not.
    pub fn accepts(&self, headers: &HeaderMap) -> bool {
        let matches = |token: &[u8]| -> bool {
            let presented: [u8; 32] = Sha256::digest(token).into();
            presented.ct_eq(&self.digest).into()
        };
        bearer_token(headers).is_some_and(matches) || header_key(headers).is_some_and(matches)
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// The token of an `Authorization: Bearer <token>` header, if the request
/// has exactly that.
fn bearer_token(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(value.iter().position(|&b| b == b' ')?)?;
    if !scheme.eq_ignore_ascii_case(b"Bearer") {
        return None;
    }
    let token = token.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// The key of an `x-api-key: <key>` header (surrounding blanks trimmed),
/// if the request has a non-empty one.
fn header_key(headers: &HeaderMap) -> Option<&[u8]> {
    let token = headers.get(API_KEY_HEADER)?.as_bytes().trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Whether `request` is exempt from the key: `GET` (or `HEAD`) `/health`.
fn is_public(request: &Request) -> bool {
    matches!(*request.method(), Method::GET | Method::HEAD)
        && request.uri().path() == PUBLIC_HEALTH_PATH
}

/// Middleware: refuses every non-public request that lacks the key (in
/// either header) with
/// [`ApiError::InvalidApiKey`] (401, `WWW-Authenticate: Bearer`).
pub async fn require_api_key(
    State(key): State<Arc<ApiKey>>,
    request: Request,
    next: Next,
) -> Response {
    if is_public(&request) || key.accepts(request.headers()) {
        return next.run(request).await;
    }
    ApiError::InvalidApiKey.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(authorization: &[u8]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let value = HeaderValue::from_bytes(authorization).expect("a valid header value");
        headers.insert(header::AUTHORIZATION, value);
        headers
    }

    #[test]
    fn accepts_only_the_bearer_key() {
        let key = ApiKey::new("sk-test");
        assert!(key.accepts(&headers(b"Bearer sk-test")));
        assert!(key.accepts(&headers(b"bearer sk-test")));
        assert!(key.accepts(&headers(b"BEARER  sk-test ")));
        assert!(!key.accepts(&HeaderMap::new()));
        assert!(!key.accepts(&headers(b"Bearer sk-tes")));
        assert!(!key.accepts(&headers(b"Bearer sk-test2")));
        assert!(!key.accepts(&headers(b"Bearer SK-TEST")));
        assert!(!key.accepts(&headers(b"Basic sk-test")));
        assert!(!key.accepts(&headers(b"sk-test")));
        assert!(!key.accepts(&headers(b"Bearer")));
        assert!(!key.accepts(&headers(b"Bearer ")));
        assert!(!key.accepts(&headers(b"Bearersk-test")));
        assert!(!key.accepts(&headers(b"Bearer \xffsk-test")));
    }

    fn x_api_key(value: &[u8]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let value = HeaderValue::from_bytes(value).expect("a valid header value");
        headers.insert(API_KEY_HEADER, value);
        headers
    }

    #[test]
    fn accepts_the_key_in_x_api_key() {
        let key = ApiKey::new("sk-test");
        assert!(key.accepts(&x_api_key(b"sk-test")));
        assert!(key.accepts(&x_api_key(b" sk-test ")));
        assert!(!key.accepts(&x_api_key(b"Bearer sk-test")));
        assert!(!key.accepts(&x_api_key(b"sk-tes")));
        assert!(!key.accepts(&x_api_key(b"SK-TEST")));
        assert!(!key.accepts(&x_api_key(b"")));
        // A wrong bearer with the right x-api-key, and the other way round.
        let mut both = x_api_key(b"sk-test");
        both.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer nope"),
        );
        assert!(key.accepts(&both));
        let mut both = headers(b"Bearer sk-test");
        both.insert(API_KEY_HEADER, HeaderValue::from_static("nope"));
        assert!(key.accepts(&both));
        assert!(!ApiKey::new("").accepts(&x_api_key(b"")));
    }

    #[test]
    fn an_empty_key_accepts_nothing() {
        let key = ApiKey::new("");
        assert!(!key.accepts(&headers(b"Bearer ")));
        assert!(!key.accepts(&HeaderMap::new()));
    }

    #[test]
    fn debug_hides_the_key() {
        let shown = format!("{:?}", ApiKey::new("sk-secret"));
        assert!(!shown.contains("sk-secret"), "{shown}");
    }
}
