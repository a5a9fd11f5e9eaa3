//! Cross-origin requests from browsers: which origins may call the API.
//!
//! Off by default (no CORS headers at all). When on, the [`CorsLayer`] sits
//! outside authentication, so a preflight `OPTIONS` is answered without a
//! key, and every response to an allowed origin — refusals included — carries
//! the CORS headers a browser needs to show it to the page.
//!
//! CORS only decides what a page may *read*. A "simple" cross-site request
//! (a form post, or a body with no `Content-Type`) needs no preflight, so a
//! page of any site could still make a server without `--api-key` generate
//! or reset its cache. [`refuse_other_origins`] closes that: a
//! state-changing request carrying an `Origin` the list does not allow is a
//! 403. Clients outside browsers send no `Origin` and are not affected.

use std::str::FromStr;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::error::ApiError;

/// How long a browser may cache a preflight answer.
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

/// The origins allowed to call the API from a browser.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AllowedOrigins {
    /// No CORS headers: browsers refuse cross-origin calls.
    #[default]
    Disabled,
    /// Any origin (`*`).
    Any,
    /// Exactly these origins (e.g. `https://app.example.com`), compared as
    /// the browser sends them.
    List(Vec<String>),
}

/// An `--allowed-origins` value that is not `*` or a list of origins.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowedOriginsError {
    /// The list has no origin in it.
    #[error("expected `*` or a comma-separated list of origins")]
    Empty,
    /// An entry is not `scheme://host[:port]`.
    #[error("`{0}` is not an origin (expected scheme://host[:port], without a path)")]
    NotAnOrigin(String),
    /// `*` given together with origins.
    #[error("`*` allows every origin; give it alone")]
    WildcardInList,
}

impl FromStr for AllowedOrigins {
    type Err = AllowedOriginsError;

    /// `*`, or origins separated by commas (blanks around them ignored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let entries: Vec<&str> = s
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        match entries.as_slice() {
            [] => Err(AllowedOriginsError::Empty),
            ["*"] => Ok(Self::Any),
            _ if entries.contains(&"*") => Err(AllowedOriginsError::WildcardInList),
            _ => entries
                .iter()
                .map(|entry| parse_origin(entry))
                .collect::<Result<_, _>>()
                .map(Self::List),
        }
    }
}

/// `scheme://host[:port]` with no path, query or trailing slash (browsers
/// send origins in exactly that form, so anything else would never match).
fn parse_origin(entry: &str) -> Result<String, AllowedOriginsError> {
    let not_an_origin = || AllowedOriginsError::NotAnOrigin(entry.to_owned());
    let (scheme, host) = entry.split_once("://").ok_or_else(not_an_origin)?;
    let scheme_ok = !scheme.is_empty()
        && scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'));
    let host_ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'/' | b'?' | b'#' | b','));
    if !(scheme_ok && host_ok) {
        return Err(not_an_origin());
    }
    Ok(entry.to_owned())
}

impl AllowedOrigins {
    /// Whether a page of `origin` (an `Origin` header's value) may call the
    /// API.
    pub fn allows(&self, origin: &[u8]) -> bool {
        match self {
            Self::Disabled => false,
            Self::Any => true,
            Self::List(origins) => origins.iter().any(|o| o.as_bytes() == origin),
        }
    }

    /// The layer answering preflights and adding CORS headers; `None` when
    /// disabled.
    pub fn layer(&self) -> Option<CorsLayer> {
        let origin = match self {
            Self::Disabled => return None,
            Self::Any => AllowOrigin::any(),
            Self::List(origins) => AllowOrigin::list(
                origins
                    .iter()
                    // Parsed origins are printable ASCII: never skipped.
                    .filter_map(|origin| HeaderValue::from_str(origin).ok()),
            ),
        };
        let request_id = HeaderName::from_static("x-request-id");
        Some(
            CorsLayer::new()
                .allow_origin(origin)
                .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    request_id.clone(),
                ])
                .expose_headers([request_id])
                .max_age(PREFLIGHT_MAX_AGE),
        )
    }
}

/// Middleware: refuses a request that may change state (any method but
/// `GET`, `HEAD` and `OPTIONS`) when it carries an `Origin` header that
/// `origins` does not allow, with a 403 OpenAI error body
/// (`origin_not_allowed`); every other request passes.
pub async fn refuse_other_origins(
    State(origins): State<AllowedOrigins>,
    request: Request,
    next: Next,
) -> Response {
    let reads_only = matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    if !reads_only {
        if let Some(origin) = request.headers().get(header::ORIGIN) {
            if !origins.allows(origin.as_bytes()) {
                let shown = String::from_utf8_lossy(origin.as_bytes()).into_owned();
                return ApiError::OriginNotAllowed(shown).into_response();
            }
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_wildcard_and_lists() {
        assert_eq!("*".parse(), Ok(AllowedOrigins::Any));
        assert_eq!(" * ".parse(), Ok(AllowedOrigins::Any));
        assert_eq!(
            "https://a.example, http://localhost:3000".parse(),
            Ok(AllowedOrigins::List(vec![
                "https://a.example".to_owned(),
                "http://localhost:3000".to_owned()
            ]))
        );
    }

    #[test]
    fn refuses_what_no_browser_sends() {
        assert_eq!(
            "".parse::<AllowedOrigins>(),
            Err(AllowedOriginsError::Empty)
        );
        assert_eq!(
            " , ".parse::<AllowedOrigins>(),
            Err(AllowedOriginsError::Empty)
        );
        assert_eq!(
            "*,https://a.example".parse::<AllowedOrigins>(),
            Err(AllowedOriginsError::WildcardInList)
        );
        for bad in [
            "a.example",
            "https://a.example/",
            "https://",
            "://a",
            "https://a b",
        ] {
            assert_eq!(
                bad.parse::<AllowedOrigins>(),
                Err(AllowedOriginsError::NotAnOrigin(bad.to_owned())),
                "{bad}"
            );
        }
    }

    #[test]
    fn disabled_has_no_layer() {
        assert!(AllowedOrigins::Disabled.layer().is_none());
        assert!(AllowedOrigins::Any.layer().is_some());
    }
}
