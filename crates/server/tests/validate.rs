//! `ValidatedChatRequest::parse` on its own: one error variant per rule.

use mlxcel_engine_api::{ChatMessage, Prompt, SamplingParams};
use mlxcel_http::validate::{
    StreamOptions, ValidatedChatRequest, ValidatedCompletionRequest, ValidationError,
};
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
            with("verbosity", json!("high")),
            ValidationError::UnsupportedParameter {
                param: "verbosity".into(),
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

fn completion(fields: Value) -> Result<ValidatedCompletionRequest, ValidationError> {
    let mut body = json!({"prompt": "Hi"});
    for (key, value) in fields.as_object().unwrap() {
        body[key] = value.clone();
    }
    ValidatedCompletionRequest::parse(body, MODEL)
}

fn tool(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name}})
}

/// Every variant added for the full wire spec, with the `param` it names.
#[test]
fn each_new_rule_has_its_variant_and_param() {
    use ValidationError as E;
    let msg = |m: Value| json!({ "messages": [m] });
    let cases: Vec<(Result<(), ValidationError>, ValidationError, &str)> = vec![
        (
            parse(msg(json!({"role": "user", "content": "x", "tool_calls": []}))).map(drop),
            E::MisplacedMessageField {
                param: "messages[0].tool_calls".into(),
                role: "user".into(),
            },
            "messages[0].tool_calls",
        ),
        (
            parse(with("stop", json!(["a", "b", "c", "d", "e"]))).map(drop),
            E::StopCount(5),
            "stop",
        ),
        (
            parse(with("stop", json!(["a", ""]))).map(drop),
            E::EmptyStop {
                param: "stop[1]".into(),
            },
            "stop[1]",
        ),
        (
            parse(with("frequency_penalty", json!(-3))).map(drop),
            E::PenaltyOutOfRange {
                param: "frequency_penalty",
                value: -3.0,
            },
            "frequency_penalty",
        ),
        (
            parse(with("repetition_penalty", json!(0))).map(drop),
            E::RepetitionPenaltyOutOfRange(0.0),
            "repetition_penalty",
        ),
        (
            parse(with("logit_bias", json!({"x1": 1}))).map(drop),
            E::LogitBiasKey("x1".into()),
            "logit_bias",
        ),
        (
            parse(with("logit_bias", json!({"9": -101}))).map(drop),
            E::LogitBiasOutOfRange {
                token: 9,
                value: -101.0,
            },
            "logit_bias",
        ),
        (
            parse(with("top_logprobs", json!(1))).map(drop),
            E::TopLogprobsWithoutLogprobs,
            "top_logprobs",
        ),
        (
            parse(json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}))
                .map(drop),
            E::TopLogprobsOutOfRange(21),
            "top_logprobs",
        ),
        (
            parse(with("n", json!(0))).map(drop),
            E::NOutOfRange(0),
            "n",
        ),
        (
            parse(with("response_format", json!({"type": "xml"}))).map(drop),
            E::UnsupportedResponseFormat("xml".into()),
            "response_format.type",
        ),
        (
            parse(with("tools", json!([{"type": "web", "function": {"name": "f"}}]))).map(drop),
            E::UnsupportedToolType {
                param: "tools[0].type".into(),
                kind: "web".into(),
            },
            "tools[0].type",
        ),
        (
            parse(with("tools", json!([tool("a.b")]))).map(drop),
            E::InvalidToolName {
                param: "tools[0].function.name".into(),
                name: "a.b".into(),
            },
            "tools[0].function.name",
        ),
        (
            parse(with("tool_choice", json!("sometimes"))).map(drop),
            E::UnsupportedToolChoice("sometimes".into()),
            "tool_choice",
        ),
        (
            parse(with("tool_choice", json!("required"))).map(drop),
            E::ToolChoiceWithoutTools,
            "tool_choice",
        ),
        (
            parse(json!({"messages": [{"role": "user", "content": "x"}], "tools": [tool("f")],
                         "tool_choice": {"type": "function", "function": {"name": "g"}}}))
            .map(drop),
            E::UnknownToolChoice("g".into()),
            "tool_choice.function.name",
        ),
        (
            completion(json!({"prompt": []})).map(drop),
            E::EmptyPrompt {
                param: "prompt".into(),
            },
            "prompt",
        ),
        (
            completion(json!({"prompt": [[3, -2]]})).map(drop),
            E::TokenIdOutOfRange {
                param: "prompt[0][1]".into(),
                value: -2,
            },
            "prompt[0][1]",
        ),
        (
            completion(json!({"logprobs": 9})).map(drop),
            E::LogprobsOutOfRange(9),
            "logprobs",
        ),
        (
            completion(json!({"n": 3, "best_of": 4})).map(drop),
            E::BestOfNotN { best_of: 4, n: 3 },
            "best_of",
        ),
    ];
    for (result, expected, param) in cases {
        assert_eq!(result, Err(expected.clone()));
        assert_eq!(expected.param().as_deref(), Some(param), "{expected:?}");
    }
}

#[test]
fn chat_extras_are_kept_beside_the_generation_request() {
    let request = parse(json!({
        "messages": [{"role": "user", "content": "x"}],
        "parallel_tool_calls": false,
        "user": "u-1",
    }))
    .unwrap();
    assert!(!request.parallel_tool_calls);
    assert_eq!(request.user.as_deref(), Some("u-1"));
    let request = parse(with("n", json!(1))).unwrap();
    assert!(request.parallel_tool_calls, "default true");
    assert_eq!(request.user, None);
}

#[test]
fn completion_defaults_and_extras() {
    let request =
        completion(json!({"prompt": ["a", "b"], "echo": true, "user": "u", "stream": true}))
            .unwrap();
    assert_eq!(request.generations.len(), 2);
    assert_eq!(request.generations[1].prompt, Prompt::Text("b".into()));
    assert_eq!(request.generations[0].max_tokens, 16);
    assert!(request.echo);
    assert_eq!(request.user.as_deref(), Some("u"));
    assert_eq!(request.stream, Some(StreamOptions::default()));
}

/// serde reads the body; its errors name the field's whole path and what
/// it expects, and `null` is absent at every depth.
#[test]
fn wire_errors_name_the_path() {
    use ValidationError as E;
    let wrong = |param: &str, expected: &'static str| E::WrongType {
        param: param.into(),
        expected,
    };
    let cases = [
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}),
            wrong("messages[0].content[0].text", "a string"),
        ),
        (
            with("stop", json!(["a", null])),
            wrong("stop[1]", "a string"),
        ),
        (
            with("logit_bias", json!({"5": "x"})),
            wrong("logit_bias.5", "a number"),
        ),
        (with("top_k", json!("5")), wrong("top_k", "an integer")),
        (
            with("tool_choice", json!(5)),
            wrong("tool_choice", "a string or an object"),
        ),
        (json!({"messages": null}), E::Missing("messages".into())),
        (
            json!({"messages": [{"role": null, "content": "x"}]}),
            E::Missing("messages[0].role".into()),
        ),
        (
            with("tools", json!([{"type": "function", "function": {}}])),
            E::Missing("tools[0].function.name".into()),
        ),
    ];
    for (body, expected) in cases {
        assert_eq!(parse(body.clone()), Err(expected), "{body}");
    }
    let prompts = [
        (
            json!({"prompt": [{"a": 1}]}),
            wrong("prompt[0]", "a string, a token id or an array of token ids"),
        ),
        (json!({"prompt": ["a", 1]}), wrong("prompt[1]", "a string")),
        (
            json!({"prompt": [[1], 2]}),
            wrong("prompt[1]", "an array of token ids"),
        ),
        (
            json!({"prompt": [[1, 1.5]]}),
            wrong("prompt[0][1]", "an integer"),
        ),
    ];
    for (body, expected) in prompts {
        let result = ValidatedCompletionRequest::parse(body.clone(), MODEL).map(drop);
        assert_eq!(result, Err(expected), "{body}");
    }
    let request = parse(json!({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": null}], "x": null}],
        "stream": true,
        "stream_options": {"include_usage": true, "foo": null},
    }))
    .unwrap();
    assert_eq!(
        request.stream,
        Some(StreamOptions {
            include_usage: true
        })
    );
    assert_eq!(
        parse(
            json!({"messages": [{"role": "user", "content": "x"}], "stream": true,
                     "stream_options": {"foo": 1}})
        ),
        Err(E::UnrecognizedParameter {
            param: "stream_options.foo".into()
        })
    );
}
