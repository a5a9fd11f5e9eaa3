//! `POST /infill` and completions' `suffix` against the fake engine: what
//! reaches the engine (an infill prompt with its parts and the sampling
//! read under llama-server's names), the answer's and the stream's shapes,
//! and the refusals, each naming its field.

mod common;

use axum::http::StatusCode;
use common::*;
use mlxcel_engine_api::{FinishReason, Infill, InfillFile, Prompt, RequestField, SubmitError};
use serde_json::json;

#[tokio::test]
async fn an_infill_reaches_the_engine_with_its_parts_and_sampling() {
    let fake = FakeService::hello();
    let body = json!({
        "input_prefix": "def f(", "input_suffix": "):\n", "prompt": "x",
        "input_extra": [{"filename": "a.py", "text": "A = 1\n"}],
        "n_predict": 7, "temperature": 0.5, "top_k": 3, "repeat_penalty": 1.1,
        "stop": ["\n\n"], "cache_prompt": false,
        // llama-server options mlxcel does not read: ignored.
        "samplers": ["top_k"], "t_max_predict_ms": 250, "id_slot": -1,
    });
    let reply = post_raw_to(
        app(fake.clone()),
        "/infill",
        Some("application/json"),
        body.to_string(),
    )
    .await;
    let v = reply.json();
    assert_eq!(reply.status, StatusCode::OK, "{v}");
    assert_eq!(v["content"], "Hello");
    assert_eq!(v["stop"], true);
    assert_eq!(v["stop_type"], "eos");
    assert_eq!(v["model"], MODEL);
    let r = fake.last_request();
    assert_eq!(
        r.prompt,
        Prompt::Infill(Infill {
            prefix: "def f(".into(),
            suffix: "):\n".into(),
            extra: vec![InfillFile {
                filename: "a.py".into(),
                text: "A = 1\n".into()
            }],
            middle: "x".into(),
        })
    );
    assert_eq!(r.max_tokens, 7);
    assert_eq!(r.sampling.temperature, 0.5);
    assert_eq!(r.sampling.top_k, 3);
    assert!((r.sampling.repetition_penalty - 1.1).abs() < 1e-6);
    assert_eq!(r.stop, vec!["\n\n".to_string()]);
    assert!(!r.cache_prompt);
}

#[tokio::test]
async fn an_infill_streams_content_events_then_the_counts() {
    let fake = FakeService::new(hello_script(FinishReason::Length));
    let body = json!({"input_prefix": "a", "input_suffix": "b", "stream": true, "n_predict": -1});
    let reply = post_raw_to(
        app(fake.clone()),
        "/infill",
        Some("application/json"),
        body.to_string(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let events: Vec<serde_json::Value> = sse_data(&reply.body)
        .iter()
        .map(|d| serde_json::from_str(d).expect("JSON event"))
        .collect();
    let (last, content) = events.split_last().expect("events");
    let text: String = content
        .iter()
        .filter_map(|e| e["content"].as_str())
        .collect();
    assert_eq!(text, "Hello");
    assert!(content
        .iter()
        .all(|e| e["stop"] == false && e.get("stop_type").is_none()));
    assert_eq!(last["stop"], true);
    assert_eq!(last["content"], "");
    assert_eq!(last["stop_type"], "limit");
    assert!(last["tokens_predicted"].is_u64(), "{last}");
    // n_predict -1: the server's default budget.
    assert!(fake.last_request().max_tokens > 16);
}

#[tokio::test]
async fn n_predict_0_reads_the_prompt_and_returns_no_text() {
    for stream in [false, true] {
        let fake = FakeService::hello();
        let body = json!({"input_extra": [{"filename": "a", "text": "b"}], "n_predict": 0,
                          "stream": stream});
        let reply = post_raw_to(
            app(fake.clone()),
            "/infill",
            Some("application/json"),
            body.to_string(),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
        let last: serde_json::Value = if stream {
            let events = sse_data(&reply.body);
            assert_eq!(events.len(), 1, "no content events: {events:?}");
            serde_json::from_str(&events[0]).expect("JSON")
        } else {
            reply.json()
        };
        assert_eq!(last["content"], "", "{last}");
        assert_eq!(last["tokens_predicted"], 0);
        assert_eq!(last["stop_type"], "limit");
        assert_eq!(fake.last_request().max_tokens, 1);
    }
}

#[tokio::test]
async fn a_suffix_makes_each_completion_prompt_an_infill() {
    let fake = FakeService::hello();
    let body = json!({"prompt": ["p1", "p2"], "suffix": "s", "max_tokens": 3});
    let reply = post_completion(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.json());
    assert_eq!(
        fake.last_request().prompt,
        Prompt::Infill(Infill {
            prefix: "p2".into(),
            suffix: "s".into(),
            ..Infill::default()
        })
    );
}

#[tokio::test]
async fn bad_infills_are_refused_naming_the_field() {
    let cases = [
        (json!({"input_prefix": 3}), "input_prefix"),
        (json!({"input_suffix": ["x"]}), "input_suffix"),
        (json!({"input_extra": {"a": 1}}), "input_extra"),
        (json!({"input_extra": ["x"]}), "input_extra[0]"),
        (json!({"input_extra": [{"text": 1}]}), "input_extra[0].text"),
        (json!({"n_predict": -2}), "n_predict"),
        (json!({"n_predict": null, "max_tokens": -5}), "max_tokens"),
        (json!({"n_predict": "5"}), "n_predict"),
        (json!({"temperature": 9}), "temperature"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"stream": "yes"}), "stream"),
    ];
    for (body, param) in cases {
        let fake = FakeService::hello();
        let reply = post_raw_to(
            app(fake.clone()),
            "/infill",
            Some("application/json"),
            body.to_string(),
        )
        .await;
        let error = reply.error(StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], param, "{body}: {error}");
        assert_eq!(fake.request_count(), 0, "{body}");
    }
    // Another model's name is a 404, as on every route.
    let reply = post_raw_to(
        app(FakeService::hello()),
        "/infill",
        Some("application/json"),
        json!({"model": "other"}).to_string(),
    )
    .await;
    reply.error(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_model_without_fim_tokens_is_a_400_on_the_suffix() {
    let refusal = SubmitError::InvalidRequest {
        message: "this model has no fill-in-the-middle tokens".into(),
        field: Some(RequestField::Suffix),
    };
    let reply = post_raw_to(
        app(FakeService::refusing(refusal.clone())),
        "/infill",
        Some("application/json"),
        json!({"input_prefix": "a"}).to_string(),
    )
    .await;
    assert_eq!(
        reply.error(StatusCode::BAD_REQUEST)["param"],
        "input_suffix"
    );
    let reply = post_completion(
        app(FakeService::refusing(refusal)),
        json!({"prompt": "a", "suffix": "b"}),
    )
    .await;
    assert_eq!(reply.error(StatusCode::BAD_REQUEST)["param"], "suffix");
}
