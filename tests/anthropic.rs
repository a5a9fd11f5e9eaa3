//! End to end: Anthropic's Messages API (`POST /v1/messages`,
//! `POST /v1/messages/count_tokens`) on the real `mlxcel-server` binary
//! and the SmolLM2 test model, with an API key. One server serves every
//! check (greedy, short replies: each check takes a few seconds).

mod common;

use common::http::{post_json, request_with_headers, Response};
use common::model_dir;
use serde_json::{json, Value};

const KEY: &str = "sk-anthropic-test";

fn post(port: u16, path: &str, body: &Value) -> Response {
    request_with_headers(
        port,
        "POST",
        path,
        &[
            ("Content-Type", "application/json"),
            ("x-api-key", KEY),
            ("anthropic-version", "2023-06-01"),
        ],
        body.to_string().as_bytes(),
    )
}

fn ok(r: Response) -> Value {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// The events of an Anthropic stream: (event name, data), each `event:`
/// line checked against its data's `type`.
fn events(r: Response) -> Vec<(String, Value)> {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(
        r.header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream")),
        "{:?}",
        r.headers
    );
    let body = String::from_utf8(r.body).expect("utf-8");
    let mut out = Vec::new();
    for frame in body.split("\n\n").filter(|f| !f.trim().is_empty()) {
        let mut name = None;
        let mut data = None;
        for line in frame.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = Some(n.to_owned());
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = Some(serde_json::from_str::<Value>(d).expect("event JSON"));
            }
        }
        let (Some(name), Some(data)) = (name, data) else {
            // A keep-alive comment.
            continue;
        };
        assert_eq!(data["type"], name.as_str(), "{frame}");
        out.push((name, data));
    }
    assert!(!body.contains("[DONE]"), "{body}");
    out
}

/// The content blocks a stream built, from its events (the SDK's
/// accumulation), with `tool_use` inputs parsed from their JSON text; and
/// the `message_delta`.
fn accumulate(events: &[(String, Value)]) -> (Vec<Value>, Value) {
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..2], ["message_start", "ping"], "{names:?}");
    assert_eq!(
        names[names.len() - 2..],
        ["message_delta", "message_stop"],
        "{names:?}"
    );
    let start = &events[0].1["message"];
    assert!(
        start["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("msg_")),
        "{start}"
    );
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    let mut blocks: Vec<Value> = Vec::new();
    let mut json_text: Vec<String> = Vec::new();
    let mut open: Option<usize> = None;
    for (name, data) in &events[2..events.len() - 2] {
        let index = data["index"].as_u64().expect("index") as usize;
        match name.as_str() {
            "content_block_start" => {
                assert_eq!(open, None, "a block started inside another");
                assert_eq!(index, blocks.len());
                blocks.push(data["content_block"].clone());
                json_text.push(String::new());
                open = Some(index);
            }
            "content_block_delta" => {
                assert_eq!(open, Some(index));
                let delta = &data["delta"];
                let block = &mut blocks[index];
                match delta["type"].as_str() {
                    Some("text_delta") => {
                        let text = block["text"].as_str().expect("a text block").to_owned();
                        block["text"] = json!(text + delta["text"].as_str().expect("text"));
                    }
                    Some("input_json_delta") => {
                        assert_eq!(block["type"], "tool_use");
                        json_text[index].push_str(delta["partial_json"].as_str().expect("json"));
                    }
                    other => panic!("unexpected delta {other:?}"),
                }
            }
            "content_block_stop" => {
                assert_eq!(open.take(), Some(index));
                if blocks[index]["type"] == "tool_use" {
                    assert_eq!(blocks[index]["input"], json!({}));
                    blocks[index]["input"] =
                        serde_json::from_str(&json_text[index]).expect("arguments JSON");
                }
            }
            other => panic!("unexpected event {other}"),
        }
    }
    assert_eq!(open, None);
    (blocks, events[events.len() - 2].1.clone())
}

fn text_of(message: &Value) -> String {
    message["content"]
        .as_array()
        .expect("content")
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().expect("text").to_owned())
        .collect()
}

fn weather_tools() -> Value {
    json!([
        {"name": "get_weather", "description": "The weather in a city",
         "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}},
        {"name": "get_time", "description": "The time in a time zone",
         "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}},
                          "required": ["zone"]}},
    ])
}

fn question() -> Value {
    json!({"model": "smollm2", "max_tokens": 24, "temperature": 0,
           "system": "You are a helpful assistant.",
           "messages": [{"role": "user", "content": "What is the capital of France?"}]})
}

/// A plain answer equals the chat completion of the same conversation
/// (same prompt, greedy), and its usage adds up to the chat's prompt.
fn check_plain(port: u16) -> Value {
    let m = ok(post(port, "/v1/messages", &question()));
    assert!(
        m["id"].as_str().is_some_and(|id| id.starts_with("msg_")),
        "{m}"
    );
    assert_eq!(m["type"], "message");
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["model"], "smollm2");
    assert_eq!(m["content"][0]["type"], "text", "{m}");
    let text = text_of(&m);
    assert!(!text.is_empty(), "{m}");
    let chat = ok(request_with_headers(
        port,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json"), ("x-api-key", KEY)],
        json!({"model": "smollm2", "max_tokens": 24, "temperature": 0,
               "messages": [{"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": "What is the capital of France?"}]})
        .to_string()
        .as_bytes(),
    ));
    assert_eq!(chat["choices"][0]["message"]["content"], text.as_str());
    let usage = &m["usage"];
    let prompt = usage["input_tokens"].as_u64().unwrap()
        + usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(
        prompt,
        chat["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{m}"
    );
    assert_eq!(usage["cache_creation_input_tokens"], 0);
    assert_eq!(usage["output_tokens"], chat["usage"]["completion_tokens"]);
    let reason = if chat["choices"][0]["finish_reason"] == "length" {
        "max_tokens"
    } else {
        "end_turn"
    };
    assert_eq!(m["stop_reason"], reason, "{m}");
    assert_eq!(m["stop_sequence"], Value::Null);
    m
}

/// The stream's events build the same message as the whole answer.
fn check_streamed(port: u16, whole: &Value) {
    let mut body = question();
    body["stream"] = json!(true);
    let events = events(post(port, "/v1/messages", &body));
    let (blocks, delta) = accumulate(&events);
    assert_eq!(Value::Array(blocks), whole["content"]);
    assert_eq!(delta["delta"]["stop_reason"], whole["stop_reason"]);
    assert_eq!(delta["delta"]["stop_sequence"], Value::Null);
    assert_eq!(
        delta["usage"]["output_tokens"],
        whole["usage"]["output_tokens"]
    );
    let text_deltas = events
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "text_delta")
        .count();
    assert!(text_deltas >= 2, "{text_deltas} text deltas");
}

/// `max_tokens` cuts the answer: `stop_reason: max_tokens`.
fn check_max_tokens(port: u16) {
    let mut body = question();
    body["max_tokens"] = json!(3);
    let m = ok(post(port, "/v1/messages", &body));
    assert_eq!(m["stop_reason"], "max_tokens", "{m}");
    assert_eq!(m["usage"]["output_tokens"], 3);
}

/// A stop sequence taken from the middle of the greedy answer ends it
/// there: `stop_reason: stop_sequence`, the sequence named, the text the
/// part before it.
fn check_stop_sequence(port: u16, whole: &Value) {
    let full = text_of(whole);
    let words: Vec<&str> = full.split_whitespace().collect();
    assert!(words.len() >= 3, "{full}");
    let stop = words[2];
    let mut body = question();
    body["stop_sequences"] = json!(["never appears #@!", stop]);
    for stream in [false, true] {
        body["stream"] = json!(stream);
        let (text, reason, sequence) = if stream {
            let (blocks, delta) = accumulate(&events(post(port, "/v1/messages", &body)));
            let m = json!({"content": blocks});
            (
                text_of(&m),
                delta["delta"]["stop_reason"].clone(),
                delta["delta"]["stop_sequence"].clone(),
            )
        } else {
            let m = ok(post(port, "/v1/messages", &body));
            (
                text_of(&m),
                m["stop_reason"].clone(),
                m["stop_sequence"].clone(),
            )
        };
        assert_eq!(reason, "stop_sequence", "stream {stream}");
        assert_eq!(sequence, stop, "stream {stream}");
        let at = full.find(stop).expect("the stop word");
        assert_eq!(text, &full[..at], "stream {stream}");
    }
}

/// `count_tokens` of the same body is the prompt the answer's usage counts.
fn check_count_tokens(port: u16, whole: &Value) {
    let mut body = question();
    body.as_object_mut().unwrap().remove("max_tokens");
    let count = ok(post(port, "/v1/messages/count_tokens", &body));
    let usage = &whole["usage"];
    let prompt = usage["input_tokens"].as_u64().unwrap()
        + usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(count["input_tokens"].as_u64(), Some(prompt), "{count}");
    assert_eq!(count.as_object().map(|o| o.len()), Some(1), "{count}");
}

fn weather_question() -> Value {
    json!({"model": "smollm2", "max_tokens": 40, "temperature": 0,
           "tools": weather_tools(),
           "messages": [{"role": "user", "content": "What is the weather in Paris?"}]})
}

/// `tool_choice: tool` forces that call: one `tool_use` block with an
/// object input, `stop_reason: tool_use`; streamed, the same block from
/// `input_json_delta`s. Returns the block.
fn check_forced_tool(port: u16) -> Value {
    let mut body = weather_question();
    body["tool_choice"] = json!({"type": "tool", "name": "get_weather"});
    let m = ok(post(port, "/v1/messages", &body));
    assert_eq!(m["stop_reason"], "tool_use", "{m}");
    let blocks = m["content"].as_array().expect("content");
    assert_eq!(blocks.len(), 1, "{m}");
    let call = &blocks[0];
    assert_eq!(call["type"], "tool_use");
    assert!(
        call["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("toolu_")),
        "{call}"
    );
    assert_eq!(call["name"], "get_weather");
    assert!(call["input"]["city"].is_string(), "{call}");
    body["stream"] = json!(true);
    let events = events(post(port, "/v1/messages", &body));
    let fragments = events
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "input_json_delta")
        .count();
    assert!(fragments >= 2, "{fragments} argument fragments");
    let (streamed, delta) = accumulate(&events);
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert_eq!(streamed.len(), 1);
    assert_eq!(streamed[0]["name"], call["name"]);
    assert_eq!(streamed[0]["input"], call["input"]);
    call.clone()
}

/// `tool_choice: any` makes the model call one of the tools.
fn check_any_tool(port: u16) {
    let mut body = weather_question();
    body["tool_choice"] = json!({"type": "any", "disable_parallel_tool_use": true});
    let m = ok(post(port, "/v1/messages", &body));
    assert_eq!(m["stop_reason"], "tool_use", "{m}");
    let calls: Vec<&Value> = m["content"]
        .as_array()
        .expect("content")
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .collect();
    assert_eq!(calls.len(), 1, "{m}");
    let name = calls[0]["name"].as_str().expect("name");
    assert!(["get_weather", "get_time"].contains(&name), "{m}");
    assert!(calls[0]["input"].is_object(), "{m}");
}

/// The call sent back with its `tool_result` renders as the chat
/// completion's assistant `tool_calls` and `tool` message do (the same
/// prompt, token for token), and the model answers in text.
fn check_tool_round_trip(port: u16, call: &Value) {
    let messages = json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call["id"],
             "content": [{"type": "text", "text": "22 degrees and sunny"}]}]},
    ]);
    let body = json!({"model": "smollm2", "max_tokens": 24, "temperature": 0,
                      "tools": weather_tools(), "messages": messages});
    let m = ok(post(port, "/v1/messages", &body));
    assert_eq!(m["content"][0]["type"], "text", "{m}");
    assert!(!text_of(&m).is_empty(), "{m}");
    assert!(["end_turn", "max_tokens", "tool_use"].contains(&m["stop_reason"].as_str().unwrap()));
    let count = ok(post(port, "/v1/messages/count_tokens", &body))["input_tokens"].clone();
    let usage = &m["usage"];
    let prompt = usage["input_tokens"].as_u64().unwrap()
        + usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(count.as_u64(), Some(prompt));
    // The OpenAI shape of the same conversation.
    let functions: Vec<Value> = weather_tools()
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            json!({"type": "function", "function": {"name": t["name"],
            "description": t["description"], "parameters": t["input_schema"]}})
        })
        .collect();
    let openai = json!({"model": "smollm2", "tools": functions, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["input"].to_string()}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "22 degrees and sunny"},
    ]});
    let tokenized = ok(request_with_headers(
        port,
        "POST",
        "/tokenize",
        &[("Content-Type", "application/json"), ("x-api-key", KEY)],
        openai.to_string().as_bytes(),
    ));
    assert_eq!(tokenized["count"], count, "{tokenized}");
    // A result for a call nobody made.
    let mut bad = body.clone();
    bad["messages"][2]["content"][0]["tool_use_id"] = json!("toolu_unknown");
    check_error(
        post(port, "/v1/messages", &bad),
        400,
        "messages[2].content[0].tool_use_id",
    );
}

/// An Anthropic error body: `{"type": "error", "error": {"type", "message"}}`
/// whose type matches the status and whose message names `names`.
fn check_error(r: Response, status: u16, names: &str) {
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    let kind = match status {
        400 | 415 => "invalid_request_error",
        401 => "authentication_error",
        404 => "not_found_error",
        413 => "request_too_large",
        _ => unreachable!(),
    };
    assert_eq!(v["error"]["type"], kind, "{v}");
    let message = v["error"]["message"].as_str().expect("message");
    assert!(message.contains(names), "{message} should name {names}");
    assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{v}");
}

fn check_bad_requests(port: u16) {
    let mut no_max = question();
    no_max.as_object_mut().unwrap().remove("max_tokens");
    check_error(post(port, "/v1/messages", &no_max), 400, "max_tokens");
    let mut image = question();
    image["messages"][0]["content"] = json!([{"type": "image", "source": {"type": "base64",
        "media_type": "image/png", "data": "iVBORw0KGgo="}}]);
    check_error(
        post(port, "/v1/messages", &image),
        400,
        "messages[0].content[0].type",
    );
    let mut hot = question();
    hot["temperature"] = json!(1.5);
    check_error(post(port, "/v1/messages", &hot), 400, "temperature");
    let mut other = question();
    other["model"] = json!("claude-sonnet-4-5");
    check_error(post(port, "/v1/messages", &other), 404, "claude-sonnet-4-5");
    let mut role = question();
    role["messages"][0]["role"] = json!("system");
    check_error(post(port, "/v1/messages", &role), 400, "messages[0].role");
    let mut tool = weather_question();
    tool["tool_choice"] = json!({"type": "tool", "name": "get_stock_price"});
    check_error(post(port, "/v1/messages", &tool), 400, "tool_choice.name");
    let mut server_tool = weather_question();
    server_tool["tools"][0]["type"] = json!("web_search_20250305");
    check_error(
        post(port, "/v1/messages", &server_tool),
        400,
        "tools[0].type",
    );
    let mut unknown = question();
    unknown["frequency_penalty"] = json!(1);
    check_error(
        post(port, "/v1/messages", &unknown),
        400,
        "frequency_penalty",
    );
    let mut thinking = question();
    thinking["thinking"] = json!({"type": "enabled", "budget_tokens": 100});
    check_error(
        post(port, "/v1/messages", &thinking),
        400,
        "thinking.budget_tokens",
    );
    let malformed = request_with_headers(
        port,
        "POST",
        "/v1/messages",
        &[("Content-Type", "application/json"), ("x-api-key", KEY)],
        b"{\"model\": ",
    );
    check_error(malformed, 400, "JSON");
    let huge = json!({"model": "smollm2", "max_tokens": 1,
        "messages": [{"role": "user", "content": "x".repeat(5 * 1024 * 1024)}]});
    check_error(post(port, "/v1/messages", &huge), 413, "limit");
    // The same rules on count_tokens.
    check_error(
        post(port, "/v1/messages/count_tokens", &image),
        400,
        "messages[0].content[0].type",
    );
}

/// `x-api-key` and `Authorization: Bearer` both carry the key, on the
/// Messages routes and the others; without it the Messages routes answer
/// Anthropic's 401, the others OpenAI's.
fn check_auth(port: u16) {
    let body = question().to_string();
    let send = |path: &str, headers: &[(&str, &str)]| {
        let mut all = vec![("Content-Type", "application/json")];
        all.extend_from_slice(headers);
        request_with_headers(port, "POST", path, &all, body.as_bytes())
    };
    check_error(send("/v1/messages", &[]), 401, "API key");
    check_error(
        send("/v1/messages", &[("x-api-key", "sk-wrong")]),
        401,
        "API key",
    );
    check_error(send("/v1/messages/count_tokens", &[]), 401, "API key");
    let bearer = format!("Bearer {KEY}");
    assert_eq!(
        send("/v1/messages", &[("Authorization", &bearer)]).status,
        200
    );
    assert_eq!(
        send("/v1/messages/count_tokens", &[("x-api-key", KEY)]).status,
        200
    );
    let chat = json!({"model": "smollm2", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]});
    let r = post_json(port, "/v1/chat/completions", &chat);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let r = request_with_headers(
        port,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json"), ("x-api-key", KEY)],
        chat.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// Every leaf of a rich body replaced by hostile values, every key
/// removed, and random byte mutations, sent to `count_tokens` (the same
/// parsing and rules, no generation, so the run stays fast) and, for the
/// top-level fields, to `/v1/messages`: each answer is a success or an
/// Anthropic error whose type matches its 4xx status, never a 5xx; the
/// server answers a valid request afterwards.
fn check_hostile_bodies(port: u16, call: &Value) {
    use rand_core::{RngCore, SeedableRng};
    let valid = json!({
        "model": "smollm2", "max_tokens": 1, "temperature": 0, "top_k": 5, "top_p": 0.9,
        "stop_sequences": ["\n\n"], "metadata": {"user_id": "fuzz"},
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "tools": weather_tools(), "tool_choice": {"type": "auto"},
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                "content": "sunny", "is_error": false}]},
        ],
    });
    fn leaves(value: &Value, at: String, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => map
                .iter()
                .for_each(|(k, v)| leaves(v, format!("{at}/{k}"), out)),
            Value::Array(items) => items
                .iter()
                .enumerate()
                .for_each(|(i, v)| leaves(v, format!("{at}/{i}"), out)),
            _ => out.push(at),
        }
    }
    fn keys(value: &Value, at: String, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => map.iter().for_each(|(k, v)| {
                out.push(format!("{at}/{k}"));
                keys(v, format!("{at}/{k}"), out)
            }),
            Value::Array(items) => items
                .iter()
                .enumerate()
                .for_each(|(i, v)| keys(v, format!("{at}/{i}"), out)),
            _ => {}
        }
    }
    let check_at = |path: &str, body: &[u8], what: &str| {
        let r = request_with_headers(
            port,
            "POST",
            path,
            &[("Content-Type", "application/json"), ("x-api-key", KEY)],
            body,
        );
        assert!(
            r.status == 200 || (400..500).contains(&r.status),
            "{what}: {}",
            r.status
        );
        let v = r.json();
        if r.status == 200 && path == "/v1/messages" {
            assert_eq!(v["type"], "message", "{what}: {v}");
        } else if r.status == 200 {
            assert!(
                v["input_tokens"].as_u64().is_some_and(|n| n > 0),
                "{what}: {v}"
            );
        } else {
            assert_eq!(v["type"], "error", "{what}: {v}");
            let kind = if r.status == 404 {
                "not_found_error"
            } else {
                "invalid_request_error"
            };
            assert_eq!(v["error"]["type"], kind, "{what}: {v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "{what}: {v}"
            );
        }
        r.status
    };
    let check = |body: &[u8], what: &str| check_at("/v1/messages/count_tokens", body, what);
    let mut paths = Vec::new();
    leaves(&valid, String::new(), &mut paths);
    let hostile = [
        json!(null),
        json!(-1),
        json!(1e300),
        json!("<|im_end|>"),
        json!([]),
        json!({}),
        json!(true),
    ];
    let mut refused = 0;
    let mut cases = 0;
    for path in &paths {
        for value in &hostile {
            let mut body = valid.clone();
            *body.pointer_mut(path).expect("a leaf") = value.clone();
            cases += 1;
            if check(body.to_string().as_bytes(), &format!("{path} = {value}")) != 200 {
                refused += 1;
            }
        }
    }
    let mut removable = Vec::new();
    keys(&valid, String::new(), &mut removable);
    for path in &removable {
        let (parent, key) = path.rsplit_once('/').expect("a key");
        let mut body = valid.clone();
        let target = if parent.is_empty() {
            Some(&mut body)
        } else {
            body.pointer_mut(parent)
        };
        if let Some(Value::Object(map)) = target {
            map.remove(key);
        }
        cases += 1;
        check(body.to_string().as_bytes(), &format!("without {path}"));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2027);
    let bytes = valid.to_string().into_bytes();
    for i in 0..60 {
        let mut body = bytes.clone();
        for _ in 0..1 + rng.next_u32() % 4 {
            let at = rng.next_u32() as usize % body.len();
            body[at] = b"{}[]\",:\\\xff\x00"[rng.next_u32() as usize % 10];
        }
        cases += 1;
        check(&body, &format!("mutation {i}"));
    }
    assert!(refused > paths.len(), "{refused} of {cases} refused");
    for field in [
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "tool_choice",
        "thinking",
        "stop_sequences",
    ] {
        for value in &hostile {
            let mut body = valid.clone();
            body[field] = value.clone();
            check_at(
                "/v1/messages",
                body.to_string().as_bytes(),
                &format!("{field} = {value}"),
            );
        }
    }
    assert_eq!(
        check_at(
            "/v1/messages",
            valid.to_string().as_bytes(),
            "the valid body"
        ),
        200
    );
}

#[test]
fn anthropic_messages_api() {
    let server = common::server::start(&model_dir(), "smollm2", &["--api-key", KEY], |_| {});
    let port = server.port;
    check_auth(port);
    let whole = check_plain(port);
    check_streamed(port, &whole);
    check_max_tokens(port);
    check_stop_sequence(port, &whole);
    check_count_tokens(port, &whole);
    let call = check_forced_tool(port);
    check_any_tool(port);
    check_tool_round_trip(port, &call);
    check_bad_requests(port);
    check_hostile_bodies(port, &call);
}
