//! `--allowed-origins`: preflights need no key, allowed origins get CORS
//! headers on every response (refusals included), others get none.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use mlxcel_http::cors::AllowedOrigins;
use mlxcel_http::HttpConfig;

const ALLOWED: &str = "https://app.example";
const OTHER: &str = "https://evil.example";

fn app_allowing(origins: AllowedOrigins) -> axum::Router {
    app_with(
        FakeService::hello(),
        HttpConfig {
            api_key: Some("sk-test-key".to_owned()),
            allowed_origins: origins,
            ..HttpConfig::default()
        },
    )
}

fn listed() -> AllowedOrigins {
    AllowedOrigins::List(vec![ALLOWED.to_owned(), "http://localhost:3000".to_owned()])
}

fn preflight(origin: &str) -> Request<Body> {
    Request::builder()
        .method("OPTIONS")
        .uri("/v1/chat/completions")
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization,content-type",
        )
        .body(Body::empty())
        .unwrap()
}

fn get_from(origin: &str, uri: &str, authorization: Option<&str>) -> Request<Body> {
    let mut request = Request::get(uri).header("origin", origin);
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    request.body(Body::empty()).unwrap()
}

#[tokio::test]
async fn a_preflight_from_an_allowed_origin_succeeds_without_a_key() {
    let reply = send(app_allowing(listed()), preflight(ALLOWED)).await;
    assert_eq!(reply.status, StatusCode::OK);
    let h = &reply.headers;
    assert_eq!(h["access-control-allow-origin"], ALLOWED);
    let methods = h["access-control-allow-methods"].to_str().unwrap();
    for method in ["GET", "POST", "OPTIONS"] {
        assert!(methods.contains(method), "{methods}");
    }
    let headers = h["access-control-allow-headers"].to_str().unwrap();
    for header in ["authorization", "content-type", "x-request-id"] {
        assert!(headers.contains(header), "{headers}");
    }
    assert!(h.get("access-control-max-age").is_some());
}

#[tokio::test]
async fn a_preflight_from_another_origin_gets_no_allow_origin() {
    let reply = send(app_allowing(listed()), preflight(OTHER)).await;
    assert!(reply.headers.get("access-control-allow-origin").is_none());
}

#[tokio::test]
async fn responses_and_refusals_carry_cors_headers_for_allowed_origins() {
    let ok = send(
        app_allowing(listed()),
        get_from(ALLOWED, "/v1/models", Some("Bearer sk-test-key")),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK);
    assert_eq!(ok.headers["access-control-allow-origin"], ALLOWED);
    assert!(ok.headers["access-control-expose-headers"]
        .to_str()
        .unwrap()
        .contains("x-request-id"));

    let refused = send(
        app_allowing(listed()),
        get_from(ALLOWED, "/v1/models", None),
    )
    .await;
    refused.error(StatusCode::UNAUTHORIZED);
    assert_eq!(refused.headers["access-control-allow-origin"], ALLOWED);

    let not_found = send(
        app_allowing(listed()),
        get_from(ALLOWED, "/nope", Some("Bearer sk-test-key")),
    )
    .await;
    not_found.error(StatusCode::NOT_FOUND);
    assert_eq!(not_found.headers["access-control-allow-origin"], ALLOWED);
}

#[tokio::test]
async fn other_origins_get_no_cors_headers() {
    let reply = send(
        app_allowing(listed()),
        get_from(OTHER, "/v1/models", Some("Bearer sk-test-key")),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.headers.get("access-control-allow-origin").is_none());
}

#[tokio::test]
async fn wildcard_allows_any_origin() {
    let reply = send(app_allowing(AllowedOrigins::Any), preflight(OTHER)).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["access-control-allow-origin"], "*");
    let reply = send(
        app_allowing(AllowedOrigins::Any),
        get_from(OTHER, "/v1/models", None),
    )
    .await;
    reply.error(StatusCode::UNAUTHORIZED);
    assert_eq!(reply.headers["access-control-allow-origin"], "*");
}

#[tokio::test]
async fn disabled_by_default() {
    let reply = send(app(FakeService::hello()), preflight(ALLOWED)).await;
    assert!(reply.headers.get("access-control-allow-origin").is_none());
    let reply = send(
        app(FakeService::hello()),
        get_from(ALLOWED, "/v1/models", None),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply
        .headers
        .keys()
        .all(|name| !name.as_str().starts_with("access-control-")));
}

/// A cross-site "simple" request: a form-typed (or untyped) POST from a
/// page of `origin`, with no key (the server was started without one).
fn simple_post(origin: Option<&str>, uri: &str, content_type: Option<&str>) -> Request<Body> {
    let mut request = Request::post(uri);
    if let Some(origin) = origin {
        request = request.header("origin", origin);
    }
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    request
        .body(Body::from(hello_request().to_string()))
        .unwrap()
}

fn keyless(origins: AllowedOrigins) -> (std::sync::Arc<FakeService>, axum::Router) {
    let service = FakeService::hello();
    let app = app_with(
        service.clone(),
        HttpConfig {
            allowed_origins: origins,
            ..HttpConfig::default()
        },
    );
    (service, app)
}

#[tokio::test]
async fn cross_site_posts_from_origins_not_allowed_are_refused() {
    for origins in [AllowedOrigins::Disabled, listed()] {
        for content_type in [
            Some("application/x-www-form-urlencoded"),
            None,
            Some("application/json"),
        ] {
            for uri in ["/v1/chat/completions", "/v1/completions", "/v1/cache/reset"] {
                let (service, app) = keyless(origins.clone());
                let reply = send(app, simple_post(Some(OTHER), uri, content_type)).await;
                let error = reply.error(StatusCode::FORBIDDEN);
                assert_eq!(error["code"], "origin_not_allowed", "{uri}");
                assert!(error["message"].as_str().unwrap().contains(OTHER));
                assert_eq!(service.request_count(), 0, "{uri}: nothing ran");
            }
        }
        // `Origin: null` (sandboxed frames, file: pages) is not allowed either.
        let (_, app) = keyless(origins.clone());
        let reply = send(app, simple_post(Some("null"), "/v1/chat/completions", None)).await;
        reply.error(StatusCode::FORBIDDEN);
    }
}

#[tokio::test]
async fn allowed_origins_and_clients_without_an_origin_still_post() {
    // curl and SDKs send no Origin: any accepted Content-Type works.
    for content_type in [Some("application/x-www-form-urlencoded"), None] {
        let (service, app) = keyless(AllowedOrigins::Disabled);
        let reply = send(app, simple_post(None, "/v1/chat/completions", content_type)).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(service.request_count(), 1);
    }
    let (service, app) = keyless(listed());
    let reply = send(
        app,
        simple_post(Some(ALLOWED), "/v1/chat/completions", None),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["access-control-allow-origin"], ALLOWED);
    assert_eq!(service.request_count(), 1);
    let (_, app) = keyless(AllowedOrigins::Any);
    let reply = send(app, simple_post(Some(OTHER), "/v1/chat/completions", None)).await;
    assert_eq!(reply.status, StatusCode::OK);
}

#[tokio::test]
async fn reads_from_other_origins_are_not_refused() {
    // CORS keeps their answers from the page; the request itself is harmless.
    let (_, app) = keyless(AllowedOrigins::Disabled);
    let reply = send(app, get_from(OTHER, "/v1/models", None)).await;
    assert_eq!(reply.status, StatusCode::OK);
}
