//! End to end: the real `mlxcel-server` binary on a free port, driven over
//! HTTP. Answers are checked against the mlx_lm greedy goldens.

mod common;

use common::http::{get, post_json, request};
use common::{goldens, model_dir, Golden, GOLDEN_MAX_TOKENS};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server() -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlxcel-server"))
        .args(["-m", model_dir().to_str().expect("utf-8 path")])
        .args(["--port", "0", "--alias", "smollm2"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn mlxcel-server");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let port = loop {
        let line = lines
            .next()
            .expect("server exited before listening")
            .expect("read stderr");
        if let Some(addr) = line.split("listening on http://").nth(1) {
            break addr
                .trim()
                .rsplit(':')
                .next()
                .and_then(|p| p.parse::<u16>().ok())
                .expect("port");
        }
    };
    // Keep draining the log so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Server { child, port }
}

fn messages(g: &Golden) -> Value {
    Value::Array(
        g.messages
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect(),
    )
}

fn golden(name: &str) -> Golden {
    goldens()
        .into_iter()
        .find(|g| g.name == name)
        .unwrap_or_else(|| panic!("no golden {name}"))
}

/// Completion tokens as usage counts them: the EOS token counts.
fn usage_completion(g: &Golden) -> u64 {
    (g.completion_ids.len() + usize::from(g.finish_reason == "stop")) as u64
}

fn chat(port: u16, g: &Golden) -> Value {
    let r = post_json(
        port,
        "/v1/chat/completions",
        &json!({"model": "smollm2", "messages": messages(g), "temperature": 0,
                "max_tokens": GOLDEN_MAX_TOKENS}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn check_non_streaming(port: u16, g: &Golden) {
    let v = chat(port, g);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "smollm2");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(
        choice["message"]["content"],
        g.completion_text.as_str(),
        "{}",
        g.name
    );
    assert_eq!(
        choice["finish_reason"],
        g.finish_reason.as_str(),
        "{}",
        g.name
    );
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], g.prompt_ids.len() as u64);
    assert_eq!(u["completion_tokens"], usage_completion(g));
    assert_eq!(
        u["total_tokens"],
        g.prompt_ids.len() as u64 + usage_completion(g)
    );
}

fn check_streaming(port: u16, g: &Golden) {
    let r = post_json(
        port,
        "/v1/chat/completions",
        &json!({"messages": messages(g), "temperature": 0, "max_tokens": GOLDEN_MAX_TOKENS,
                "stream": true, "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream")));
    let body = String::from_utf8(r.body).expect("utf-8 SSE");
    let data: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("chunk JSON"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let id = chunks[0]["id"].clone();
    assert!(chunks
        .iter()
        .all(|c| c["id"] == id && c["object"] == "chat.completion.chunk"));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, g.completion_text, "{}: streamed text", g.name);
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec![&json!(g.finish_reason)]);
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage["prompt_tokens"], g.prompt_ids.len() as u64);
    assert_eq!(usage["completion_tokens"], usage_completion(g));
}

fn check_error(r: &common::http::Response, status: u16, param: Option<&str>) {
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("code").is_some() && e.get("param").is_some(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
}

#[test]
fn server_answers_like_the_goldens() {
    let server = start_server();
    let port = server.port;

    // Health and models.
    assert_eq!(get(port, "/health").status, 200);
    let models = get(port, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "smollm2");

    // The README's promise: Paris, at temperature 0.
    let paris = golden("capital_france");
    let v = chat(port, &paris);
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    assert!(answer.contains("Paris"), "{answer}");
    check_non_streaming(port, &paris);

    // Non-streaming and streaming answers equal the goldens.
    for name in ["multi_turn", "french_accents", "emoji"] {
        check_non_streaming(port, &golden(name));
    }
    for name in ["list_colors", "chinese", "code_explain_whitespace"] {
        check_streaming(port, &golden(name));
    }

    // Concurrent requests are all answered correctly.
    let names = ["one_word", "digits_math", "custom_system_pirate"];
    let handles: Vec<_> = names
        .iter()
        .map(|n| {
            let g = golden(n);
            std::thread::spawn(move || check_non_streaming(port, &g))
        })
        .collect();
    for h in handles {
        h.join().expect("concurrent request");
    }

    // Error cases: OpenAI error bodies, and the server keeps serving.
    let json_ct = Some("application/json");
    check_error(
        &request(port, "POST", "/v1/chat/completions", json_ct, b"{not json"),
        400,
        None,
    );
    check_error(
        &post_json(port, "/v1/chat/completions", &json!({"model": "smollm2"})),
        400,
        Some("messages"),
    );
    check_error(
        &post_json(
            port,
            "/v1/chat/completions",
            &json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        404,
        Some("model"),
    );
    check_error(
        &post_json(
            port,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
        ),
        400,
        Some("max_tokens"),
    );
    check_error(
        &post_json(
            port,
            "/v1/chat/completions",
            &json!({"messages": [], "max_tokens": 5}),
        ),
        400,
        Some("messages"),
    );
    // A prompt longer than the model's 8192-token context.
    let long = "hello ".repeat(9000);
    let r = post_json(
        port,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": long}]}),
    );
    check_error(&r, 400, Some("messages"));
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    check_non_streaming(port, &paris);
}
