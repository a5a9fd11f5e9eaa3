//! Streamed chat completions: the SSE chunk sequence, failures and client
//! disconnects.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use http_body_util::BodyExt;
use mlxcel_engine_api::{FinishReason, GenerationEvent};
use serde_json::{json, Value};
use tower::ServiceExt;

fn stream_request(include_usage: Option<bool>) -> Value {
    let mut body = hello_request();
    body["stream"] = json!(true);
    if let Some(include_usage) = include_usage {
        body["stream_options"] = json!({ "include_usage": include_usage });
    }
    body
}

fn chat_request(body: &Value) -> Request<Body> {
    Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

/// Same id, created and model on every chunk; returns the id.
fn assert_same_identity(chunks: &[Value]) -> String {
    let id = chunks[0]["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("chatcmpl-"));
    for chunk in chunks {
        assert_eq!(chunk["id"], id.as_str());
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["created"], chunks[0]["created"]);
        assert_eq!(chunk["model"], MODEL);
    }
    id
}

#[tokio::test]
async fn streams_role_deltas_finish_and_done() {
    let reply = post_json(app(FakeService::hello()), stream_request(None)).await;
    let chunks = sse_json(&reply);
    assert_same_identity(&chunks);
    let choices: Vec<Value> = chunks.iter().map(|c| c["choices"].clone()).collect();
    assert_eq!(
        choices,
        [
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
            json!([{"index": 0, "delta": {"content": "Hel"}, "logprobs": null, "finish_reason": null}]),
            json!([{"index": 0, "delta": {"content": "lo"}, "logprobs": null, "finish_reason": null}]),
            json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"}]),
        ]
    );
    for chunk in &chunks {
        assert!(
            chunk.get("usage").is_none(),
            "usage without include_usage: {chunk}"
        );
    }
}

#[tokio::test]
async fn include_usage_adds_a_usage_chunk_before_done() {
    let fake = FakeService::new(hello_script(FinishReason::Length));
    let reply = post_json(app(fake), stream_request(Some(true))).await;
    let chunks = sse_json(&reply);
    assert_same_identity(&chunks);
    assert_eq!(chunks.len(), 5);
    let text: String = chunks[1..3]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    for chunk in &chunks[..4] {
        assert_eq!(chunk["usage"], json!(null), "{chunk}");
    }
    assert_eq!(chunks[4]["choices"], json!([]));
    assert_eq!(
        chunks[4]["usage"],
        json!({
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 2},
        })
    );
}

#[tokio::test]
async fn include_usage_false_sends_no_usage() {
    let reply = post_json(app(FakeService::hello()), stream_request(Some(false))).await;
    let chunks = sse_json(&reply);
    assert_eq!(chunks.len(), 4);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
}

#[tokio::test]
async fn streamed_sampling_parameters_reach_the_engine() {
    let fake = FakeService::hello();
    let mut body = stream_request(Some(true));
    body["temperature"] = json!(0.25);
    body["max_tokens"] = json!(9);
    post_json(app(fake.clone()), body).await;
    let request = fake.last_request();
    assert_eq!(request.sampling.temperature, 0.25);
    assert_eq!(request.max_tokens, 9);
}

#[tokio::test]
async fn failure_mid_stream_sends_an_error_event_and_ends() {
    let fake = FakeService::new(vec![
        delta("Hel"),
        GenerationEvent::Failed {
            kind: mlxcel_engine_api::FailureKind::Model,
            message: "forward failed".into(),
        },
        delta("never sent"),
    ]);
    let reply = post_json(app(fake), stream_request(Some(true))).await;
    assert_eq!(reply.status, StatusCode::OK);
    let data = sse_data(&reply.body);
    assert_eq!(data.len(), 3, "{data:?}");
    let second: Value = serde_json::from_str(&data[1]).unwrap();
    assert_eq!(second["choices"][0]["delta"]["content"], "Hel");
    let error: Value = serde_json::from_str(&data[2]).unwrap();
    assert_eq!(error["error"]["type"], "server_error");
    assert_eq!(error["error"]["param"], json!(null));
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("forward failed"));
}

#[tokio::test]
async fn an_engine_that_hangs_up_ends_the_stream_with_an_error() {
    let fake = FakeService::new(vec![delta("Hel")]);
    let reply = post_json(app(fake), stream_request(None)).await;
    let data = sse_data(&reply.body);
    assert_eq!(data.len(), 3, "{data:?}");
    let error: Value = serde_json::from_str(&data[2]).unwrap();
    assert_eq!(error["error"]["type"], "server_error");
}

#[tokio::test]
async fn refusals_before_the_stream_are_plain_error_responses() {
    let fake = FakeService::refusing(mlxcel_engine_api::SubmitError::Unavailable("gone".into()));
    let reply = post_json(app(fake), stream_request(None)).await;
    reply.error(StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn dropping_the_stream_body_drops_the_receiver() {
    let fake = FakeService::holding_open(vec![delta("Hel")]);
    let response = app(fake.clone())
        .oneshot(chat_request(&stream_request(None)))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    // The role chunk, then "Hel".
    for expected in ["\"role\":\"assistant\"", "\"content\":\"Hel\""] {
        let frame = body.frame().await.unwrap().unwrap();
        let bytes = frame.into_data().unwrap();
        let text = std::str::from_utf8(&bytes).unwrap();
        assert!(text.contains(expected), "{text}");
    }
    let sender = fake.senders.lock().unwrap()[0].clone();
    assert!(!sender.is_closed(), "the stream is still being read");

    drop(body); // the client disconnects
    assert!(
        closes_soon(&sender).await,
        "the receiver outlived the response body"
    );
}

/// Whether the engine's sender sees its receiver gone within a second (the
/// metrics wrapper between them drops it as soon as its task runs).
async fn closes_soon<T>(sender: &tokio::sync::mpsc::UnboundedSender<T>) -> bool {
    for _ in 0..100 {
        if sender.is_closed() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test]
async fn dropping_a_non_streamed_request_drops_the_receiver() {
    let fake = FakeService::holding_open(vec![delta("Hel")]);
    let pending = app(fake.clone()).oneshot(chat_request(&hello_request()));
    let timed_out = tokio::time::timeout(Duration::from_millis(50), pending).await;
    assert!(timed_out.is_err(), "the answer cannot be complete yet");
    let sender = fake.senders.lock().unwrap()[0].clone();
    assert!(
        closes_soon(&sender).await,
        "the receiver outlived the request"
    );
}

/// A delta carrying reasoning (a reasoning model's `<think>` block).
fn reasoning_delta(reasoning: &str, text: &str) -> GenerationEvent {
    GenerationEvent::Delta {
        index: 0,
        token: 1,
        text: text.to_owned(),
        reasoning: reasoning.to_owned(),
        logprobs: None,
    }
}

/// Reasoning streams as `reasoning_content` deltas before the answer; a
/// token that completes both sends both in one chunk; the whole reply
/// gathers each apart. With tools offered, a reply that reasons and then
/// calls a tool opens with `content: null`.
#[tokio::test]
async fn reasoning_streams_as_reasoning_content() {
    let script = vec![
        reasoning_delta("Two and ", ""),
        reasoning_delta("two.", "Four"),
        delta("."),
        finished(FinishReason::Stop),
    ];
    let reply = post_json(app(FakeService::new(script.clone())), stream_request(None)).await;
    let deltas: Vec<Value> = sse_json(&reply)
        .iter()
        .map(|c| c["choices"][0]["delta"].clone())
        .collect();
    assert_eq!(
        deltas,
        [
            json!({"role": "assistant", "content": ""}),
            json!({"reasoning_content": "Two and "}),
            json!({"content": "Four", "reasoning_content": "two."}),
            json!({"content": "."}),
            json!({}),
        ]
    );
    let whole = post_json(app(FakeService::new(script)), hello_request()).await;
    let message = &whole.json()["choices"][0]["message"];
    assert_eq!(message["content"], "Four.");
    assert_eq!(message["reasoning_content"], "Two and two.");

    let mut body = stream_request(None);
    body["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
    let script = vec![
        reasoning_delta("Call f.", ""),
        tool_call_at(0, "call_1", "f"),
        tool_args_at(0, "{}"),
        finished(FinishReason::ToolCalls),
    ];
    let reply = post_json(app(FakeService::new(script.clone())), body.clone()).await;
    let first = &sse_json(&reply)[0]["choices"][0]["delta"];
    assert_eq!(
        first,
        &json!({"role": "assistant", "content": null, "reasoning_content": "Call f."})
    );
    body["stream"] = json!(false);
    let whole = post_json(app(FakeService::new(script)), body).await;
    let message = &whole.json()["choices"][0]["message"];
    assert_eq!(message["content"], Value::Null);
    assert_eq!(message["reasoning_content"], "Call f.");
    assert_eq!(message["tool_calls"][0]["function"]["name"], "f");
}
