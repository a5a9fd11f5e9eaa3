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

/// A Llama 3 template that writes tool calls with `"parameters"` (the
/// shape of Meta's Llama 3.1 template, reduced): the format is read from it.
const LLAMA3_TEMPLATE: &str = r#"{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>

Respond with a JSON function call {"name": function name, "parameters": dictionary of argument name and its value}.
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}<|eot_id|>{%- endif %}
{%- for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% if message.tool_calls %}{%- for tool_call in message.tool_calls %}{{- '{"name": "' + tool_call.function.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.function.arguments | tojson }}{{- '}' }}{%- endfor %}{% else %}{{ message['content'] }}{% endif %}<|eot_id|>{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"#;

/// Served with a Llama 3 chat template, a model's `tool_choice: "auto"`
/// reply is parsed in Llama 3's JSON format: a bare
/// `{"name": .., "parameters": ..}` reply (made certain here by a
/// `response_format` schema of that shape) comes back as a tool call,
/// streamed or not, with no content.
#[test]
fn a_llama3_template_has_its_replies_parsed_as_llama3_json_calls() {
    let dir = std::env::temp_dir().join(format!("mlxcel-llama3-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let template = dir.join("llama3.jinja");
    std::fs::write(&template, LLAMA3_TEMPLATE).expect("template");
    let server = start(
        &model_dir(),
        "smollm2",
        &["--chat-template", template.to_str().expect("utf-8")],
        |_| {},
    );
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters":
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let schema = json!({"type": "object", "additionalProperties": false,
        "required": ["name", "parameters"],
        "properties": {"name": {"const": "get_weather"},
            "parameters": {"type": "object", "additionalProperties": false, "required": ["city"],
                "properties": {"city": {"const": "Paris"}}}}});
    let body = json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools, "tool_choice": "auto", "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": schema}}});
    let v = chat(&server, body.clone());
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["content"], Value::Null, "{v}");
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let arguments: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("string"))
            .expect("arguments are JSON");
    assert_eq!(arguments, json!({"city": "Paris"}));
    // Streamed: the same call, in argument fragments, and no content.
    let mut stream = body;
    stream["stream"] = json!(true);
    let r = post_json(server.port, "/v1/chat/completions", &stream);
    assert_eq!(r.status, 200);
    let mut name = String::new();
    let mut streamed = String::new();
    for chunk in r.sse_chunks() {
        let delta = &chunk["choices"][0]["delta"];
        if let Some(text) = delta["content"].as_str() {
            assert!(text.is_empty(), "content streamed: {text:?}");
        }
        if let Some(call) = delta["tool_calls"].get(0) {
            name += call["function"]["name"].as_str().unwrap_or("");
            streamed += call["function"]["arguments"].as_str().unwrap_or("");
        }
    }
    assert_eq!(name, "get_weather");
    assert_eq!(
        streamed,
        calls[0]["function"]["arguments"].as_str().unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
