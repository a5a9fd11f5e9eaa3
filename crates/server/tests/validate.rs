//! `ValidatedChatRequest::parse` on its own: one error variant per rule.

use mlxcel_engine_api::{ChatMessage, Prompt, SamplingParams};
use mlxcel_http::validate::{StreamOptions, ValidatedChatRequest, ValidationError};
use serde_json::{json, Value};

const MODEL: &str = "m";

fn parse(body: Value) -> Result<ValidatedChatRequest, ValidationError> {
    ValidatedChatRequest::parse(body, MODEL, 512)
}

fn with(field: &str, value: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Hi"}]});
    body[field] = value;
    body
}

#[test]
fn a_full_request_becomes_a_generation_request() {
    let request = parse(json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 64,
        "temperature": 0.5, "top_p": 0.5, "top_k": 5, "min_p": 0.25, "seed": 7,
        "stream": true, "stream_options": {"include_usage": true},
    }))
    .unwrap();
    assert_eq!(
        request.generation.prompt,
        Prompt::Chat(vec![ChatMessage::text("system", "ab")])
    );
    assert_eq!(request.generation.max_tokens, 64);
    assert_eq!(
        request.generation.sampling,
        SamplingParams {
            temperature: 0.5,
            top_p: 0.5,
            top_k: 5,
            min_p: 0.25,
            seed: Some(7),
            ..SamplingParams::default()
        }
    );
    assert_eq!(
        request.stream,
        Some(StreamOptions {
            include_usage: true
        })
    );
}

#[test]
fn stream_defaults() {
    assert_eq!(parse(with("stream", json!(false))).unwrap().stream, None);
    assert_eq!(
        parse(with("stream", json!(true))).unwrap().stream,
        Some(StreamOptions::default())
    );
}

#[test]
fn huge_limits_saturate_instead_of_overflowing() {
    let request = parse(with("max_tokens", json!(u64::MAX))).unwrap();
    assert_eq!(request.generation.max_tokens, usize::MAX);
    let request = parse(with("top_k", json!(u64::MAX))).unwrap();
    assert_eq!(request.generation.sampling.top_k, usize::MAX);
}

#[test]
fn each_rule_has_its_variant() {
    let cases = [
        (json!("hi"), ValidationError::BodyNotObject),
        (json!({}), ValidationError::Missing("messages".into())),
        (json!({"messages": []}), ValidationError::EmptyMessages),
        (
            with("max_tokens", json!(0)),
            ValidationError::MaxTokensTooSmall {
                param: "max_tokens",
                value: 0,
            },
        ),
        (
            with("temperature", json!(2.5)),
            ValidationError::TemperatureOutOfRange(2.5),
        ),
        (
            with("top_p", json!(0.0)),
            ValidationError::TopPOutOfRange(0.0),
        ),
        (with("top_k", json!(-1)), ValidationError::TopKNegative(-1)),
        (
            with("min_p", json!(2)),
            ValidationError::MinPOutOfRange(2.0),
        ),
        (with("n", json!(17)), ValidationError::NOutOfRange(17)),
        (
            with("model", json!("other")),
            ValidationError::ModelNotFound("other".into()),
        ),
        (
            with("stream_options", json!({})),
            ValidationError::StreamOptionsWithoutStream,
        ),
        (
            with("store", json!(true)),
            ValidationError::UnsupportedParameter {
                param: "store".into(),
            },
        ),
        (
            with("foo", json!(1)),
            ValidationError::UnrecognizedParameter {
                param: "foo".into(),
            },
        ),
        (
            with("seed", json!(1.5)),
            ValidationError::WrongType {
                param: "seed".into(),
                expected: "an integer",
            },
        ),
    ];
    for (body, expected) in cases {
        assert_eq!(parse(body.clone()), Err(expected), "{body}");
    }
}

#[test]
fn null_means_absent_everywhere() {
    let body = json!({
        "messages": [{"role": "user", "content": "Hi", "name": null}],
        "model": null, "temperature": null, "stop": null, "foo": null,
        "stream": null, "stream_options": null, "n": null, "seed": null,
    });
    let request = parse(body).unwrap();
    assert_eq!(request.generation.sampling, SamplingParams::default());
    assert_eq!(request.stream, None);
}
