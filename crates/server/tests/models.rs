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
            "data": [{"id": MODEL, "object": "model", "created": created, "owned_by": "mlxcel",
                      "max_model_len": 4096}],
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
    assert_eq!(body["max_model_len"], 4096);
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

/// A server whose engine is still loading answers `/health` with 503
/// `starting` (load balancers keep it out of rotation), then 200 `ok`
/// once the engine is in the slot.
#[tokio::test]
async fn health_is_503_starting_until_the_engine_is_ready() {
    use mlxcel_engine_api::{InferenceService, ServiceSlot};
    use std::sync::Arc;
    let slot = Arc::new(ServiceSlot::new(MODEL.to_owned(), 4096));
    let app = mlxcel_http::router(mlxcel_http::AppState::new(
        Arc::clone(&slot) as Arc<dyn InferenceService>
    ));
    let reply = get(app.clone(), "/health").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.json(), json!({"status": "starting"}));
    // The card is known before the model is loaded.
    let models = get(app.clone(), "/v1/models").await.json();
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    slot.fill(FakeService::hello());
    let reply = get(app, "/health").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json(), json!({"status": "ok"}));
}
