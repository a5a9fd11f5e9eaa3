//! `/v1/models` and `/health`.

mod common;

use axum::http::StatusCode;
use common::*;
use mlxcel_http::openai::unix_now;
use serde_json::json;

#[tokio::test]
async fn lists_the_served_model() {
    let reply = get(app(FakeService::hello()), "/v1/models").await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    let created = body["data"][0]["created"].as_u64().unwrap();
    assert!(created <= unix_now() && created + 60 > unix_now());
    assert_eq!(
        body,
        json!({
            "object": "list",
            "data": [{"id": MODEL, "object": "model", "created": created, "owned_by": "mlxcel"}],
        })
    );
}

#[tokio::test]
async fn retrieves_the_served_model_even_with_a_slash_in_its_name() {
    let reply = get(app(FakeService::hello()), "/v1/models/org/test-model").await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    assert_eq!(body["id"], MODEL);
    assert_eq!(body["object"], "model");
    assert_eq!(body["owned_by"], "mlxcel");
}

#[tokio::test]
async fn other_models_are_a_404() {
    let reply = get(app(FakeService::hello()), "/v1/models/gpt-4o").await;
    let error = reply.error(StatusCode::NOT_FOUND);
    assert_eq!(error["code"], "model_not_found");
    assert_eq!(error["param"], "model");
}

#[tokio::test]
async fn health_is_ok() {
    let reply = get(app(FakeService::hello()), "/health").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json(), json!({"status": "ok"}));
}
