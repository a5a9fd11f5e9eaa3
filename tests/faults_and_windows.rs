//! Fault containment (docs/architecture.md invariant 6) with the test-only fault
//! injection of `mlxcel-engine` (feature `fault-injection`, enabled for
//! tests only), and KV windows (`--max-kv-size`, sliding windows; invariant
//! 3): trimmed sequences keep answering, masks follow the live key count,
//! untrimmed runs are unchanged.

mod common;

use std::ops::Range;

use common::{collect_tokens, greedy_request, model_dir, readme_tokens, settled};
use mlxcel_engine::api::{EventStream, GenerationEvent, InferenceService, Prompt};
use mlxcel_engine::fault::FaultInjection;
use mlxcel_engine::{Engine, EngineConfig};
use mlxcel_kv::{
    AttentionKv, KvCache, KvCacheConfig, KvError, KvSequence, RowReserve, StorageBackend,
};
use mlxcel_mlx::{Array, Dtype};
use mlxcel_model::{AttentionPath, LoadOptions, Model, StepRow, WeightMode};

fn config() -> EngineConfig {
    let mut c = EngineConfig::new(model_dir());
    c.parallel = 4;
    c.kv_cache_budget = Some(256 << 20);
    c.check_invariants = true;
    c
}

fn long_request(prompt: Vec<u32>, max_tokens: usize) -> mlxcel_engine::api::GenerationRequest {
    let mut r = greedy_request(Prompt::Tokens(prompt), max_tokens);
    r.ignore_eos = true;
    r
}

/// Reads `n` deltas of a stream, keeping their tokens.
fn read_deltas(stream: &mut EventStream, n: usize) -> Vec<u32> {
    (0..n)
        .map(|_| match stream.blocking_recv() {
            Some(GenerationEvent::Delta { token, .. }) => token,
            other => panic!("expected a delta, got {other:?}"),
        })
        .collect()
}

/// Drains a stream into its tokens, or its failure message.
fn rest(stream: EventStream, mut head: Vec<u32>) -> Result<Vec<u32>, String> {
    let (tail, _) = collect_tokens(stream)?;
    head.extend(tail);
    Ok(head)
}

fn fault_run(panic: bool) {
    let poison = 49_000;
    let reference = Engine::start(config()).expect("engine");
    let ids = readme_tokens(&reference);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| ids[100 * i..100 * i + 40].to_vec())
        .collect();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            collect_tokens(
                reference
                    .submit(long_request(p.clone(), 24))
                    .expect("submit"),
            )
        })
        .map(|r| r.expect("reference").0)
        .collect();
    assert!(want.iter().all(|w| !w.contains(&poison)));
    drop(reference);

    let mut c = config();
    c.fault = FaultInjection {
        poison_token: Some(poison),
        panic,
        ..FaultInjection::default()
    };
    let e = Engine::start(c).expect("engine");
    // Three streams decoding...
    let mut streams: Vec<EventStream> = prompts
        .iter()
        .map(|p| e.submit(long_request(p.clone(), 24)).expect("submit"))
        .collect();
    let heads: Vec<Vec<u32>> = streams.iter_mut().map(|s| read_deltas(s, 2)).collect();
    // ...when a poisoned request joins: its steps fail.
    let mut poisoned = ids[500..530].to_vec();
    poisoned.push(poison);
    let bad = e.submit(long_request(poisoned, 24)).expect("submit");
    match collect_tokens(bad) {
        Err(message) => assert!(message.contains("injected"), "{message}"),
        Ok(t) => panic!("the poisoned request succeeded: {t:?}"),
    }
    for (i, (s, head)) in streams.into_iter().zip(heads).enumerate() {
        let got = rest(s, head).expect("a batch-mate of the failed request");
        assert_eq!(
            got, want[i],
            "stream {i} produced the tokens it would have alone"
        );
    }
    let stats = settled(&e);
    assert!(stats.failed_steps >= 1, "{stats:?}");
    assert_eq!(stats.kv_blocks_active, 0, "pool back to baseline");
    let (after, _) = collect_tokens(
        e.submit(long_request(prompts[0].clone(), 24))
            .expect("submit"),
    )
    .expect("the next request succeeds");
    assert_eq!(after, want[0]);
}

#[test]
fn a_failing_step_fails_only_its_request() {
    fault_run(false);
}

#[test]
fn a_panicking_step_fails_only_its_request() {
    fault_run(true);
}

/// Starts a tiny-model engine on `dir` whose `fail`-th pipelined read
/// fails (none: no fault), decodes `max_tokens` for each of `prompts` at
/// once, and returns the engine with the replies (every request must
/// succeed).
fn run_failing_pipelined_read(
    dir: &std::path::Path,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    fail: Option<u64>,
) -> (Engine, Vec<Vec<u32>>) {
    let mut c = common::tiny_engine_config(dir, 4);
    c.fault = FaultInjection {
        fail_pipelined_read: fail,
        ..FaultInjection::default()
    };
    let e = Engine::start(c).expect("engine");
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.submit(long_request(p.clone(), max_tokens))
                .expect("submit")
        })
        .collect();
    let replies = streams
        .into_iter()
        .map(|s| collect_tokens(s).expect("every request succeeds").0)
        .collect();
    (e, replies)
}

/// A pipelined decode step whose tokens fail to read (a device error
/// surfacing at the read) is rolled back with the step queued behind it,
/// and its rows rerun synchronously. On a sliding-window model (tiny
/// random-weight Gemma 3: a local layer of a 16-key window, past it after
/// the 40-token prompt) the rerun must attend to the keys a plain run
/// does: the window group's trim keeps the queued step's keys
/// (`KvCache::trim_keeping`), and with invariants checked a rollback that
/// lost one fails its request. Every reply matches the run without the
/// fault, wherever in the decode the read fails.
#[test]
fn a_failed_pipelined_read_reruns_over_the_same_window() {
    let dir = common::tiny_gemma3_dir("faults");
    let golden = common::parity::read_golden(&dir, "make_tiny_models.py");
    let prompt = common::parity::ids(&golden, "prompt");
    let prompts = [prompt.clone(), prompt[..24].to_vec()];
    let run = |fail: Option<u64>| {
        let (e, replies) = run_failing_pipelined_read(&dir, &prompts, 40, fail);
        (replies, settled(&e))
    };
    let (want, plain) = run(None);
    assert!(plain.pipelined_steps > 0, "{plain:?}");
    assert_eq!(plain.failed_steps, 0);
    for n in [2, 12, 30] {
        let (got, stats) = run(Some(n));
        assert_eq!(got, want, "the read of pipelined step {n} failed");
        assert_eq!(stats.failed_steps, 1, "{stats:?}");
        assert!(stats.pipelined_steps > n, "{stats:?}");
        assert_eq!(stats.kv_blocks_active, 0, "blocks conserved");
    }
}

/// A pipelined step's positions reach the prefix cache only after its
/// read: when the read fails and the step is rolled back, no cached block
/// (nor, on a hybrid model, recurrent snapshot) covers a position it
/// wrote. With invariants checked, a sequence that donated a block past
/// its rolled-back end fails ("donated blocks up to position ..."). The
/// failing read sweeps one block's worth of steps, so each row's queued
/// step fills a block at one of them; replies match the unfaulted run's,
/// and a second request on the first prompt plus its reply (a prefix hit
/// over the decoded blocks) answers as it does without the fault.
#[test]
fn a_failed_pipelined_read_leaves_no_block_it_wrote_in_the_prefix_cache() {
    for model in ["llama", "qwen3_5"] {
        let dir = common::tiny_model_dir(model, "faults-donate");
        let golden = common::parity::read_golden(&dir, "make_tiny_models.py");
        let prompt = common::parity::ids(&golden, "prompt");
        let prompts = [prompt.clone(), prompt[..21].to_vec()];
        let run = |fail: Option<u64>| {
            let (e, replies) = run_failing_pipelined_read(&dir, &prompts, 24, fail);
            let mut again = prompts[0].clone();
            again.extend(&replies[0]);
            let warm = collect_tokens(e.submit(long_request(again, 8)).expect("submit"))
                .expect("the warm request succeeds")
                .0;
            (replies, warm, settled(&e))
        };
        let (want, want_warm, plain) = run(None);
        assert!(plain.pipelined_steps > 8, "{model}: {plain:?}");
        assert!(plain.prefix_cache_hits > 0, "{model}: {plain:?}");
        for n in 1..=8 {
            let (got, warm, stats) = run(Some(n));
            assert_eq!(got, want, "{model}: the read of pipelined step {n} failed");
            assert_eq!(warm, want_warm, "{model}: warm after failed read {n}");
            assert_eq!(stats.failed_steps, 1, "{model}: {stats:?}");
            assert_eq!(stats.kv_blocks_active, 0, "{model}: blocks conserved");
        }
    }
}

#[test]
fn long_prompts_complete_under_a_small_kv_window_and_short_ones_are_unchanged() {
    let plain = Engine::start(config()).expect("engine");
    let ids = readme_tokens(&plain);
    assert!(ids.len() >= 1500, "README has {} tokens", ids.len());
    let short: Vec<Vec<u32>> = vec![ids[7..12].to_vec(), ids[50..70].to_vec()];
    let want: Vec<Vec<u32>> = short
        .iter()
        .map(|p| collect_tokens(plain.submit(long_request(p.clone(), 16)).expect("submit")))
        .map(|r| r.expect("run").0)
        .collect();
    drop(plain);

    let mut c = config();
    c.max_kv_size = Some(64);
    c.prefill_chunk_size = 16;
    let e = Engine::start(c).expect("engine");
    let long: Vec<Vec<u32>> = [100, 333, 700, 1500]
        .iter()
        .map(|&n| ids[..n].to_vec())
        .collect();
    let mut streams: Vec<EventStream> = Vec::new();
    for p in long.iter().chain(&short) {
        streams.push(e.submit(long_request(p.clone(), 16)).expect("submit"));
    }
    let outs: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| collect_tokens(s).expect("completes").0)
        .collect();
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(o.len(), 16, "request {i} completed");
    }
    assert_eq!(
        &outs[4..],
        &want[..],
        "untrimmed requests are unchanged by the flag"
    );
    let stats = settled(&e);
    assert_eq!(stats.kv_blocks_active, 0);
    assert_eq!(stats.failed_steps, 0);
}

/// An [`AttentionKv`] that records the key counts reads return.
struct Recording<'a, K: AttentionKv> {
    inner: &'a mut K,
    reads: Vec<usize>,
}

impl<K: AttentionKv> AttentionKv for Recording<'_, K> {
    fn num_rows(&self) -> usize {
        self.inner.num_rows()
    }
    fn new_positions(&self, row: usize) -> Range<usize> {
        self.inner.new_positions(row)
    }
    fn write(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<(), KvError> {
        self.inner.write(layer, keys, values)
    }
    fn read(&mut self, layer: usize, row: usize) -> Result<(Array, Array), KvError> {
        let (k, v) = self.inner.read(layer, row)?;
        self.reads.push(k.dim(2)? as usize);
        Ok((k, v))
    }
    fn read_padded(
        &mut self,
        layer: usize,
        rows: &[usize],
    ) -> Result<Option<(Array, Array, Vec<usize>)>, KvError> {
        let out = self.inner.read_padded(layer, rows)?;
        if let Some((_, _, lens)) = &out {
            self.reads.extend(lens);
        }
        Ok(out)
    }
    fn storage(&self) -> Vec<&Array> {
        self.inner.storage()
    }
}

/// Runs `tokens` as one row and returns the key counts attention read.
fn run_row(model: &dyn Model, kv: &mut KvCache, seq: &KvSequence, tokens: &[u32]) -> Vec<usize> {
    let n = tokens.len();
    let res = kv
        .reserve_step(&[RowReserve {
            seq,
            real: n,
            padded: n,
        }])
        .expect("reserve");
    let reads = {
        let mut view = kv.step(&[(seq, n)]).expect("view");
        let mut rec = Recording {
            inner: &mut view,
            reads: Vec::new(),
        };
        let rows = [StepRow::tokens(tokens, Some(n - 1))];
        model
            .forward(&rows, &mut rec, AttentionPath::BatchedDecode)
            .expect("forward after a front trim");
        rec.reads
    };
    kv.complete_step(res, true).expect("complete");
    reads
}

#[test]
fn after_a_front_trim_masks_use_the_live_key_count() {
    let dir = model_dir();
    let config = mlxcel_engine::loader::read_config(&dir).expect("config");
    let layers = config.num_hidden_layers;
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let model = mlxcel_engine::loader::load_model(&dir, config, options).expect("model");
    for backend in [StorageBackend::Dense, StorageBackend::Paged] {
        let mut kv = KvCache::new(KvCacheConfig {
            layout: model.kv_layout(),
            block_size: 32,
            num_blocks: 16,
            backend,
            prefix: None,
        })
        .expect("kv");
        let seq = kv.new_sequence();
        let prompt: Vec<u32> = (1..=100).collect();
        run_row(model.as_ref(), &mut kv, &seq, &prompt);
        kv.drop_front(&seq, 100 - 64).expect("trim");
        assert_eq!((kv.len(&seq).unwrap(), kv.end(&seq).unwrap()), (64, 100));
        // A 16-token chunk after the trim: 64 + 16 live keys, not 116.
        let reads = run_row(model.as_ref(), &mut kv, &seq, &prompt[..16]);
        assert_eq!(
            reads,
            vec![80; layers],
            "{backend}: chunk reads the live keys"
        );
        kv.drop_front(&seq, 116 - 64).expect("trim");
        // One decode token: 65 live keys (the batched path on paged).
        let reads = run_row(model.as_ref(), &mut kv, &seq, &[5]);
        assert_eq!(
            reads,
            vec![65; layers],
            "{backend}: decode reads the live keys"
        );
        assert_eq!(kv.end(&seq).unwrap(), 117, "positions keep counting");
    }
}

#[test]
fn a_sliding_window_gives_the_same_tokens_whatever_the_chunking() {
    // SmolLM2 with a 48-token window written into a copy of its config:
    // chunks of 512 rely on the banded mask, chunks of 16 on the KV trim.
    let src = model_dir();
    let dir = std::env::temp_dir().join(format!("mlxcel-window-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for entry in std::fs::read_dir(&src).expect("model dir") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("name").to_owned();
        if name != "config.json" {
            let link = dir.join(&name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&path, &link).expect("symlink");
        }
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config"))
            .expect("json");
    cfg["sliding_window"] = serde_json::json!(48);
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("write config");
    let run = |chunk: usize| {
        let mut c = EngineConfig::new(dir.clone());
        c.parallel = 2;
        c.kv_cache_budget = Some(128 << 20);
        c.check_invariants = true;
        c.prefill_chunk_size = chunk;
        let e = Engine::start(c).expect("engine");
        let ids = readme_tokens(&e);
        let out = collect_tokens(
            e.submit(long_request(ids[..200].to_vec(), 24))
                .expect("submit"),
        )
        .expect("run")
        .0;
        let stats = settled(&e);
        assert_eq!(stats.kv_blocks_active, 0);
        out
    };
    let whole = run(512);
    let chunked = run(16);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(whole, chunked);
}

#[test]
fn a_prefix_hit_under_a_kv_window_answers_like_a_cold_run() {
    let mut c = config();
    c.max_kv_size = Some(64);
    c.prefill_chunk_size = 64;
    let e = Engine::start(c).expect("engine");
    let ids = readme_tokens(&e);
    for n in [300, 320] {
        let prompt = ids[..n].to_vec();
        let mut cold = long_request(prompt.clone(), 16);
        cold.cache_prompt = false;
        let (want, _) = collect_tokens(e.submit(cold).expect("submit")).expect("cold");
        let (first, _) =
            collect_tokens(e.submit(long_request(prompt.clone(), 16)).expect("submit"))
                .expect("first");
        let (warm, usage) =
            collect_tokens(e.submit(long_request(prompt, 16)).expect("submit")).expect("warm");
        assert!(
            usage.cached_tokens >= 256,
            "{n}: {} cached",
            usage.cached_tokens
        );
        assert_eq!(first, want, "{n}: first cached run");
        assert_eq!(
            warm, want,
            "{n}: a hit starts from the window a cold run has"
        );
    }
    assert_eq!(settled(&e).kv_blocks_active, 0);
}
