//! `POST /v1/completions` against the fake engine: prompts of every shape,
//! several prompts and choices, echo, legacy logprobs, streaming.

mod common;

use std::time::Duration;

use axum::http::StatusCode;
use common::*;
use mlxcel_engine_api::{FinishReason, GenerationEvent, Prompt, RequestField, SubmitError, Usage};
use serde_json::{json, Value};

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Usage {
    Usage {
        prompt_tokens,
        completion_tokens,
        cached_tokens: 1,
    }
}

#[tokio::test]
async fn answers_with_the_text_completion_object() {
    let fake = FakeService::hello();
    let reply = post_completion(
        app(fake.clone()),
        json!({"model": MODEL, "prompt": "Say hi"}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    let id = body["id"].as_str().unwrap();
    assert!(
        id.starts_with("cmpl-") && id.len() > "cmpl-".len() + 16,
        "{id}"
    );
    assert_eq!(
        body,
        json!({
            "id": id,
            "object": "text_completion",
            "created": body["created"],
            "model": MODEL,
            "choices": [{"index": 0, "text": "Hello", "logprobs": null, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                      "prompt_tokens_details": {"cached_tokens": 2}},
        })
    );
    let request = fake.last_request();
    assert_eq!(request.prompt, Prompt::Text("Say hi".into()));
    assert_eq!(request.max_tokens, 16, "OpenAI's default");
    assert_eq!((request.n, request.logprobs), (1, None));
}

#[tokio::test]
async fn prompts_of_every_shape_reach_the_engine() {
    let cases = [
        (json!("a"), vec![Prompt::Text("a".into())]),
        (
            json!(["a", "b"]),
            vec![Prompt::Text("a".into()), Prompt::Text("b".into())],
        ),
        (json!([1, 2, 3]), vec![Prompt::Tokens(vec![1, 2, 3])]),
        (
            json!([[1, 2], [4294967295u32]]),
            vec![Prompt::Tokens(vec![1, 2]), Prompt::Tokens(vec![u32::MAX])],
        ),
    ];
    for (prompt, expected) in cases {
        let fake = FakeService::hello();
        let reply = post_completion(app(fake.clone()), json!({"prompt": prompt})).await;
        assert_eq!(reply.status, StatusCode::OK, "{prompt}");
        let prompts: Vec<Prompt> = fake
            .requests
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.prompt.clone())
            .collect();
        assert_eq!(prompts, expected, "{prompt}");
    }
}

/// Choice `i` of a prompt: text `"<prefix><i>"`; choice 1 finishes first.
fn prompt_script(prefix: &str, prompt_tokens: usize) -> Vec<GenerationEvent> {
    vec![
        delta_at(1, &format!("{prefix}1")),
        finished_at(1, FinishReason::Length, usage(prompt_tokens, 2)),
        delta_at(0, &format!("{prefix}0")),
        finished_at(0, FinishReason::Stop, usage(prompt_tokens, 3)),
    ]
}

#[tokio::test]
async fn several_prompts_with_n_choices_are_indexed_prompt_major() {
    let fake = FakeService::scripted(vec![prompt_script("a", 5), prompt_script("b", 6)]);
    let body = json!({"prompt": ["A", "B"], "n": 2, "max_tokens": 4, "stop": ["\n"], "seed": 3});
    let reply = post_completion(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    let texts: Vec<(u64, &str, &str)> = body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["index"].as_u64().unwrap(),
                c["text"].as_str().unwrap(),
                c["finish_reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        texts,
        [
            (0, "a0", "stop"),
            (1, "a1", "length"),
            (2, "b0", "stop"),
            (3, "b1", "length")
        ]
    );
    // Each prompt counted once; completion tokens summed over all choices.
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 11, "completion_tokens": 10, "total_tokens": 21,
               "prompt_tokens_details": {"cached_tokens": 2}})
    );
    let requests = fake.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    for (request, prompt) in requests.iter().zip(["A", "B"]) {
        assert_eq!(request.prompt, Prompt::Text(prompt.into()));
        assert_eq!((request.n, request.max_tokens), (2, 4));
        assert_eq!(request.stop, ["\n"]);
        assert_eq!(request.sampling.seed, Some(3));
    }
}

#[tokio::test]
async fn several_prompts_streamed() {
    let fake = FakeService::scripted(vec![prompt_script("a", 5), prompt_script("b", 6)]);
    let body = json!({"prompt": ["A", "B"], "n": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let chunks = sse_json(&post_completion(app(fake), body).await);
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-"));
    for chunk in &chunks {
        assert_eq!(chunk["id"], id);
        assert_eq!(chunk["object"], "text_completion");
    }
    let (usage_chunk, chunks) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], 11);
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 10);
    // Events of the two prompts may interleave; within one choice, order
    // is kept.
    let mut per_choice: Vec<Vec<(String, Value)>> = vec![Vec::new(); 4];
    for chunk in chunks {
        assert_eq!(chunk["usage"], json!(null));
        let choices = chunk["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 1);
        let c = &choices[0];
        assert_eq!(c["logprobs"], json!(null));
        let index = c["index"].as_u64().unwrap() as usize;
        per_choice[index].push((
            c["text"].as_str().unwrap().to_owned(),
            c["finish_reason"].clone(),
        ));
    }
    let expect = |text: &str, reason: &str| {
        vec![
            (text.to_owned(), json!(null)),
            (String::new(), json!(reason)),
        ]
    };
    assert_eq!(
        per_choice,
        [
            expect("a0", "stop"),
            expect("a1", "length"),
            expect("b0", "stop"),
            expect("b1", "length")
        ]
    );
}

#[tokio::test]
async fn echo_prepends_the_prompt_text_and_detokenized_tokens() {
    let fake = FakeService::hello();
    let body = json!({"prompt": "Say ", "echo": true});
    let reply = post_completion(app(fake), body).await;
    assert_eq!(reply.json()["choices"][0]["text"], "Say Hello");

    let fake = FakeService::hello();
    let body = json!({"prompt": [[5, 6], [7]], "echo": true});
    let reply = post_completion(app(fake), body).await;
    let texts: Vec<String> = reply.json()["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(texts, ["t5t6Hello", "t7Hello"]);
}

#[tokio::test]
async fn echo_streams_the_prompt_first() {
    let fake = FakeService::hello();
    let body = json!({"prompt": [9], "echo": true, "stream": true});
    let chunks = sse_json(&post_completion(app(fake), body).await);
    let texts: Vec<(&str, &Value)> = chunks
        .iter()
        .map(|c| {
            (
                c["choices"][0]["text"].as_str().unwrap(),
                &c["choices"][0]["finish_reason"],
            )
        })
        .collect();
    assert_eq!(
        texts,
        [
            ("t9", &json!(null)),
            ("Hel", &json!(null)),
            ("lo", &json!(null)),
            ("", &json!("stop")),
        ]
    );
}

/// Issue 13 item 12: `echo` with `logprobs` asks the engine for the
/// prompt's logprobs and returns them before the completion's: the first
/// prompt token with `null`s, streamed in the echo chunk (which waits for
/// them) or whole.
#[tokio::test]
async fn echo_with_logprobs_returns_the_prompts_logprobs() {
    let script = vec![
        GenerationEvent::PromptLogprobs {
            index: 0,
            first: token_lp(5, "t5", 0.0),
            logprobs: vec![sampled((6, "t6", -1.5), &[(6, "t6", -1.5), (1, "x", -2.0)])],
        },
        delta_lp(0, 1, "Hi", sampled((1, "Hi", -0.25), &[(1, "Hi", -0.25)])),
        finished(FinishReason::Length),
    ];
    let body = json!({"prompt": [5, 6], "echo": true, "logprobs": 1, "max_tokens": 1});
    let fake = FakeService::new(script.clone());
    let reply = post_completion(app(fake.clone()), body.clone()).await;
    assert_eq!(fake.last_request().prompt_logprobs, Some(1));
    let choice = &reply.json()["choices"][0];
    assert_eq!(choice["text"], "t5t6Hi");
    assert_eq!(
        choice["logprobs"],
        json!({
            "tokens": ["t5", "t6", "Hi"],
            "token_logprobs": [null, -1.5, -0.25],
            "top_logprobs": [null, {"t6": -1.5, "x": -2.0}, {"Hi": -0.25}],
            "text_offset": [0, 2, 4],
        })
    );
    // Streamed: the echo chunk carries the prompt's entries.
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let chunks = sse_json(&post_completion(app(FakeService::new(script)), streamed).await);
    assert_eq!(chunks[0]["choices"][0]["text"], "t5t6");
    assert_eq!(
        chunks[0]["choices"][0]["logprobs"]["token_logprobs"],
        json!([null, -1.5])
    );
    assert_eq!(chunks[1]["choices"][0]["text"], "Hi");
    assert_eq!(
        chunks[1]["choices"][0]["logprobs"]["text_offset"],
        json!([4])
    );
    // Without echo no prompt logprobs are asked for.
    let fake = FakeService::hello();
    post_completion(app(fake.clone()), json!({"prompt": "x", "logprobs": 1})).await;
    assert_eq!(fake.last_request().prompt_logprobs, None);
}

#[tokio::test]
async fn echo_of_an_unknown_token_is_refused_before_any_submit() {
    let fake = FakeService::hello();
    let body = json!({"prompt": [[1], [VOCAB]], "echo": true});
    let error = post_completion(app(fake.clone()), body)
        .await
        .error(StatusCode::BAD_REQUEST);
    // The second prompt holds the unknown token.
    assert_eq!(error["param"], "prompt[1]");
    assert_eq!(fake.request_count(), 0);
}

/// "ab" (one token), a token inside a character, "é" completing it, then
/// a last token with no text before the finish.
fn legacy_script() -> Vec<GenerationEvent> {
    vec![
        delta_lp(
            0,
            10,
            "ab",
            sampled((10, "ab", -0.5), &[(10, "ab", -0.5), (11, "a", -1.5)]),
        ),
        delta_lp(
            0,
            12,
            "",
            sampled((12, "\u{FFFD}", -0.25), &[(12, "\u{FFFD}", -0.25)]),
        ),
        delta_lp(
            0,
            13,
            "é",
            sampled(
                (13, "\u{FFFD}", -1.0),
                &[
                    (13, "\u{FFFD}", -1.0),
                    (14, "\u{FFFD}", -2.0),
                    (15, "c", -3.0),
                ],
            ),
        ),
        delta_lp(
            0,
            2,
            "",
            sampled((2, "</s>", -0.125), &[(2, "</s>", -0.125), (16, "d", -4.0)]),
        ),
        finished(FinishReason::Stop),
    ]
}

#[tokio::test]
async fn legacy_logprobs_non_streamed() {
    let fake = FakeService::new(legacy_script());
    let body = json!({"prompt": "x", "logprobs": 2});
    let reply = post_completion(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK);
    let choice = &reply.json()["choices"][0];
    assert_eq!(choice["text"], "abé");
    assert_eq!(
        choice["logprobs"],
        json!({
            "tokens": ["ab", "\u{FFFD}", "\u{FFFD}", "</s>"],
            "token_logprobs": [-0.5, -0.25, -1.0, -0.125],
            // Two alternatives that show as the same text: the likelier.
            "top_logprobs": [
                {"ab": -0.5, "a": -1.5},
                {"\u{FFFD}": -0.25},
                {"\u{FFFD}": -1.0, "c": -3.0},
                {"</s>": -0.125, "d": -4.0},
            ],
            "text_offset": [0, 2, 3, 4],
        })
    );
    assert_eq!(fake.last_request().logprobs, Some(2));
}

#[tokio::test]
async fn legacy_logprobs_streamed_keep_counting_offsets() {
    let fake = FakeService::new(legacy_script());
    let body = json!({"prompt": "x", "logprobs": 0, "stream": true});
    let chunks = sse_json(&post_completion(app(fake.clone()), body).await);
    let logprobs: Vec<Value> = chunks
        .iter()
        .map(|c| c["choices"][0]["logprobs"].clone())
        .collect();
    assert_eq!(logprobs.len(), 3);
    assert_eq!(logprobs[0]["tokens"], json!(["ab"]));
    assert_eq!(logprobs[0]["text_offset"], json!([0]));
    assert_eq!(logprobs[1]["tokens"], json!(["\u{FFFD}", "\u{FFFD}"]));
    assert_eq!(logprobs[1]["token_logprobs"], json!([-0.25, -1.0]));
    assert_eq!(logprobs[1]["text_offset"], json!([2, 3]));
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(logprobs[2]["tokens"], json!(["</s>"]));
    assert_eq!(logprobs[2]["text_offset"], json!([4]));
    assert_eq!(
        logprobs[2]["top_logprobs"],
        json!([{"</s>": -0.125, "d": -4.0}])
    );
    assert_eq!(fake.last_request().logprobs, Some(0));
}

#[tokio::test]
async fn a_refused_prompt_drops_the_ones_already_submitted() {
    let fake = FakeService::refusing_after(2, SubmitError::Unavailable("queue full".into()));
    let body = json!({"prompt": ["a", "b", "c"]});
    let error = post_completion(app(fake.clone()), body)
        .await
        .error(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error["code"], "service_unavailable");
    assert_eq!(fake.request_count(), 3);
    let senders = fake.senders.lock().unwrap().clone();
    assert_eq!(senders.len(), 2);
    // The drop reaches the engine's end through the task that forwards
    // each stream (`mlxcel_http::shutdown`): let it run.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    while senders.iter().any(|s| !s.is_closed()) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    for sender in senders {
        assert!(sender.is_closed(), "an accepted prompt was not cancelled");
    }
}

#[tokio::test]
async fn a_prompt_longer_than_the_context_names_prompt() {
    let fake = FakeService::refusing(SubmitError::ContextLengthExceeded {
        prompt_tokens: 5000,
        context_length: 4096,
    });
    let error = post_completion(app(fake), json!({"prompt": "long"}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(error["code"], "context_length_exceeded");
    assert_eq!(error["param"], "prompt");
}

/// Issue 13 item 13: the engine's typed refusals are named as this route
/// names its fields: the prompt is `prompt` (or `prompt[i]` of several),
/// never chat's `messages`.
#[tokio::test]
async fn engine_refusals_name_the_completion_fields() {
    let refusal = |field| SubmitError::InvalidRequest {
        message: "refused".into(),
        field: Some(field),
    };
    let cases = [
        (json!({"prompt": "x"}), RequestField::Prompt, "prompt"),
        (
            json!({"prompt": [[1], [2]]}),
            RequestField::Prompt,
            "prompt[0]",
        ),
        (
            json!({"prompt": "x"}),
            RequestField::LogitBias,
            "logit_bias",
        ),
        (json!({"prompt": "x"}), RequestField::N, "n"),
    ];
    for (body, field, param) in cases {
        let fake = FakeService::refusing(refusal(field));
        let error = post_completion(app(fake), body.clone())
            .await
            .error(StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], param, "{body} {field:?}");
    }
    // The second of three prompts is refused: it is the one named.
    let fake = FakeService::refusing_after(1, refusal(RequestField::Prompt));
    let error = post_completion(app(fake), json!({"prompt": ["a", "b", "c"]}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], "prompt[1]");
    // A context overflow of one of several prompts, likewise.
    let fake = FakeService::refusing_after(
        2,
        SubmitError::ContextLengthExceeded {
            prompt_tokens: 5000,
            context_length: 4096,
        },
    );
    let error = post_completion(app(fake), json!({"prompt": ["a", "b", "c"]}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(
        (error["param"].as_str(), error["code"].as_str()),
        (Some("prompt[2]"), Some("context_length_exceeded"))
    );
    // The same refusal on chat names `messages`.
    let fake = FakeService::refusing(refusal(RequestField::Prompt));
    let error = post_json(app(fake), hello_request())
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], "messages");
}

#[tokio::test]
async fn dropping_a_streamed_completion_cancels_every_prompt() {
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let fake = FakeService::holding_open(vec![delta("Hel")]);
    let request = axum::http::Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(
            json!({"prompt": ["a", "b"], "stream": true}).to_string(),
        ))
        .unwrap();
    let response = app(fake.clone()).oneshot(request).await.unwrap();
    let mut body = response.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    assert!(std::str::from_utf8(frame.data_ref().unwrap())
        .unwrap()
        .contains("Hel"));
    let senders = fake.senders.lock().unwrap().clone();
    assert_eq!(senders.len(), 2);
    drop(body);
    for sender in senders {
        let mut closed = false;
        for _ in 0..100 {
            if sender.is_closed() {
                closed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(closed, "a prompt's receiver outlived the response body");
    }
}
