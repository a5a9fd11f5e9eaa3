//! Chat formats end to end over HTTP, on the real SmolLM2-135M-Instruct
//! weights: forced tool calls in gpt-oss's harmony format and in
//! Qwen3-Coder's XML format.
//!
//! There is no gpt-oss tokenizer offline, so the test model is SmolLM2 with
//! seven of its unused special tokens (`<repo_name>` .. `<issue_comment>`,
//! ids 3-9) renamed to the harmony markers and a small harmony chat
//! template: the template makes the server read replies as harmony, the
//! forced prefix and grammar put the markers in as the special tokens, and
//! the engine hands the generated ones to the output filter apart from the
//! text. SmolLM2 does not speak harmony on its own, so only forced replies
//! (whose shape the grammar fixes) are checked here; free replies are
//! covered by the text crate's tests.

mod common;

use common::http::post_json;
use common::model_dir;
use common::server::start;
use serde_json::{json, Value};

/// The renamed tokens, in id order from 3.
const RENAMED: [(&str, &str); 7] = [
    ("<repo_name>", "<|start|>"),
    ("<reponame>", "<|channel|>"),
    ("<file_sep>", "<|constrain|>"),
    ("<filename>", "<|message|>"),
    ("<gh_stars>", "<|end|>"),
    ("<issue_start>", "<|call|>"),
    ("<issue_comment>", "<|return|>"),
];

const HARMONY_TEMPLATE: &str = "{%- for m in messages %}<|start|>{{ m.role }}\
{%- if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>\
{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{% endif %}";

/// SmolLM2's weights with the harmony tokenizer and template, in a fresh
/// directory.
fn harmony_model() -> std::path::PathBuf {
    let src = model_dir();
    let dir = std::env::temp_dir().join(format!("mlxcel-harmony-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer_config.json",
    ] {
        let (from, to) = (src.join(f), dir.join(f));
        if from.exists() && !to.exists() {
            std::os::unix::fs::symlink(&from, &to).expect("link");
        }
    }
    let mut tokenizer = std::fs::read_to_string(src.join("tokenizer.json")).expect("tokenizer");
    for (old, new) in RENAMED {
        let (old, new) = (format!("\"{old}\""), format!("\"{new}\""));
        assert!(tokenizer.contains(&old), "{old}");
        tokenizer = tokenizer.replace(&old, &new);
    }
    std::fs::write(dir.join("tokenizer.json"), tokenizer).expect("tokenizer");
    std::fs::write(dir.join("chat_template.jinja"), HARMONY_TEMPLATE).expect("template");
    dir
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters":
            {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
             "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters":
            {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
             "required": ["zone"]}}},
    ])
}

/// The one call of a whole answer: (name, parsed arguments, raw arguments).
fn the_call(v: &Value) -> (String, Value, String) {
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], Value::Null, "{v}");
    assert!(
        choice["message"]
            .get("reasoning_content")
            .is_none_or(Value::is_null),
        "{v}"
    );
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls");
    assert_eq!(calls.len(), 1, "{v}");
    let raw = calls[0]["function"]["arguments"]
        .as_str()
        .expect("string")
        .to_owned();
    let args: Value = serde_json::from_str(&raw).expect("arguments are JSON");
    (
        calls[0]["function"]["name"]
            .as_str()
            .expect("name")
            .to_owned(),
        args,
        raw,
    )
}

/// The generated text of a whole answer, from its logprobs' tokens.
fn generated(v: &Value) -> String {
    v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("logprobs: {v}"))
        .iter()
        .map(|t| t["token"].as_str().expect("token"))
        .collect()
}

/// The call of a streamed answer: (name, arguments as streamed), and no
/// content.
fn streamed_call(port: u16, body: &Value) -> (String, String) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = post_json(port, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let (mut name, mut arguments) = (String::new(), String::new());
    for chunk in r.sse_chunks() {
        let delta = &chunk["choices"][0]["delta"];
        if let Some(text) = delta["content"].as_str() {
            assert!(text.is_empty(), "content streamed: {text:?}");
        }
        if let Some(call) = delta["tool_calls"].get(0) {
            name += call["function"]["name"].as_str().unwrap_or("");
            arguments += call["function"]["arguments"].as_str().unwrap_or("");
        }
    }
    (name, arguments)
}

/// A named and a required `tool_choice` on a harmony model: the reply
/// continues the harmony prefix (`<|channel|>commentary
/// to=functions.NAME <|constrain|>json<|message|>`), the required one
/// writes the name and the markers itself, and both come back as one call
/// with arguments valid for the function, the same streamed or not.
#[test]
fn forced_calls_on_a_harmony_model_are_harmony_calls() {
    let dir = harmony_model();
    let server = start(&dir, "harmony", &[], |_| {});
    let user = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    // The prompt ends with the generation prompt, in special tokens.
    let r = post_json(
        server.port,
        "/tokenize",
        &json!({"model": "harmony", "messages": user}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let tokens = r.json()["tokens"].as_array().expect("tokens").clone();
    assert_eq!(tokens.first(), Some(&json!(3)), "{tokens:?}");

    let named = json!({"messages": user, "tools": weather_tools(), "max_tokens": 40,
        "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let v = post_json(server.port, "/v1/chat/completions", &named);
    assert_eq!(v.status, 200, "{}", String::from_utf8_lossy(&v.body));
    let (name, args, raw) = the_call(&v.json());
    assert_eq!(name, "get_weather");
    assert!(args["city"].is_string(), "{args}");
    assert_eq!(streamed_call(server.port, &named), (name, raw));

    let required = json!({"messages": user, "tools": weather_tools(), "max_tokens": 60,
        "temperature": 0, "tool_choice": "required", "logprobs": true});
    let v = post_json(server.port, "/v1/chat/completions", &required);
    assert_eq!(v.status, 200, "{}", String::from_utf8_lossy(&v.body));
    let v = v.json();
    let (name, args, raw) = the_call(&v);
    // After `<|channel|>commentary to=functions.`, the model wrote the
    // name and the markers (special tokens 5 and 6).
    assert_eq!(
        generated(&v),
        format!("{name} <|constrain|>json<|message|>{raw}"),
        "{v}"
    );
    match name.as_str() {
        "get_weather" => assert!(args["city"].is_string(), "{args}"),
        "get_time" => assert!(args["zone"].is_string(), "{args}"),
        other => panic!("called {other}"),
    }
    assert_eq!(streamed_call(server.port, &required), (name, raw));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A reduced Qwen3-Coder template (ChatML, tools described, calls taught in
/// the XML format): the server reads calls in that format from it.
const QWEN3_CODER_TEMPLATE: &str = "{%- if tools %}<|im_start|>system
You may call these functions:
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
Call one as:
<tool_call>
<function=NAME>
<parameter=ARG>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}";

/// A named and a required `tool_choice` on a Qwen3-Coder template: the
/// reply continues `<tool_call>\n<function=` in the XML format under its
/// grammar, and comes back as calls whose arguments are typed by the
/// schema (`days` a JSON integer, `city` a string), the same streamed or
/// not.
#[test]
fn forced_calls_on_a_qwen3_coder_template_are_xml_calls() {
    let dir = std::env::temp_dir().join(format!("mlxcel-qwen3-coder-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let template = dir.join("qwen3_coder.jinja");
    std::fs::write(&template, QWEN3_CODER_TEMPLATE).expect("template");
    let server = start(
        &model_dir(),
        "smollm2",
        &["--chat-template", template.to_str().expect("utf-8")],
        |_| {},
    );
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters":
            {"type": "object", "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters":
            {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
             "required": ["zone"]}}},
    ]);
    let user = json!([{"role": "user", "content": "What is the weather in Paris for 3 days?"}]);
    let check_weather = |args: &Value| {
        let city = args["city"].as_str().expect("city is a string");
        assert!((1..=12).contains(&city.chars().count()), "{args}");
        let days = args["days"].as_i64().expect("days is a JSON integer");
        assert!((1..=7).contains(&days), "{args}");
    };

    let named = json!({"messages": user, "tools": tools, "max_tokens": 60, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "logprobs": true});
    let v = post_json(server.port, "/v1/chat/completions", &named);
    assert_eq!(v.status, 200, "{}", String::from_utf8_lossy(&v.body));
    let v = v.json();
    let (name, args, raw) = the_call(&v);
    assert_eq!(name, "get_weather");
    check_weather(&args);
    // What the model wrote, after the prefix `<tool_call>\n<function=get_weather>\n`.
    let text = generated(&v);
    let days = args["days"].as_i64().expect("days");
    assert!(
        text.starts_with("<parameter=city>\n")
            && text.contains(&format!("<parameter=days>\n{days}\n</parameter>\n"))
            && text.ends_with("</function>\n</tool_call>"),
        "{text:?}"
    );
    assert_eq!(streamed_call(server.port, &named), (name, raw));

    let required = json!({"messages": user, "tools": tools, "max_tokens": 80, "temperature": 0,
        "tool_choice": "required", "parallel_tool_calls": false, "logprobs": true});
    let v = post_json(server.port, "/v1/chat/completions", &required);
    assert_eq!(v.status, 200, "{}", String::from_utf8_lossy(&v.body));
    let v = v.json();
    let (name, args, raw) = the_call(&v);
    // After `<tool_call>\n<function=`, the model wrote the name.
    assert!(
        generated(&v).starts_with(&format!("{name}>\n<parameter=")),
        "{v}"
    );
    match name.as_str() {
        "get_weather" => check_weather(&args),
        "get_time" => assert!(args["zone"].is_string(), "{args}"),
        other => panic!("called {other}"),
    }
    assert_eq!(streamed_call(server.port, &required), (name, raw));
    let _ = std::fs::remove_dir_all(&dir);
}
