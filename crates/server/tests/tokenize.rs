//! `POST /tokenize` and `POST /detokenize` against the fake engine (one
//! token per character; chat: `role: content` lines, then 3 tokens of
//! generation prompt).

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};

async fn post(uri: &str, body: Value) -> Reply {
    post_raw_to(
        app(FakeService::hello()),
        uri,
        Some("application/json"),
        body.to_string(),
    )
    .await
}

#[tokio::test]
async fn text_and_chat_prompts_are_counted() {
    let body = post("/tokenize", json!({"model": MODEL, "prompt": "ab"}))
        .await
        .json();
    assert_eq!(
        body,
        json!({"count": 2, "max_model_len": 4096, "tokens": [97, 98], "token_strs": null})
    );
    let chat = json!({"messages": [{"role": "user", "content": "a"}]});
    let body = post("/tokenize", chat.clone()).await.json();
    // "user: a\n" then the generation prompt.
    assert_eq!(body["count"], 11);
    assert_eq!(
        &body["tokens"].as_array().unwrap()[8..],
        &[json!(1), json!(2), json!(3)]
    );
    let mut without = chat;
    without["add_generation_prompt"] = json!(false);
    assert_eq!(post("/tokenize", without).await.json()["count"], 8);
}

#[tokio::test]
async fn bad_tokenize_requests_name_the_param() {
    for (body, param) in [
        (json!({}), "prompt"),
        (
            json!({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}),
            "prompt",
        ),
        (
            json!({"prompt": "a", "add_generation_prompt": true}),
            "add_generation_prompt",
        ),
        (
            json!({"prompt": "a", "return_token_strs": true}),
            "return_token_strs",
        ),
        (
            json!({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": true}),
            "add_special_tokens",
        ),
        (
            json!({"messages": [{"role": "robot", "content": "a"}]}),
            "messages[0].role",
        ),
        (json!({"prompt": "a", "x": 1}), "x"),
    ] {
        let error = post("/tokenize", body.clone())
            .await
            .error(StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], param, "{body}");
    }
    let error = post("/tokenize", json!({"model": "other", "prompt": "a"}))
        .await
        .error(StatusCode::NOT_FOUND);
    assert_eq!(error["code"], "model_not_found");
}

#[tokio::test]
async fn token_ids_are_decoded() {
    let body = post("/detokenize", json!({"tokens": [1, 22]})).await.json();
    assert_eq!(body, json!({"prompt": "t1t22"}));
    let error = post("/detokenize", json!({"tokens": [1, 5000]}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], "tokens");
    let error = post("/detokenize", json!({"tokens": [-1]}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], "tokens[0]");
}
