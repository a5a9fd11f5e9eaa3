//! `--api-key`: every route but `GET /health` needs the bearer key, and every
//! refusal is the same bytes, whatever was wrong and whatever the path.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use mlxcel_http::HttpConfig;

const KEY: &str = "sk-test-key";

fn keyed() -> axum::Router {
    app_with(
        FakeService::hello(),
        HttpConfig {
            api_key: Some(KEY.to_owned()),
            ..HttpConfig::default()
        },
    )
}

fn request(method: &str, uri: &str, authorization: Option<&str>) -> Request<Body> {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    if method == "POST" {
        request = request.header("content-type", "application/json");
        return request
            .body(Body::from(hello_request().to_string()))
            .unwrap();
    }
    request.body(Body::empty()).unwrap()
}

const ROUTES: &[(&str, &str)] = &[
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/org/test-model"),
    ("GET", "/v1/cache/stats"),
    ("POST", "/v1/cache/reset"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
];

#[tokio::test]
async fn every_route_but_health_needs_the_key() {
    for (method, uri) in ROUTES {
        let refused = send(keyed(), request(method, uri, None)).await;
        assert_eq!(refused.status, StatusCode::UNAUTHORIZED, "{method} {uri}");
        let allowed = send(keyed(), request(method, uri, Some("Bearer sk-test-key"))).await;
        assert_eq!(allowed.status, StatusCode::OK, "{method} {uri}");
    }
    let health = send(keyed(), request("GET", "/health", None)).await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.json(), serde_json::json!({"status": "ok"}));
}

#[tokio::test]
async fn missing_malformed_and_wrong_keys_get_the_same_bytes() {
    let cases = [
        None,
        Some(""),
        Some("sk-test-key"),
        Some("Basic sk-test-key"),
        Some("Bearer"),
        Some("Bearer "),
        Some("Bearer sk-test-ke"),
        Some("Bearer sk-test-key-and-more"),
        Some("Bearer wrong"),
    ];
    let first = send(keyed(), request("GET", "/v1/models", None)).await;
    let error = first.error(StatusCode::UNAUTHORIZED);
    assert_eq!(
        error,
        serde_json::json!({
            "message": "Incorrect API key provided.",
            "type": "invalid_request_error",
            "param": null,
            "code": "invalid_api_key",
        })
    );
    assert_eq!(first.headers["www-authenticate"], "Bearer");
    for authorization in cases {
        for (method, uri) in ROUTES.iter().chain(&[
            ("GET", "/no/such/route"),
            ("DELETE", "/v1/models"),
            ("POST", "/health"),
        ]) {
            let reply = send(keyed(), request(method, uri, authorization)).await;
            assert_eq!(
                reply.status,
                StatusCode::UNAUTHORIZED,
                "{method} {uri} {authorization:?}"
            );
            assert_eq!(reply.body, first.body, "{method} {uri} {authorization:?}");
            assert_eq!(reply.headers["www-authenticate"], "Bearer");
            assert_eq!(reply.headers["content-type"], "application/json");
        }
    }
}

#[tokio::test]
async fn a_refused_request_never_reaches_the_engine() {
    let fake = FakeService::hello();
    let app = app_with(
        fake.clone(),
        HttpConfig {
            api_key: Some(KEY.to_owned()),
            ..HttpConfig::default()
        },
    );
    let reply = send(
        app,
        request("POST", "/v1/chat/completions", Some("Bearer x")),
    )
    .await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        fake.request_count(),
        0,
        "a refused request never reaches the engine"
    );
}

#[tokio::test]
async fn with_the_key_unknown_paths_are_404_again() {
    let reply = send(keyed(), request("GET", "/nope", Some("Bearer sk-test-key"))).await;
    reply.error(StatusCode::NOT_FOUND);
    let reply = send(
        keyed(),
        request("DELETE", "/v1/models", Some("bearer sk-test-key")),
    )
    .await;
    reply.error(StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn without_a_key_configured_nothing_is_checked() {
    let reply = send(
        app(FakeService::hello()),
        request("GET", "/v1/models", Some("Bearer whatever")),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let reply = send(
        app(FakeService::hello()),
        request("GET", "/v1/models", None),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.headers.get("www-authenticate").is_none());
}

#[tokio::test]
async fn refusals_are_counted_in_metrics() {
    let app = keyed();
    send(app.clone(), request("GET", "/v1/models", None)).await;
    let metrics = send(app, request("GET", "/metrics", Some("Bearer sk-test-key"))).await;
    let text = String::from_utf8(metrics.body.to_vec()).unwrap();
    assert!(
        text.lines()
            .any(|line| line.starts_with("mlxcel_http_requests_total")
                && line.contains("/v1/models")
                && line.contains("401")),
        "{text}"
    );
}

#[test]
fn debug_never_shows_the_key() {
    let config = HttpConfig {
        api_key: Some(KEY.to_owned()),
        ..HttpConfig::default()
    };
    let shown = format!("{config:?}");
    assert!(!shown.contains(KEY), "{shown}");
    assert!(shown.contains("<redacted>"), "{shown}");
}
