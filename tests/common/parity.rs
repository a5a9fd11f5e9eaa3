//! Parity with mlx_lm's goldens, shared by tests/family_parity.rs and
//! tests/gguf_gemma3.rs: golden files, one-row steps, and the logit and
//! greedy-token check.

use std::path::{Path, PathBuf};

use mlxcel_kv::{
    KvCache, KvCacheConfig, KvGroupConfig, KvSequence, LayerState, RecurrentConfig, RowReserve,
    StorageBackend,
};
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

/// The sizes and constants of `c` that a GGUF file's metadata and the
/// matching checkpoint's `config.json` must agree on.
#[allow(clippy::type_complexity)]
pub fn config_shape(c: &mlxcel_model::ModelConfig) -> (String, [usize; 8], [String; 2], bool) {
    (
        c.model_type.clone(),
        [
            c.hidden_size,
            c.num_hidden_layers,
            c.intermediate_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.vocab_size,
            c.max_position_embeddings,
        ],
        [c.rms_norm_eps.to_string(), c.rope_theta.to_string()],
        c.tie_word_embeddings,
    )
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
        let rows = [StepRow::tokens(tokens, Some(n - 1))];
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

/// Every KV storage: dense, paged, and paged split into the model's KV
/// groups (each trimmed after every step).
pub const ALL_STORAGES: &[(StorageBackend, bool)] = &[
    (StorageBackend::Dense, false),
    (StorageBackend::Paged, false),
    (StorageBackend::Paged, true),
];

/// The storage the engine serves with alone (paged, in the model's KV
/// groups): for real checkpoints, whose family math is what is checked
/// (the storages are compared on the tiny checkpoints, at a third of the
/// cost).
pub const AS_SERVED: &[(StorageBackend, bool)] = &[(StorageBackend::Paged, true)];

/// `prompt`'s last logits within `tolerance` of `want_logits` and its
/// greedy tokens equal to `want`, on every storage of `storages`
/// ([`ALL_STORAGES`] or [`AS_SERVED`]).
pub fn check_model(
    name: &str,
    model: &dyn Model,
    prompt: &[u32],
    want: &[u32],
    want_logits: &[f32],
    tolerance: f32,
    storages: &[(StorageBackend, bool)],
) {
    let blocks = (prompt.len() + want.len()).div_ceil(16) + 2;
    for &(backend, grouped) in storages {
        let config = KvCacheConfig {
            layout: model.kv_layout(),
            block_size: 16,
            num_blocks: blocks,
            backend,
            prefix: None,
        };
        // Grouped: the engine's KV groups, one per window, each trimmed to
        // its window after every step (a window group holds only its keys).
        // Recurrent layers keep their state beside the groups.
        let recurrent = RecurrentConfig {
            layers: model
                .layer_states()
                .iter()
                .enumerate()
                .filter(|(_, s)| matches!(s, LayerState::Recurrent { .. }))
                .map(|(l, _)| l)
                .collect(),
            ..RecurrentConfig::default()
        };
        let mut groups = if grouped {
            KvGroupConfig::from_layer_windows(&model.layer_windows(), None)
        } else {
            KvGroupConfig::from_layer_windows(&vec![None; model.layer_windows().len()], None)
        };
        // Layers that read another layer's K/V keep none.
        let shared = LayerState::shared_layers(&model.layer_states());
        for g in &mut groups {
            g.num_blocks = blocks;
            g.layers
                .retain(|l| !recurrent.layers.contains(l) && !shared.iter().any(|s| s.0 == *l));
        }
        let config = KvCacheConfig {
            num_blocks: blocks * groups.len(),
            ..config
        };
        let mut kv = KvCache::with_shared_layers(config, groups, recurrent, &shared).expect("kv");
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
