//! Fill-in-the-middle (issue 26) over HTTP on the real Qwen2.5-Coder-0.5B
//! GGUF: `/infill` (llama-server's route, with `input_extra` files) and
//! `/v1/completions` with a `suffix` answer exactly as mlx_lm's model does
//! greedily on the same FIM prompt (`tests/goldens/qwen_fim.json`, made by
//! `scripts/make_fim_golden.py`: the prompt ids from transformers' reading
//! of the GGUF vocabulary, mlx_lm's model class on the float32 weights),
//! streamed and not; keystroke-like requests reuse the prefix cache and
//! answer as a cold run does.

mod common;

use common::http::post_json;
use common::parity::real_model_dir;
use common::server::start;
use serde_json::{json, Value};

fn golden() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/qwen_fim.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("qwen_fim.json")).expect("JSON")
}

fn ok(r: common::http::Response) -> Value {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// The `/infill` body of golden case `case`.
fn infill_body(case: &Value, max_tokens: u64) -> Value {
    json!({"input_prefix": case["prefix"], "input_suffix": case["suffix"],
           "input_extra": case["extra"], "n_predict": max_tokens, "temperature": 0})
}

#[test]
fn fill_in_the_middle_answers_as_mlx_lm_and_reuses_the_prefix_cache() {
    let gguf = real_model_dir("MLXCEL_QWEN_CODER_MODEL", "qwen2.5-coder-0.5b")
        .join("qwen2.5-coder-0.5b-instruct.gguf");
    assert!(gguf.exists(), "{}: run scripts/setup.sh", gguf.display());
    let server = start(&gguf, "qwen", &["--kv-block-size", "16"], |_| {});
    let port = server.port;
    let golden = golden();
    let max = golden["max_tokens"].as_u64().expect("max_tokens");
    for case in golden["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().unwrap_or("?");
        let want = case["text"].as_str().expect("text");
        let generated = case["generated"].as_array().expect("generated").len() as u64;
        let prompt_len = case["prompt_ids"].as_array().expect("ids").len() as u64;
        let v = ok(post_json(port, "/infill", &infill_body(case, max)));
        assert_eq!(v["content"], want, "{name}: {v}");
        assert_eq!(v["stop"], true, "{name}");
        // The same prompt ids as the reference's (same count; the greedy
        // answer above then agrees token for token).
        assert_eq!(v["tokens_evaluated"], prompt_len, "{name}: {v}");
        let (predicted, stop_type) = if generated < max {
            (generated + 1, "eos") // the stop token is counted
        } else {
            (max, "limit")
        };
        assert_eq!(v["tokens_predicted"], predicted, "{name}: {v}");
        assert_eq!(v["stop_type"], stop_type, "{name}: {v}");
        if case["extra"].as_array().is_some_and(|e| !e.is_empty()) {
            continue;
        }
        // Streamed: content events, then the counts with `stop: true`.
        let mut body = infill_body(case, max);
        body["stream"] = json!(true);
        let r = post_json(port, "/infill", &body);
        assert_eq!(r.status, 200);
        let text = String::from_utf8(r.body).expect("utf-8");
        let events: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).expect("event JSON"))
            .collect();
        let (last, content) = events.split_last().expect("events");
        assert!(content.iter().all(|e| e["stop"] == false), "{name}");
        let streamed: String = content
            .iter()
            .filter_map(|e| e["content"].as_str())
            .collect();
        assert_eq!(streamed, want, "{name}: streamed");
        assert_eq!(last["stop"], true);
        assert_eq!(last["tokens_predicted"], predicted, "{name}: {last}");
        // OpenAI's completions `suffix`: the same FIM prompt.
        let v = ok(post_json(
            port,
            "/v1/completions",
            &json!({"prompt": case["prefix"], "suffix": case["suffix"],
                    "max_tokens": max, "temperature": 0}),
        ));
        assert_eq!(v["choices"][0]["text"], want, "{name}: completions");
        assert_eq!(v["usage"]["prompt_tokens"], prompt_len, "{name}: {v}");
    }
    // Keystrokes: the prefix grows by a few characters a request, after a
    // long file head; each request reads the earlier one's blocks from the
    // prefix cache, and the last answers as a cold run of it does.
    let head: String = (0..16)
        .map(|i| format!("def helper_{i}(x):\n    return x * {i} + {}\n\n", i * i))
        .collect();
    let case = &golden["cases"][0];
    let prefix = format!("{head}{}", case["prefix"].as_str().unwrap_or_default());
    let mut previous_len = 0;
    let typed = ["", "r", "re"];
    for (i, typed) in typed.iter().enumerate() {
        let body = json!({"input_prefix": format!("{prefix}{typed}"), "input_suffix": case["suffix"],
                          "n_predict": 8, "temperature": 0});
        let warm = ok(post_json(port, "/infill", &body));
        let evaluated = warm["tokens_evaluated"].as_u64().expect("evaluated");
        let cached = warm["tokens_cached"].as_u64().expect("cached");
        if i > 0 {
            // All but the blocks the new characters (and the suffix after
            // them) touch: at least the file head's blocks.
            assert!(
                cached + 48 >= previous_len && cached >= 200,
                "keystroke {i}: {cached} of {evaluated} cached (previous prompt {previous_len})"
            );
        }
        previous_len = evaluated;
        if i + 1 < typed.len() {
            continue;
        }
        let mut cold_body = body.clone();
        cold_body["cache_prompt"] = json!(false);
        let cold = ok(post_json(port, "/infill", &cold_body));
        assert_eq!(cold["tokens_cached"], 0, "keystroke {i}");
        assert_eq!(
            warm["content"], cold["content"],
            "keystroke {i}: warm == cold"
        );
    }
}
