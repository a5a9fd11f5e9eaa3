//! Shared helpers of the end-to-end tests: the test model and its goldens.

#![allow(dead_code)]

pub mod parity;
pub mod server;

use serde_json::Value;
use std::path::PathBuf;

/// The SmolLM2 checkpoint that `scripts/setup.sh` prepares (or
/// `MLXCEL_TEST_MODEL`). Missing is a failure, not a skip.
pub fn model_dir() -> PathBuf {
    let dir = std::env::var_os("MLXCEL_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct")
        });
    assert!(
        dir.join("config.json").exists(),
        "test model missing at {}: run scripts/setup.sh",
        dir.display()
    );
    dir
}

/// One greedy golden made by `scripts/make_goldens.py` from mlx_lm.
#[derive(Debug, Clone)]
pub struct Golden {
    pub name: String,
    pub messages: Vec<(String, String)>,
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    pub completion_text: String,
    pub finish_reason: String,
}

/// Max new tokens of every golden.
pub const GOLDEN_MAX_TOKENS: usize = 32;

/// The goldens of `tests/goldens/smollm2_greedy.json`.
pub fn goldens() -> Vec<Golden> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/smollm2_greedy.json");
    let text = std::fs::read_to_string(&path).expect("golden file");
    let v: Value = serde_json::from_str(&text).expect("golden JSON");
    assert_eq!(
        v["header"]["max_tokens"].as_u64(),
        Some(GOLDEN_MAX_TOKENS as u64)
    );
    let ids = |x: &Value| -> Vec<u32> {
        x.as_array()
            .expect("id list")
            .iter()
            .map(|i| i.as_u64().expect("id") as u32)
            .collect()
    };
    v["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| Golden {
            name: p["name"].as_str().expect("name").to_string(),
            messages: p["messages"]
                .as_array()
                .expect("messages")
                .iter()
                .map(|m| {
                    (
                        m["role"].as_str().expect("role").to_string(),
                        m["content"].as_str().expect("content").to_string(),
                    )
                })
                .collect(),
            prompt_ids: ids(&p["prompt_ids"]),
            completion_ids: ids(&p["completion_ids"]),
            completion_text: p["completion_text"].as_str().expect("text").to_string(),
            finish_reason: p["finish_reason"].as_str().expect("finish").to_string(),
        })
        .collect()
}
pub mod http;

/// A greedy request for `max_tokens` tokens, prefix cache allowed.
pub fn greedy_request(
    prompt: mlxcel_engine::api::Prompt,
    max_tokens: usize,
) -> mlxcel_engine::api::GenerationRequest {
    mlxcel_engine::api::GenerationRequest::new(
        prompt,
        mlxcel_engine::api::SamplingParams::greedy(),
        max_tokens,
    )
}

/// Drains a stream: the token ids (EOS included) and the usage, or the
/// failure.
pub fn collect_tokens(
    mut stream: mlxcel_engine::api::EventStream,
) -> Result<(Vec<u32>, mlxcel_engine::api::Usage), String> {
    use mlxcel_engine::api::GenerationEvent;
    let mut ids = Vec::new();
    while let Some(event) = stream.blocking_recv() {
        match event {
            GenerationEvent::Delta { token, .. } => ids.push(token),
            GenerationEvent::Finished { usage, .. } => return Ok((ids, usage)),
            GenerationEvent::Failed { message, .. } => return Err(message),
            other @ (GenerationEvent::PromptLogprobs { .. }
            | GenerationEvent::ToolCallStart { .. }
            | GenerationEvent::ToolCallArguments { .. }
            | GenerationEvent::Embedding { .. }) => {
                return Err(format!("unexpected event {other:?}"))
            }
        }
    }
    Err("stream ended without Finished".into())
}

/// Drains an embedding request's stream: its vector and usage, or the
/// failure.
pub fn collect_embedding(
    mut stream: mlxcel_engine::api::EventStream,
) -> Result<(Vec<f32>, mlxcel_engine::api::Usage), String> {
    use mlxcel_engine::api::GenerationEvent;
    match stream.blocking_recv() {
        Some(GenerationEvent::Embedding { vector, usage }) => Ok((vector, usage)),
        Some(GenerationEvent::Failed { message, .. }) => Err(message),
        Some(other) => Err(format!("unexpected event {other:?}")),
        None => Err("stream ended without Embedding".into()),
    }
}

/// Waits until the engine has nothing running or waiting; its stats then.
pub fn settled(engine: &mlxcel_engine::Engine) -> mlxcel_engine::api::EngineStats {
    use mlxcel_engine::api::InferenceService;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let s = engine.stats();
        if s.running == 0 && s.waiting == 0 {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "engine never settled: {s:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Token ids of this repository's README (a long, stable text to cut
/// prompts of exact lengths from).
pub fn readme_tokens(engine: &mlxcel_engine::Engine) -> Vec<u32> {
    let text = include_str!("../../README.md");
    engine
        .tokenize_prompt(&mlxcel_engine::api::Prompt::Text(text.into()), &[])
        .expect("tokenize README")
}

/// Tiny Gemma 3 (`target/tiny-models/gemma3`, `scripts/setup.sh`: a local
/// layer of a 16-key window and a global layer, so two KV groups) with the
/// tiny `llama_chat` tokenizer, in a temporary directory named after `tag`.
pub fn tiny_gemma3_dir(tag: &str) -> std::path::PathBuf {
    tiny_model_dir("gemma3", tag)
}

/// Where `scripts/make_tiny_models.py` wrote the tiny random-weight
/// checkpoints: `target/tiny-models`, or `MLXCEL_TINY_MODELS`.
pub fn tiny_models_root() -> std::path::PathBuf {
    std::env::var_os("MLXCEL_TINY_MODELS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tiny-models")
        })
}

/// The engine configuration the tiny-model engine tests share, on the
/// checkpoint in `dir`: `parallel` rows, an 8 MiB KV budget, 8-token
/// blocks, 16-token prefill chunks (so a prompt spans several blocks and
/// steps), invariants checked after every step.
pub fn tiny_engine_config(dir: &std::path::Path, parallel: usize) -> mlxcel_engine::EngineConfig {
    let mut c = mlxcel_engine::EngineConfig::new(dir.to_path_buf());
    c.parallel = parallel;
    c.kv_cache_budget = Some(8 << 20);
    c.kv_block_size = 8;
    c.prefill_chunk_size = 16;
    c.check_invariants = true;
    c
}

/// The tiny random-weight checkpoint `model` of `scripts/make_tiny_models.py`
/// (`target/tiny-models/<model>`, or under `MLXCEL_TINY_MODELS`; its
/// `golden.json` too) with the tiny `llama_chat` tokenizer, so an engine can
/// start on it, in a temporary directory named after `model` and `tag`.
/// Requests feed token ids below the model's vocabulary.
pub fn tiny_model_dir(model: &str, tag: &str) -> std::path::PathBuf {
    let tiny = tiny_models_root();
    let dir = std::env::temp_dir().join(format!("mlxcel-{model}-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let files = [
        (model, "config.json"),
        (model, "model.safetensors"),
        (model, "golden.json"),
        ("llama_chat", "tokenizer.json"),
        ("llama_chat", "tokenizer_config.json"),
        ("llama_chat", "special_tokens_map.json"),
    ];
    for (model, name) in files {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(tiny.join(model).join(name), &link).expect("symlink");
    }
    dir
}
