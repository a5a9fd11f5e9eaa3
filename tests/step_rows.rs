//! What a step row can carry beyond "some tokens, the last one's logits"
//! (the runner seam of crates/engine/src/runner): rows whose input is
//! embeddings rather than token ids, and rows that want logits at every
//! position (verification of draft tokens), on tiny random-weight
//! checkpoints (`scripts/make_tiny_models.py`).

mod common;

use common::parity::step;
use mlxcel_engine::loader::{load_model, read_config};
use mlxcel_kv::{KvCache, KvCacheConfig, KvSequence, RowReserve, StorageBackend};
use mlxcel_mlx::Dtype;
use mlxcel_model::{AttentionPath, LoadOptions, Model, RowInput, StepRow, WeightMode};

fn tiny(name: &str) -> Box<dyn Model> {
    let dir = common::tiny_models_root().join(name);
    let config = read_config(&dir).expect("config (run scripts/setup.sh)");
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    load_model(&dir, config, options).expect("load")
}

fn cache(model: &dyn Model) -> KvCache {
    KvCache::new(KvCacheConfig {
        layout: model.kv_layout(),
        block_size: 16,
        num_blocks: 16,
        backend: StorageBackend::Paged,
        prefix: None,
    })
    .expect("kv")
}

/// Runs one step of `rows` (each with its sequence), all positions real;
/// the logits `[wanted, vocab]` as one vector.
fn run(model: &dyn Model, kv: &mut KvCache, rows: &[(&KvSequence, StepRow<'_>)]) -> Vec<f32> {
    let reserve: Vec<RowReserve<'_>> = rows
        .iter()
        .map(|(seq, row)| RowReserve {
            seq,
            real: row.input.len(),
            padded: row.input.len(),
        })
        .collect();
    let reservation = kv.reserve_step(&reserve).expect("reserve");
    let logits = {
        let kv_rows: Vec<(&KvSequence, usize)> =
            rows.iter().map(|(s, r)| (*s, r.input.len())).collect();
        let mut view = kv.step(&kv_rows).expect("view");
        let step_rows: Vec<StepRow<'_>> = rows.iter().map(|(_, r)| r.clone()).collect();
        model
            .forward(&step_rows, &mut view, AttentionPath::PerRow)
            .expect("forward")
    };
    kv.complete_step(reservation, true).expect("complete");
    logits.to_vec_f32().expect("logits")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A row of input embeddings (the model's own embedding of some tokens,
/// its family's scale included) runs exactly as the row of those tokens:
/// next to a token row in one step, the logits are the ones the same step
/// gives with both rows as tokens (same shapes, same kernels: equal), and
/// both agree with each row run alone (other kernels: within 1e-4). Gemma 3
/// scales token embeddings by sqrt(hidden), Granite by its multiplier: both
/// must be in what `embed_tokens` returns and not applied twice.
#[test]
fn embedding_rows_run_as_their_tokens() {
    for name in ["llama", "gemma3", "granite"] {
        let model = tiny(name);
        let a: Vec<u32> = (0..11).map(|i| 3 + i * 5).collect();
        let b: Vec<u32> = (0..7).map(|i| 40 + i * 3).collect();
        fn token_row(tokens: &[u32]) -> StepRow<'_> {
            StepRow {
                input: RowInput::Tokens(tokens),
                logits: 0..tokens.len(),
                hidden: 0..0,
            }
        }
        let pair = |second: StepRow<'_>| {
            let mut kv = cache(model.as_ref());
            let (sa, sb) = (kv.new_sequence(), kv.new_sequence());
            run(
                model.as_ref(),
                &mut kv,
                &[(&sa, token_row(&a)), (&sb, second)],
            )
        };
        let want = pair(token_row(&b));
        let embedded = model.embed_tokens(&b).expect("embed");
        assert_eq!(embedded.shape()[0], b.len() as i32);
        let got = pair(StepRow {
            input: RowInput::Embeddings(&embedded),
            logits: 0..b.len(),
            hidden: 0..0,
        });
        let same = max_diff(&got, &want);
        let alone = |tokens: &[u32]| {
            let mut kv = cache(model.as_ref());
            let seq = kv.new_sequence();
            run(model.as_ref(), &mut kv, &[(&seq, token_row(tokens))])
        };
        let (want_a, want_b) = (alone(&a), alone(&b));
        let (got_a, got_b) = got.split_at(want_a.len());
        let (da, db) = (max_diff(got_a, &want_a), max_diff(got_b, &want_b));
        eprintln!("{name}: embedding vs token row {same:.2e}; vs alone {da:.2e} / {db:.2e}");
        assert!(same < 1e-6, "{name}: {same}");
        assert!(da < 1e-4 && db < 1e-4, "{name}: {da} / {db}");
    }
}

/// Logits wanted at every position of one row (how draft tokens are
/// verified) equal the last-position logits of each prefix run alone, and
/// a row continuing a cached sequence with several tokens sees its cache.
#[test]
fn logits_at_every_position_match_each_prefix() {
    let model = tiny("qwen3");
    let prompt: Vec<u32> = (0..9).map(|i| 7 + i * 11).collect();
    let mut kv = cache(model.as_ref());
    let seq = kv.new_sequence();
    // The first 4 tokens cached, then 5 in one row with logits at each.
    step(model.as_ref(), &mut kv, &seq, &prompt[..4]);
    let row = StepRow {
        input: RowInput::Tokens(&prompt[4..]),
        logits: 0..5,
        hidden: 0..0,
    };
    let all = run(model.as_ref(), &mut kv, &[(&seq, row)]);
    let vocab = all.len() / 5;
    for i in 4..prompt.len() {
        let mut alone = cache(model.as_ref());
        let s = alone.new_sequence();
        let want = step(model.as_ref(), &mut alone, &s, &prompt[..=i]);
        let got = &all[(i - 4) * vocab..(i - 3) * vocab];
        let d = max_diff(got, &want);
        assert!(d < 1e-4, "position {i}: {d}");
    }
    // A range that ends past the row is refused, not a panic.
    let bad = StepRow {
        input: RowInput::Tokens(&prompt[..2]),
        logits: 0..3,
        hidden: 0..0,
    };
    let seq = kv.new_sequence();
    let reservation = kv
        .reserve_step(&[RowReserve {
            seq: &seq,
            real: 2,
            padded: 2,
        }])
        .expect("reserve");
    let err = {
        let mut view = kv.step(&[(&seq, 2)]).expect("view");
        model
            .forward(&[bad], &mut view, AttentionPath::PerRow)
            .expect_err("logits past the row")
    };
    assert!(err.to_string().contains("logits at 0..3"), "{err}");
    kv.complete_step(reservation, false).expect("complete");
}
