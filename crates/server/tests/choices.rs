//! Chat answers with several choices, logprobs and tool calls, streamed and
//! not, against scripted engine events.

mod common;

use axum::http::StatusCode;
use common::*;
use mlxcel_engine_api::{FinishReason, GenerationEvent, Usage};
use serde_json::{json, Value};

fn usage(completion_tokens: usize) -> Usage {
    Usage {
        prompt_tokens: 7,
        completion_tokens,
        cached_tokens: 2,
    }
}

/// Two choices whose events interleave; choice 1 finishes first.
fn two_choices() -> Vec<GenerationEvent> {
    vec![
        delta_at(0, "A"),
        delta_at(1, "X"),
        delta_at(0, "B"),
        delta_at(1, ""),
        delta_at(1, "Y"),
        finished_at(1, FinishReason::Length, usage(3)),
        delta_at(0, "C"),
        finished_at(0, FinishReason::Stop, usage(4)),
    ]
}

fn with(mut body: Value, fields: Value) -> Value {
    for (key, value) in fields.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// The `choices` of every chunk, in order.
fn chunk_choices(chunks: &[Value]) -> Vec<Value> {
    chunks.iter().map(|c| c["choices"].clone()).collect()
}

#[tokio::test]
async fn two_choices_non_streamed() {
    let fake = FakeService::new(two_choices());
    let reply = post_json(app(fake.clone()), with(hello_request(), json!({"n": 2}))).await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    assert_eq!(
        body["choices"],
        json!([
            {"index": 0, "message": {"role": "assistant", "content": "ABC"}, "logprobs": null, "finish_reason": "stop"},
            {"index": 1, "message": {"role": "assistant", "content": "XY"}, "logprobs": null, "finish_reason": "length"},
        ])
    );
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14,
               "prompt_tokens_details": {"cached_tokens": 2}})
    );
    assert_eq!(fake.request_count(), 1, "n choices are one request");
    assert_eq!(fake.last_request().n, 2);
}

#[tokio::test]
async fn two_choices_streamed_in_event_order() {
    let fake = FakeService::new(two_choices());
    let body = with(
        hello_request(),
        json!({"n": 2, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let chunks = sse_json(&post_json(app(fake), body).await);
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    assert!(chunks.iter().all(|c| c["id"] == id));
    let choice = |index: usize, delta: Value, finish: Value| json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}]);
    assert_eq!(
        chunk_choices(&chunks),
        [
            choice(0, json!({"role": "assistant", "content": ""}), json!(null)),
            choice(1, json!({"role": "assistant", "content": ""}), json!(null)),
            choice(0, json!({"content": "A"}), json!(null)),
            choice(1, json!({"content": "X"}), json!(null)),
            choice(0, json!({"content": "B"}), json!(null)),
            choice(1, json!({"content": "Y"}), json!(null)),
            choice(1, json!({}), json!("length")),
            choice(0, json!({"content": "C"}), json!(null)),
            choice(0, json!({}), json!("stop")),
            json!([]),
        ]
    );
    for chunk in &chunks[..9] {
        assert_eq!(chunk["usage"], json!(null));
    }
    assert_eq!(
        chunks[9]["usage"],
        json!({"prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14,
               "prompt_tokens_details": {"cached_tokens": 2}})
    );
}

#[tokio::test]
async fn the_answer_waits_for_every_choice() {
    // Choice 1 never finishes: the engine hanging up is a failure.
    let fake = FakeService::new(vec![
        delta_at(0, "A"),
        finished_at(0, FinishReason::Stop, usage(1)),
        delta_at(1, "X"),
    ]);
    let body = with(hello_request(), json!({"n": 2}));
    let error = post_json(app(fake), body)
        .await
        .error(StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(error["type"], "server_error");
}

/// "He" (one token), then a token that ends inside "é" (no text), then
/// "é!" completing it, then an end-of-sequence token with no text.
fn logprob_script() -> Vec<GenerationEvent> {
    let mut partial = sampled(
        (12, "\u{FFFD}", -0.25),
        &[(12, "\u{FFFD}", -0.25), (13, "x", -2.0)],
    );
    partial.token.bytes = vec![0xC3];
    partial.top[0].bytes = vec![0xC3];
    vec![
        delta_lp(
            0,
            10,
            "He",
            sampled((10, "He", -0.5), &[(10, "He", -0.5), (11, "Hi", -1.25)]),
        ),
        delta_lp(0, 12, "", partial),
        delta_lp(
            0,
            14,
            "é!",
            sampled(
                (14, "\u{FFFD}!", -1.0),
                &[(14, "\u{FFFD}!", -1.0), (15, "?", -1.5)],
            ),
        ),
        delta_lp(
            0,
            2,
            "",
            sampled((2, "", -0.125), &[(2, "", -0.125), (16, ".", -3.0)]),
        ),
        finished(FinishReason::Stop),
    ]
}

fn entry(token: &str, logprob: f64, bytes: Value, top: Value) -> Value {
    json!({"token": token, "logprob": logprob, "bytes": bytes, "top_logprobs": top})
}

fn alt(token: &str, logprob: f64, bytes: Value) -> Value {
    json!({"token": token, "logprob": logprob, "bytes": bytes})
}

fn he() -> Value {
    entry(
        "He",
        -0.5,
        json!([72, 101]),
        json!([
            alt("He", -0.5, json!([72, 101])),
            alt("Hi", -1.25, json!([72, 105]))
        ]),
    )
}

fn partial() -> Value {
    entry(
        "\u{FFFD}",
        -0.25,
        json!([0xC3]),
        json!([
            alt("\u{FFFD}", -0.25, json!([0xC3])),
            alt("x", -2.0, json!([120]))
        ]),
    )
}

fn accent() -> Value {
    let bytes = json!([0xEF, 0xBF, 0xBD, 33]);
    entry(
        "\u{FFFD}!",
        -1.0,
        bytes.clone(),
        json!([alt("\u{FFFD}!", -1.0, bytes), alt("?", -1.5, json!([63]))]),
    )
}

fn eos() -> Value {
    entry(
        "",
        -0.125,
        json!([]),
        json!([alt("", -0.125, json!([])), alt(".", -3.0, json!([46]))]),
    )
}

#[tokio::test]
async fn chat_logprobs_non_streamed() {
    let fake = FakeService::new(logprob_script());
    let body = with(
        hello_request(),
        json!({"logprobs": true, "top_logprobs": 2}),
    );
    let reply = post_json(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK);
    let choice = &reply.json()["choices"][0];
    assert_eq!(choice["message"]["content"], "Heé!");
    assert_eq!(
        choice["logprobs"],
        json!({"content": [he(), partial(), accent(), eos()]})
    );
    assert_eq!(fake.last_request().logprobs, Some(2));
}

#[tokio::test]
async fn chat_logprobs_without_top_are_empty_lists_and_off_means_null() {
    let body = with(hello_request(), json!({"logprobs": true}));
    let fake = FakeService::hello();
    let reply = post_json(app(fake.clone()), body).await;
    assert_eq!(fake.last_request().logprobs, Some(0));
    // The fake's deltas carry no logprobs: the list is empty, not null.
    assert_eq!(
        reply.json()["choices"][0]["logprobs"],
        json!({"content": []})
    );
    let fake = FakeService::new(logprob_script());
    let reply = post_json(app(fake.clone()), hello_request()).await;
    assert_eq!(fake.last_request().logprobs, None);
    assert_eq!(reply.json()["choices"][0]["logprobs"], json!(null));
}

#[tokio::test]
async fn streamed_logprobs_ride_on_the_chunk_whose_text_completes_them() {
    let fake = FakeService::new(logprob_script());
    let body = with(
        hello_request(),
        json!({"stream": true, "logprobs": true, "top_logprobs": 2}),
    );
    let chunks = sse_json(&post_json(app(fake), body).await);
    let choices = chunk_choices(&chunks);
    assert_eq!(choices.len(), 4, "{choices:?}");
    assert_eq!(choices[0][0]["logprobs"], json!(null), "the role chunk");
    assert_eq!(choices[1][0]["delta"], json!({"content": "He"}));
    assert_eq!(choices[1][0]["logprobs"], json!({"content": [he()]}));
    assert_eq!(choices[2][0]["delta"], json!({"content": "é!"}));
    assert_eq!(
        choices[2][0]["logprobs"],
        json!({"content": [partial(), accent()]})
    );
    assert_eq!(choices[3][0]["delta"], json!({}));
    assert_eq!(choices[3][0]["finish_reason"], "stop");
    assert_eq!(choices[3][0]["logprobs"], json!({"content": [eos()]}));
}

fn weather_call() -> Value {
    json!({"id": "call_abc", "type": "function",
           "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}})
}

fn time_call() -> Value {
    json!({"id": "call_def", "type": "function", "function": {"name": "get_time", "arguments": "{}"}})
}

/// Held-back text, then two tool calls (their text never arrives).
fn tool_script() -> Vec<GenerationEvent> {
    vec![
        delta_at(0, ""),
        tool_call_at(0, "call_abc", "get_weather"),
        tool_args_at(0, r#"{"city":"#),
        delta_at(0, ""),
        tool_args_at(0, r#""Paris"}"#),
        delta_at(0, ""),
        tool_call_at(0, "call_def", "get_time"),
        tool_args_at(0, "{}"),
        finished(FinishReason::ToolCalls),
    ]
}

fn tools_request() -> Value {
    with(
        hello_request(),
        json!({"tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "get_time"}},
        ]}),
    )
}

#[tokio::test]
async fn tool_calls_non_streamed_have_null_content() {
    let fake = FakeService::new(tool_script());
    let reply = post_json(app(fake), tools_request()).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        reply.json()["choices"],
        json!([{
            "index": 0,
            "message": {"role": "assistant", "content": null, "tool_calls": [weather_call(), time_call()]},
            "logprobs": null,
            "finish_reason": "tool_calls",
        }])
    );
}

#[tokio::test]
async fn text_before_a_tool_call_is_the_content() {
    let mut script = vec![delta("Let me check.")];
    script.extend(tool_script());
    let reply = post_json(app(FakeService::new(script)), tools_request()).await;
    let message = &reply.json()["choices"][0]["message"];
    assert_eq!(message["content"], "Let me check.");
    assert_eq!(message["tool_calls"], json!([weather_call(), time_call()]));
}

#[tokio::test]
async fn parallel_tool_calls_false_keeps_the_first_call() {
    let body = with(tools_request(), json!({"parallel_tool_calls": false}));
    let reply = post_json(app(FakeService::new(tool_script())), body.clone()).await;
    let choice = &reply.json()["choices"][0];
    assert_eq!(choice["message"]["tool_calls"], json!([weather_call()]));
    assert_eq!(choice["finish_reason"], "tool_calls");

    let body = with(body, json!({"stream": true}));
    let chunks = sse_json(&post_json(app(FakeService::new(tool_script())), body).await);
    let deltas: Vec<Value> = chunks
        .iter()
        .map(|c| c["choices"][0]["delta"].clone())
        .collect();
    // The message opens with the call (content null), whose arguments
    // stream in the fragments they were generated in.
    assert_eq!(
        deltas,
        [
            json!({"role": "assistant", "content": null, "tool_calls": [call_start(0, "call_abc", "get_weather")]}),
            json!({"tool_calls": [call_args(0, r#"{"city":"#)]}),
            json!({"tool_calls": [call_args(0, r#""Paris"}"#)]}),
            json!({}),
        ]
    );
}

/// The first streamed piece of call `k`: id, type, name, empty arguments.
fn call_start(k: usize, id: &str, name: &str) -> Value {
    json!({"index": k, "id": id, "type": "function", "function": {"name": name, "arguments": ""}})
}

/// A streamed argument fragment of call `k`.
fn call_args(k: usize, arguments: &str) -> Value {
    json!({"index": k, "function": {"arguments": arguments}})
}

#[tokio::test]
async fn streamed_text_before_a_tool_call_opens_with_empty_content() {
    let mut script = vec![delta("Let me check.")];
    script.extend(tool_script());
    let body = with(tools_request(), json!({"stream": true}));
    let chunks = sse_json(&post_json(app(FakeService::new(script)), body).await);
    let deltas: Vec<Value> = chunks
        .iter()
        .map(|c| c["choices"][0]["delta"].clone())
        .collect();
    assert_eq!(
        deltas[..3],
        [
            json!({"role": "assistant", "content": ""}),
            json!({"content": "Let me check."}),
            json!({"tool_calls": [call_start(0, "call_abc", "get_weather")]}),
        ]
    );
    // Without tools the role chunk goes out before anything is generated.
    let chunks = sse_json(
        &post_json(
            app(FakeService::new(vec![finished(FinishReason::Stop)])),
            with(hello_request(), json!({"stream": true})),
        )
        .await,
    );
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
}

#[tokio::test]
async fn tool_calls_streamed_as_deltas_numbered_per_choice() {
    // Choice 1 calls one tool while choice 0 calls two.
    let script = vec![
        tool_call_at(0, "call_abc", "get_weather"),
        tool_call_at(1, "call_def", "get_time"),
        tool_args_at(0, r#"{"city":"Paris"}"#),
        tool_args_at(1, "{}"),
        tool_call_at(0, "call_def", "get_time"),
        tool_args_at(0, "{}"),
        finished_at(1, FinishReason::ToolCalls, usage(5)),
        finished_at(0, FinishReason::ToolCalls, usage(9)),
    ];
    let body = with(tools_request(), json!({"stream": true, "n": 2}));
    let chunks = sse_json(&post_json(app(FakeService::new(script.clone())), body).await);
    let choice = |index: usize, delta: Value, finish: Value| json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}]);
    let opening = |call: Value| json!({"role": "assistant", "content": null, "tool_calls": [call]});
    let calls = |call: Value| json!({"tool_calls": [call]});
    assert_eq!(
        chunk_choices(&chunks),
        [
            choice(
                0,
                opening(call_start(0, "call_abc", "get_weather")),
                json!(null)
            ),
            choice(
                1,
                opening(call_start(0, "call_def", "get_time")),
                json!(null)
            ),
            choice(0, calls(call_args(0, r#"{"city":"Paris"}"#)), json!(null)),
            choice(1, calls(call_args(0, "{}")), json!(null)),
            choice(0, calls(call_start(1, "call_def", "get_time")), json!(null)),
            choice(0, calls(call_args(1, "{}")), json!(null)),
            choice(1, json!({}), json!("tool_calls")),
            choice(0, json!({}), json!("tool_calls")),
        ]
    );
    // Not streamed, the same calls, whole.
    let body = with(tools_request(), json!({"n": 2}));
    let reply = post_json(app(FakeService::new(script)), body).await.json();
    let weather = json!({"id": "call_abc", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}});
    assert_eq!(
        reply["choices"][0]["message"]["tool_calls"],
        json!([weather, time_call()])
    );
    assert_eq!(
        reply["choices"][1]["message"]["tool_calls"],
        json!([time_call()])
    );
}

#[tokio::test]
async fn a_failure_ends_every_choice() {
    let script = vec![
        delta_at(0, "A"),
        delta_at(1, "X"),
        GenerationEvent::Failed {
            kind: mlxcel_engine_api::FailureKind::Model,
            message: "step failed".into(),
        },
        delta_at(0, "never sent"),
    ];
    let body = with(hello_request(), json!({"n": 2, "stream": true}));
    let reply = post_json(app(FakeService::new(script)), body).await;
    let data = sse_data(&reply.body);
    assert_eq!(data.len(), 5, "two roles, two texts, the error: {data:?}");
    let error: Value = serde_json::from_str(&data[4]).unwrap();
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("step failed"));
}
