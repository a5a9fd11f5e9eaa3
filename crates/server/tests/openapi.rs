//! `GET /openapi.json`: served as JSON, and every documented operation is
//! routed on the real router (the unit tests in `openapi.rs` compare the
//! document with the route table).

mod common;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use common::*;
use serde_json::Value;

#[tokio::test]
async fn served_as_json() {
    let reply = get(app(FakeService::hello()), "/openapi.json").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["content-type"], "application/json");
    let doc = reply.json();
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(reply.body, mlxcel_http::openapi::document_json().as_bytes());
}

/// Each documented operation, sent with a path filled in and a minimal
/// body, reaches a handler: not the 404 of an unknown path, not a 405.
#[tokio::test]
async fn every_documented_operation_is_routed() {
    let doc: Value = mlxcel_http::openapi::document().clone();
    let mut checked = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let Ok(http_method) = method.to_ascii_uppercase().parse::<Method>() else {
                continue;
            };
            // Model ids may hold a slash (a catch-all route); response ids
            // never do.
            let id = if path.starts_with("/v1/models") {
                MODEL
            } else {
                "resp_1"
            };
            let uri = path.replace("{id}", id);
            let mut request = Request::builder().method(http_method).uri(&uri);
            let body = if item[method].get("requestBody").is_some() {
                request = request.header("content-type", "application/json");
                Body::from(hello_request().to_string())
            } else {
                Body::empty()
            };
            let reply = send(app(FakeService::hello()), request.body(body).unwrap()).await;
            let unrouted = reply.status == StatusCode::NOT_FOUND
                && reply.json()["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("Invalid URL"));
            assert!(!unrouted, "{method} {path} is documented but not routed");
            assert_ne!(
                reply.status,
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, mlxcel_http::route_table().len());
}
