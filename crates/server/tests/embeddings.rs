//! `POST /v1/embeddings` against the fake engine: the answer's shape and
//! order, base64 (little-endian float32), `dimensions` (truncated, unit
//! length again), usage, what reaches the engine, and the refusals, each
//! naming its field.

mod common;

use axum::http::StatusCode;
use common::*;
use mlxcel_engine_api::Prompt;
use serde_json::{json, Value};

async fn embed(fake: std::sync::Arc<FakeService>, body: Value) -> Reply {
    post_raw_to(
        app(fake),
        "/v1/embeddings",
        Some("application/json"),
        body.to_string(),
    )
    .await
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Decodes standard base64 (test-side, independent of the server's
/// encoder).
fn unbase64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let bytes: Vec<u8> = text.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &c)| n | u32::from(value(c)) << (18 - 6 * i));
        out.extend(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

#[tokio::test]
async fn each_input_gets_its_vector_in_order_with_usage() {
    let fake = FakeService::embedding(8);
    let reply = embed(
        fake.clone(),
        json!({"model": MODEL, "input": ["abc", "hello"], "user": "u1"}),
    )
    .await;
    let v = reply.json();
    assert_eq!(reply.status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["usage"], json!({"prompt_tokens": 8, "total_tokens": 8}));
    for (i, k) in [3usize, 5].into_iter().enumerate() {
        assert_eq!(v["data"][i]["object"], "embedding");
        assert_eq!(v["data"][i]["index"], i);
        assert_eq!(
            floats(&v["data"][i]["embedding"]),
            FakeService::fake_vector(k, 8)
        );
    }
    let asked = fake.embeds.lock().unwrap().clone();
    assert_eq!(asked.len(), 2);
    assert_eq!(asked[1].prompt, Prompt::Text("hello".into()));
    assert!(asked[1].cache_prompt);
    // Token ids, one list or several.
    let v = embed(fake.clone(), json!({"input": [[1, 2], [3, 4, 5, 6]]}))
        .await
        .json();
    assert_eq!(v["usage"]["prompt_tokens"], 6);
    assert_eq!(
        floats(&v["data"][1]["embedding"]),
        FakeService::fake_vector(4, 8)
    );
    let v = embed(fake.clone(), json!({"input": [7, 8, 9]}))
        .await
        .json();
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    assert_eq!(
        fake.embeds.lock().unwrap().last().unwrap().prompt,
        Prompt::Tokens(vec![7, 8, 9])
    );
}

#[tokio::test]
async fn base64_is_the_little_endian_float32_bytes_and_dimensions_renormalise() {
    let fake = FakeService::embedding(8);
    let v = embed(
        fake.clone(),
        json!({"input": "abcd", "encoding_format": "base64"}),
    )
    .await
    .json();
    let bytes = unbase64(v["data"][0]["embedding"].as_str().unwrap());
    let decoded: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(decoded, FakeService::fake_vector(4, 8));
    let v = embed(fake.clone(), json!({"input": "abcd", "dimensions": 3}))
        .await
        .json();
    let got = floats(&v["data"][0]["embedding"]);
    let full = FakeService::fake_vector(4, 8);
    let norm = full[..3].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert_eq!(got.len(), 3);
    for (g, f) in got.iter().zip(&full[..3]) {
        assert!((g - f / norm).abs() < 1e-6, "{got:?}");
    }
    // The whole length is allowed; one more is not.
    let ok = embed(fake.clone(), json!({"input": "a", "dimensions": 8})).await;
    assert_eq!(ok.status, StatusCode::OK);
    let r = embed(fake.clone(), json!({"input": "a", "dimensions": 9})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["param"], "dimensions");
}

#[tokio::test]
async fn bad_requests_are_refused_naming_the_field() {
    let fake = FakeService::embedding(8);
    for (body, param) in [
        (json!({}), "input"),
        (json!({"input": ""}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": ["a", ""]}), "input[1]"),
        (json!({"input": [[1], []]}), "input[1]"),
        (json!({"input": [-3]}), "input[0]"),
        (json!({"input": {"text": "a"}}), "input"),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": "a", "dimensions": 0}), "dimensions"),
        (json!({"input": "a", "dimensions": "4"}), "dimensions"),
        (json!({"input": "a", "pooling": "cls"}), "pooling"),
        // The engine's refusals, named as this route names the prompt.
        (json!({"input": [5000]}), "input"),
        (json!({"input": [[1], [5000]]}), "input[1]"),
    ] {
        let r = embed(fake.clone(), body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.json());
        assert_eq!(r.json()["error"]["param"], param, "{body}");
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }
    let long = "x".repeat(5000);
    let r = embed(fake.clone(), json!({"input": ["a", long]})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    assert_eq!(r.json()["error"]["param"], "input[1]");
    let r = embed(fake.clone(), json!({"input": "a", "model": "other"})).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let many = vec!["a"; 2049];
    let r = embed(fake.clone(), json!({"input": many})).await;
    assert_eq!(r.json()["error"]["param"], "input");
    // A model that serves no embeddings says how to get them.
    let r = embed(FakeService::hello(), json!({"input": "a"})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["param"], "model");
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("--embeddings"), "{message}");
}

#[tokio::test]
async fn while_the_model_loads_the_answer_is_503() {
    let slot = mlxcel_engine_api::ServiceSlot::new(MODEL.into(), 4096);
    let app = mlxcel_http::router(mlxcel_http::AppState::new(std::sync::Arc::new(slot)));
    let request = axum::http::Request::post("/v1/embeddings")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(json!({"input": "a"}).to_string()))
        .unwrap();
    let r = send(app, request).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.json());
}
