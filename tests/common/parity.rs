//! Parity with mlx_lm's goldens, shared by tests/family_parity.rs and
//! tests/gguf_gemma3.rs: golden files, one-row steps, and the logit and
//! greedy-token check.

use std::path::{Path, PathBuf};

use mlxcel_kv::{KvCache, KvCacheConfig, KvSequence, RowReserve, StorageBackend};
use mlxcel_model::{AttentionPath, Model, StepRow};
use serde_json::Value;

/// The real checkpoint directory `models/<dir>` that
/// `scripts/prepare_real_models.py` writes (run by `scripts/setup.sh`), or
/// the directory in the environment variable `env`.
pub fn real_model_dir(env: &str, dir: &str) -> PathBuf {
    std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("models")
            .join(dir)
    })
}

/// Runs `tokens` as one row; the logits of its last token.
pub fn step(model: &dyn Model, kv: &mut KvCache, seq: &KvSequence, tokens: &[u32]) -> Vec<f32> {
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
pub fn read_golden(dir: &Path, script: &str) -> Value {
    let text = std::fs::read_to_string(dir.join("golden.json")).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run scripts/setup.sh (scripts/{script})",
            dir.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

/// The token ids at `key`.
pub fn ids(golden: &Value, key: &str) -> Vec<u32> {
    golden[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// The numbers at `key`, as float32.
pub fn floats(golden: &Value, key: &str) -> Vec<f32> {
    golden[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

pub fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap() as u32
}

/// `prompt`'s last logits within `tolerance` of `want_logits` and its
/// greedy tokens equal to `want`, on both KV storages.
pub fn check_model(
    name: &str,
    model: &dyn Model,
    prompt: &[u32],
    want: &[u32],
    want_logits: &[f32],
    tolerance: f32,
) {
    for backend in [StorageBackend::Dense, StorageBackend::Paged] {
        let mut kv = KvCache::new(KvCacheConfig {
            layout: model.kv_layout(),
            block_size: 16,
            num_blocks: (prompt.len() + want.len()).div_ceil(16) + 2,
            backend,
            prefix: None,
        })
        .expect("kv");
        let seq = kv.new_sequence();
        let logits = step(model, &mut kv, &seq, prompt);
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
        }
        assert_eq!(got, want, "{name} ({backend}): greedy tokens");
    }
}
