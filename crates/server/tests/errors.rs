//! Every way a request can be refused: status, OpenAI error body, `param`.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use mlxcel_http::HttpConfig;
use serde_json::{json, Value};

/// Posts `body` and checks a 400 `invalid_request_error` naming `param`.
async fn assert_rejected(body: Value, param: &str) -> Value {
    let fake = FakeService::hello();
    let reply = post_json(app(fake.clone()), body.clone()).await;
    let error = reply.error(StatusCode::BAD_REQUEST);
    assert_eq!(error["type"], "invalid_request_error", "{body}");
    assert_eq!(error["param"], param, "{body} -> {error}");
    assert_eq!(fake.request_count(), 0, "{body} reached the engine");
    error
}

/// A valid request with `field` set to `value`.
fn with(field: &str, value: Value) -> Value {
    let mut body = hello_request();
    body[field] = value;
    body
}

fn message(message: Value) -> Value {
    json!({ "messages": [message] })
}

#[tokio::test]
async fn malformed_json_is_a_400() {
    let reply = post_raw(
        app(FakeService::hello()),
        Some("application/json"),
        "{\"messages\": [",
    )
    .await;
    let error = reply.error(StatusCode::BAD_REQUEST);
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["param"], json!(null));
    assert!(error["message"]
        .as_str()
        .unwrap()
        .contains("parse the JSON body"));
}

#[tokio::test]
async fn a_body_that_is_not_an_object_is_a_400() {
    let reply = post_json(app(FakeService::hello()), json!([1, 2])).await;
    let error = reply.error(StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], json!(null));
}

#[tokio::test]
async fn missing_or_empty_messages() {
    let error = assert_rejected(json!({"model": MODEL}), "messages").await;
    assert!(error["message"].as_str().unwrap().contains("Missing"));
    assert_rejected(json!({"messages": null}), "messages").await;
    assert_rejected(json!({"messages": []}), "messages").await;
}

#[tokio::test]
async fn wrong_json_types_name_the_field() {
    let cases = [
        (json!({"messages": "Hi"}), "messages"),
        (json!({"messages": ["Hi"]}), "messages[0]"),
        (
            message(json!({"role": 1, "content": "Hi"})),
            "messages[0].role",
        ),
        (
            message(json!({"role": "user", "content": 5})),
            "messages[0].content",
        ),
        (
            message(json!({"role": "user", "content": [{"type": "text", "text": 3}]})),
            "messages[0].content[0].text",
        ),
        (with("model", json!(7)), "model"),
        (with("temperature", json!("hot")), "temperature"),
        (with("top_p", json!(true)), "top_p"),
        (with("top_k", json!(1.5)), "top_k"),
        (with("min_p", json!([0.1])), "min_p"),
        (with("seed", json!("42")), "seed"),
        (with("max_tokens", json!(1.5)), "max_tokens"),
        (
            with("max_completion_tokens", json!("8")),
            "max_completion_tokens",
        ),
        (with("stream", json!("yes")), "stream"),
        (with("n", json!("1")), "n"),
        (with("user", json!(12)), "user"),
    ];
    for (body, param) in cases {
        let error = assert_rejected(body, param).await;
        assert!(
            error["message"].as_str().unwrap().contains("Invalid type"),
            "{error}"
        );
    }
}

#[tokio::test]
async fn out_of_range_values_name_the_field() {
    let cases = [
        (with("max_tokens", json!(0)), "max_tokens"),
        (with("max_tokens", json!(-5)), "max_tokens"),
        (
            with("max_completion_tokens", json!(0)),
            "max_completion_tokens",
        ),
        (with("temperature", json!(2.01)), "temperature"),
        (with("temperature", json!(-0.1)), "temperature"),
        (with("top_p", json!(0)), "top_p"),
        (with("top_p", json!(1.1)), "top_p"),
        (with("top_k", json!(-1)), "top_k"),
        (with("min_p", json!(-0.1)), "min_p"),
        (with("min_p", json!(1.5)), "min_p"),
        (with("n", json!(17)), "n"),
        (with("n", json!(0)), "n"),
    ];
    for (body, param) in cases {
        assert_rejected(body, param).await;
    }
}

#[tokio::test]
async fn conflicting_token_limits_are_refused() {
    let mut body = with("max_tokens", json!(10));
    body["max_completion_tokens"] = json!(20);
    assert_rejected(body, "max_tokens").await;
}

#[tokio::test]
async fn unsupported_openai_fields_with_real_values_are_refused() {
    let cases = [
        ("audio", json!({"voice": "alloy", "format": "mp3"})),
        ("modalities", json!(["text", "audio"])),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("safety_identifier", json!("user-hash")),
        ("verbosity", json!("high")),
        ("service_tier", json!("flex")),
        ("reasoning_effort", json!("high")),
        ("web_search_options", json!({"search_context_size": "low"})),
        ("functions", json!([{"name": "f"}])),
        ("function_call", json!("auto")),
    ];
    for (field, value) in cases {
        let error = assert_rejected(with(field, value), field).await;
        assert_eq!(error["code"], "unsupported_parameter");
    }
}

#[tokio::test]
async fn unknown_fields_are_refused() {
    let error = assert_rejected(with("best_of", json!(1)), "best_of").await;
    assert_eq!(error["code"], "unrecognized_parameter");
    assert_rejected(
        message(json!({"role": "user", "content": "Hi", "nickname": "bob"})),
        "messages[0].nickname",
    )
    .await;
    assert_rejected(
        message(json!({"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]})),
        "messages[0].content[0].x",
    )
    .await;
}

#[tokio::test]
async fn message_rules() {
    assert_rejected(message(json!({"content": "Hi"})), "messages[0].role").await;
    assert_rejected(
        message(json!({"role": "function", "content": "Hi"})),
        "messages[0].role",
    )
    .await;
    assert_rejected(message(json!({"role": "user"})), "messages[0].content").await;
    assert_rejected(
        message(
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        ),
        "messages[0].content[0].type",
    )
    .await;
    assert_rejected(
        message(json!({"role": "user", "content": [{"type": "text"}]})),
        "messages[0].content[0].text",
    )
    .await;
    let body = json!({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "robot", "content": "Hi"},
    ]});
    assert_rejected(body, "messages[1].role").await;
}

#[tokio::test]
async fn stream_options_rules() {
    let body = with("stream_options", json!({"include_usage": true}));
    assert_rejected(body, "stream_options").await;
    let mut body = with("stream", json!(true));
    body["stream_options"] = json!({"include_usage": "yes"});
    assert_rejected(body.clone(), "stream_options.include_usage").await;
    body["stream_options"] = json!({"continuous_usage": true});
    assert_rejected(body.clone(), "stream_options.continuous_usage").await;
    body["stream_options"] = json!(true);
    assert_rejected(body, "stream_options").await;
}

#[tokio::test]
async fn unknown_model_is_a_404_model_not_found() {
    let fake = FakeService::hello();
    let reply = post_json(app(fake.clone()), with("model", json!("gpt-4o"))).await;
    let error = reply.error(StatusCode::NOT_FOUND);
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["code"], "model_not_found");
    assert_eq!(error["param"], "model");
    assert!(error["message"].as_str().unwrap().contains("gpt-4o"));
    assert_eq!(fake.request_count(), 0);
}

#[tokio::test]
async fn non_json_content_type_is_a_415_but_missing_or_form_is_read_as_json() {
    let body = hello_request().to_string();
    let reply = post_raw(app(FakeService::hello()), Some("text/plain"), body.clone()).await;
    reply.error(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let reply = post_raw(
        app(FakeService::hello()),
        Some("multipart/form-data"),
        body.clone(),
    )
    .await;
    reply.error(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let reply = post_raw(app(FakeService::hello()), None, body.clone()).await;
    assert_eq!(reply.status, StatusCode::OK);
    let reply = post_raw(
        app(FakeService::hello()),
        Some("application/x-www-form-urlencoded"),
        body.clone(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let reply = post_raw(app(FakeService::hello()), None, "{oops").await;
    reply.error(StatusCode::BAD_REQUEST);
    let reply = post_raw(
        app(FakeService::hello()),
        Some("application/json; charset=utf-8"),
        body,
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
}

#[tokio::test]
async fn oversized_body_is_a_413() {
    let config = HttpConfig {
        body_limit_bytes: 1024,
        ..HttpConfig::default()
    };
    let big = "x".repeat(2000);
    let body = json!({"messages": [{"role": "user", "content": big}]});
    let reply = post_json(app_with(FakeService::hello(), config.clone()), body).await;
    let error = reply.error(StatusCode::PAYLOAD_TOO_LARGE);
    assert!(error["message"].as_str().unwrap().contains("1024"));
    // Just under the limit is fine.
    let body = json!({"messages": [{"role": "user", "content": "x".repeat(900)}]});
    let reply = post_json(app_with(FakeService::hello(), config), body).await;
    assert_eq!(reply.status, StatusCode::OK);
}

#[tokio::test]
async fn unknown_route_is_a_404_with_the_openai_body() {
    let reply = get(app(FakeService::hello()), "/v1/completions-nope").await;
    let error = reply.error(StatusCode::NOT_FOUND);
    assert_eq!(error["message"], "Invalid URL (GET /v1/completions-nope)");
    assert_eq!(error["type"], "invalid_request_error");
}

#[tokio::test]
async fn wrong_method_is_a_405_with_the_openai_body() {
    let reply = get(app(FakeService::hello()), "/v1/chat/completions").await;
    reply.error(StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(reply.headers["allow"], "POST");

    let request = Request::delete("/v1/models").body(Body::empty()).unwrap();
    let reply = send(app(FakeService::hello()), request).await;
    reply.error(StatusCode::METHOD_NOT_ALLOWED);
}

fn encoded_post(encoding: &str, body: Vec<u8>) -> Request<Body> {
    Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("content-encoding", encoding)
        .body(Body::from(body))
        .unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

#[tokio::test]
async fn gzip_bodies_are_decoded_and_other_encodings_are_a_415() {
    let body = hello_request().to_string();
    let fake = FakeService::hello();
    let reply = send(
        app(fake.clone()),
        encoded_post("gzip", gzip(body.as_bytes())),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(fake.request_count(), 1);
    assert_eq!(reply.json()["choices"][0]["message"]["content"], "Hello");

    for encoding in ["br", "deflate", "zstd", "gzip, br"] {
        let fake = FakeService::hello();
        let reply = send(
            app(fake.clone()),
            encoded_post(encoding, body.clone().into_bytes()),
        )
        .await;
        let error = reply.error(StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(error["code"], "unsupported_content_encoding", "{encoding}");
        assert_eq!(fake.request_count(), 0);
    }

    // A body that is not gzip under `Content-Encoding: gzip` is a 400.
    let reply = send(
        app(FakeService::hello()),
        encoded_post("gzip", body.clone().into_bytes()),
    )
    .await;
    reply.error(StatusCode::BAD_REQUEST);

    // The body limit applies to the decoded body (a small gzip bomb).
    let config = HttpConfig {
        body_limit_bytes: 64 * 1024,
        ..HttpConfig::default()
    };
    let big = vec![b' '; 1 << 20];
    let reply = send(
        app_with(FakeService::hello(), config),
        encoded_post("gzip", gzip(&big)),
    )
    .await;
    reply.error(StatusCode::PAYLOAD_TOO_LARGE);
}

/// OpenAI routes under `/v1/responses/` that this server does not serve
/// are unknown routes (404), not a wrong method on `/v1/responses/{id}`;
/// a response's own path with a wrong method stays a 405.
#[tokio::test]
async fn unserved_responses_routes_are_404_not_405() {
    for path in ["/v1/responses/input_tokens", "/v1/responses/compact"] {
        let reply = post_raw_to(
            app(FakeService::hello()),
            path,
            Some("application/json"),
            "{}",
        )
        .await;
        let error = reply.error(StatusCode::NOT_FOUND);
        assert_eq!(error["message"], format!("Invalid URL (POST {path})"));
    }
    let reply = post_raw_to(
        app(FakeService::hello()),
        "/v1/responses/resp_0123",
        Some("application/json"),
        "{}",
    )
    .await;
    reply.error(StatusCode::METHOD_NOT_ALLOWED);
}
