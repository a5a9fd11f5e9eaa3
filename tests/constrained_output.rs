//! Constrained decoding never fails a request (issue 28), end to end over
//! HTTP on the real SmolLM2-135M-Instruct checkpoint and the real
//! Qwen2.5-Coder-0.5B-Instruct GGUF: strings a grammar forces that hold a
//! special token's text, a required call cut between two calls, and
//! end-of-generation tokens the configs don't name.

mod common;

use common::http::{post_json, Response};
use common::model_dir;
use common::parity::real_model_dir;
use common::server::{start, Server};
use serde_json::{json, Value};

fn chat(server: &Server, body: Value) -> Value {
    let r = post_json(server.port, "/v1/chat/completions", &body);
    assert_eq!(
        r.status,
        200,
        "{body}: {}",
        String::from_utf8_lossy(&r.body)
    );
    r.json()
}

/// The data chunks of a streamed answer, `[DONE]` checked and dropped.
fn chunks(r: Response) -> Vec<Value> {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.sse_chunks()
}

/// A schema whose one property must be `value`.
fn only(value: &str) -> Value {
    json!({"type": "object", "properties": {"text": {"type": "string", "enum": [value]}},
           "required": ["text"], "additionalProperties": false})
}

/// Every way of forcing `value` (a schema, a named call, a required call)
/// answers 200 with `value` whole, streamed or not.
fn check_forced_strings(server: &Server, value: &str) {
    let user = json!([{"role": "user", "content": "echo it"}]);
    let format =
        json!({"type": "json_schema", "json_schema": {"name": "e", "schema": only(value)}});
    let v = chat(
        server,
        json!({"messages": user, "max_tokens": 60, "temperature": 0, "response_format": format}),
    );
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(content).expect("JSON content");
    assert_eq!(parsed["text"], value, "{content}");
    let streamed = chunks(post_json(
        server.port,
        "/v1/chat/completions",
        &json!({"messages": user, "max_tokens": 60, "temperature": 0, "stream": true,
                "response_format": format}),
    ));
    let text: String = streamed
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, content, "streamed and whole answers agree");
    let tools =
        json!([{"type": "function", "function": {"name": "echo", "parameters": only(value)}}]);
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "echo"}}),
    ] {
        let v = chat(
            server,
            json!({"messages": user, "max_tokens": 60, "temperature": 0, "tools": tools,
                   "tool_choice": choice}),
        );
        let message = &v["choices"][0]["message"];
        assert_eq!(message["content"], Value::Null, "{v}");
        let args = message["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        let args: Value = serde_json::from_str(args).expect("JSON arguments");
        assert_eq!(args["text"], value, "{choice}: {v}");
    }
}

/// A request whose first token is pushed to `id` by `logit_bias`: it ends
/// there, an end of generation (`stop`, one completion token, no text).
fn check_stops_at(server: &Server, id: u32) {
    let v = chat(
        server,
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
               "temperature": 0, "logit_bias": {id.to_string(): 100}}),
    );
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{v}");
    assert_eq!(choice["message"]["content"], "", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 1, "{v}");
}

#[test]
fn smollm2_constrained_output_never_fails_a_request() {
    let server = start(&model_dir(), "smollm2", &[], |_| {});
    for special in ["<|im_end|>", "<|im_start|>", "<|endoftext|>"] {
        check_forced_strings(&server, &format!("x {special} y"));
    }
    // A required choice cut by `max_tokens` between two calls (tokens 23
    // to 26 end inside `\n<tool_call>` here): the calls, never wrapper
    // text, streamed or not.
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters":
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters":
            {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
    ]);
    let user =
        json!([{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]);
    for max_tokens in 22..=27 {
        let body = json!({"messages": user, "max_tokens": max_tokens, "temperature": 0,
                          "tools": tools, "tool_choice": "required"});
        let v = chat(&server, body.clone());
        let message = &v["choices"][0]["message"];
        assert_eq!(
            message["content"],
            Value::Null,
            "max_tokens {max_tokens}: {v}"
        );
        assert!(!message["tool_calls"].as_array().unwrap().is_empty(), "{v}");
        let mut streamed = body;
        streamed["stream"] = json!(true);
        let chunks = chunks(post_json(server.port, "/v1/chat/completions", &streamed));
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "", "max_tokens {max_tokens}, streamed");
    }
    // `<|endoftext|>` (id 0) ends a reply although SmolLM2's configs name
    // only `<|im_end|>` (2).
    check_stops_at(&server, 0);
}

#[test]
fn qwen_constrained_output_never_fails_a_request() {
    let gguf = real_model_dir("MLXCEL_QWEN_CODER_MODEL", "qwen2.5-coder-0.5b")
        .join("qwen2.5-coder-0.5b-instruct.gguf");
    assert!(gguf.exists(), "{}: run scripts/setup.sh", gguf.display());
    let server = start(&gguf, "qwen", &[], |_| {});
    // Qwen's tool tags are added tokens of their own (`<tool_call>` is not
    // even marked special in its vocabulary).
    check_forced_strings(
        &server,
        "x <tool_call> y </tool_call> z <|endoftext|> <|im_end|>",
    );
    // `<|endoftext|>` (151643) ends a reply; the GGUF names `<|im_end|>`.
    check_stops_at(&server, 151_643);
}
