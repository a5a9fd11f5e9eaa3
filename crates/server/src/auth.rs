//! Bearer-token authentication: with an API key configured, every request
//! but `GET /health` must carry `Authorization: Bearer <key>`.
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

    /// Whether `headers` carry `Authorization: Bearer <this key>`. The scheme
    /// name is case-insensitive (RFC 7235); the key is not.
    pub fn accepts(&self, headers: &HeaderMap) -> bool {
        let Some(token) = bearer_token(headers) else {
            return false;
        };
        let presented: [u8; 32] = Sha256::digest(token).into();
        presented.ct_eq(&self.digest).into()
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

/// Whether `request` is exempt from the key: `GET` (or `HEAD`) `/health`.
fn is_public(request: &Request) -> bool {
    matches!(*request.method(), Method::GET | Method::HEAD)
        && request.uri().path() == PUBLIC_HEALTH_PATH
}

/// Middleware: refuses every non-public request that lacks the key with
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
