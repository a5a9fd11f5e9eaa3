//! The prefix cache on the real model (docs/architecture.md invariants 5 and 7):
//! the same answer warm or cold, one copy of a shared prefix, blocks
//! conserved, reset empties the pool.

mod common;

use common::{collect_tokens, greedy_request, model_dir, readme_tokens, settled};
use mlxcel_engine::api::{ChatMessage, InferenceService, Prompt};
use mlxcel_engine::scheduler::{plan_step, SchedulerConfig, SeqProgress};
use mlxcel_engine::{Engine, EngineConfig};
use mlxcel_kv::{KvCache, KvCacheConfig, PrefixCacheConfig, RowReserve, StorageBackend};
use mlxcel_mlx::Dtype;
use mlxcel_model::{AttentionPath, LoadOptions, Model, StepRow, WeightMode};

/// Prompt lengths around block (32) multiples, as the issue asks.
const LENGTHS: &[usize] = &[31, 32, 33, 64, 65, 200];

fn engine(prefix_cache: bool) -> Engine {
    let mut c = EngineConfig::new(model_dir());
    c.parallel = 4;
    c.kv_cache_budget = Some(256 << 20);
    c.prefix_cache = prefix_cache;
    c.check_invariants = true;
    Engine::start(c).expect("engine")
}

/// Runs `prompt` through `model` the way the engine does (chunks on the
/// 512-token grid from what the cache already holds) and returns the last
/// position's logits; donates the blocks when `cache` is set.
fn prefill(model: &dyn Model, kv: &mut KvCache, prompt: &[u32], cache: bool) -> (Vec<f32>, usize) {
    let (seq, cached) = if cache {
        kv.new_sequence_for_prompt(prompt).expect("lookup")
    } else {
        (kv.new_sequence(), 0)
    };
    let mut computed = cached;
    let config = SchedulerConfig {
        snapshot_block: 0,
        prefill_chunk_size: 512,
        prefill_tile: 0,
    };
    loop {
        let plan = plan_step(
            &[SeqProgress {
                known: prompt.len(),
                computed,
                scored: false,
                donates: true,
            }],
            config,
        );
        let row = plan.rows[0];
        let tokens = &prompt[computed..computed + row.real];
        let reservation = kv
            .reserve_step(&[RowReserve {
                seq: &seq,
                real: row.real,
                padded: row.real,
            }])
            .expect("reserve");
        let logits = {
            let mut view = kv.step(&[(&seq, row.real)]).expect("view");
            let rows = [StepRow::tokens(tokens, row.sample.then(|| row.real - 1))];
            model
                .forward(&rows, &mut view, AttentionPath::PerRow)
                .expect("forward")
        };
        kv.complete_step(reservation, true).expect("complete");
        computed += row.real;
        if cache {
            kv.donate(&seq, &prompt[..computed]).expect("donate");
        }
        if row.sample {
            return (logits.to_vec_f32().expect("logits"), cached);
        }
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::MIN),
            |(bi, bv), (i, &x)| if x > bv { (i, x) } else { (bi, bv) },
        )
        .0
}

/// The test model in float32, its weights dequantized.
fn float32_model() -> Box<dyn Model> {
    let dir = model_dir();
    let config = mlxcel_engine::loader::read_config(&dir).expect("config");
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    mlxcel_engine::loader::load_model(&dir, config, options).expect("model")
}

#[test]
fn warm_logits_match_cold_logits() {
    let model = float32_model();
    let mut kv = KvCache::new(KvCacheConfig {
        layout: model.kv_layout(),
        block_size: 32,
        num_blocks: 128,
        backend: StorageBackend::Paged,
        prefix: Some(PrefixCacheConfig {
            extra_key: 1,
            capacity_blocks: 128,
        }),
    })
    .expect("kv");
    let engine = engine(false);
    let ids = readme_tokens(&engine);
    drop(engine);
    let mut worst = 0f32;
    for &n in LENGTHS {
        let prompt = &ids[..n];
        let (cold, _) = prefill(model.as_ref(), &mut kv, prompt, false);
        prefill(model.as_ref(), &mut kv, prompt, true);
        let (warm, cached) = prefill(model.as_ref(), &mut kv, prompt, true);
        kv.reclaim().expect("reclaim");
        assert_eq!(
            cached,
            (n / 32 * 32).min(n - 1),
            "{n}: tokens from the cache"
        );
        let diff = cold
            .iter()
            .zip(&warm)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{n} tokens: {cached} cached, largest |cold - warm| logit difference {diff:e}");
        assert_eq!(argmax(&cold), argmax(&warm), "{n}: same greedy token");
        assert!(diff < 1e-3, "{n}: logits differ by {diff}");
        worst = worst.max(diff);
    }
    eprintln!("largest cold/warm logit difference over all prompts: {worst:e}");
}

/// Quantized K/V (`--kv-cache-dtype int8/int4`) keep invariant 5: a
/// prefix hit answers as the cold run (the cold run attends to the same
/// stored blocks; its logits move by at most a quantization step's
/// effect), and an engine's greedy answers are the same batched and
/// alone. Against full-precision K/V the logits move, by an amount
/// printed and bounded here (docs/kv-quantization.md has the measurement
/// on the three real checkpoints).
#[test]
fn quantized_kv_answers_warm_as_cold_batched_as_alone_and_near_float_kv() {
    use mlxcel_kv::{KvCacheDtype, KvLayout};
    let model = float32_model();
    let cache = |kv_dtype| {
        KvCache::new(KvCacheConfig {
            layout: KvLayout {
                kv_dtype,
                ..model.kv_layout()
            },
            block_size: 32,
            num_blocks: 128,
            backend: StorageBackend::Paged,
            prefix: Some(PrefixCacheConfig {
                extra_key: 1,
                capacity_blocks: 128,
            }),
        })
        .expect("kv")
    };
    let mut c = EngineConfig::new(model_dir());
    c.parallel = 4;
    c.kv_cache_budget = Some(64 << 20);
    c.kv_cache_dtype = KvCacheDtype::Int8;
    c.check_invariants = true;
    let engine = Engine::start(c).expect("engine");
    assert_eq!(engine.stats().kv_cache_dtype, "int8");
    assert_eq!(engine.stats().kv_storage_backend, "paged");
    let ids = readme_tokens(&engine);
    let mut float = cache(KvCacheDtype::Auto);
    // Largest logit difference from float K/V allowed, and between warm
    // and cold runs (measured: see the printed values; the logits span
    // about 30).
    for (kv_dtype, bound, warm_bound) in [
        (KvCacheDtype::Int8, 0.5, INT8_WARM_BOUND),
        (KvCacheDtype::Int4, 8.0, 3.0),
    ] {
        let mut kv = cache(kv_dtype);
        for n in [33, 65, 200] {
            let prompt = &ids[..n];
            let (exact, _) = prefill(model.as_ref(), &mut float, prompt, false);
            let (cold, _) = prefill(model.as_ref(), &mut kv, prompt, false);
            prefill(model.as_ref(), &mut kv, prompt, true);
            let (warm, cached) = prefill(model.as_ref(), &mut kv, prompt, true);
            kv.reclaim().expect("reclaim");
            float.reclaim().expect("reclaim");
            assert_eq!(cached, (n / 32 * 32).min(n - 1), "{kv_dtype} {n}: hit");
            let diff = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max)
            };
            let (same, off) = (diff(&cold, &warm), diff(&cold, &exact));
            eprintln!(
                "{kv_dtype} {n} tokens: |cold - warm| {same:e}, |{kv_dtype} - float K/V| {off}, \
                 greedy {} vs {}",
                argmax(&cold),
                argmax(&exact)
            );
            assert_eq!(argmax(&cold), argmax(&warm), "{kv_dtype} {n}: warm == cold");
            // The last chunk's K/V of a warm run come from a matmul of
            // another shape than the cold run's: a float ulp there can move
            // a value across a rounding boundary of the quantizer (one step:
            // 1/255 or 1/15 of a group's range), so warm and cold agree
            // within a quantization step's effect, not float noise
            // (measured on a Xeon with AVX-512: int8 0.13 at 65 tokens,
            // where the warm run's last token goes through GEMV and the
            // cold run's 65 through OpenBLAS, and 0.18 at 200; int4 2.0 and
            // 2.3; the earlier bound, a quarter of `bound`, was measured on
            // another machine and 0.13 exceeds it).
            assert!(
                same < warm_bound,
                "{kv_dtype} {n}: warm logits differ by {same}"
            );
            assert!(
                off > 0.0 && off < bound,
                "{kv_dtype} {n}: {off} from float K/V (bound {bound})"
            );
        }
    }
    // The int8 engine: 4 prompts at once answer as each alone, up to a
    // tie. A batched prompt's K/V come from products of other shapes than
    // its alone run's (OpenBLAS picks its kernel by the row count), so a
    // float ulp can move a value across a quantizer boundary, as between
    // warm and cold above. The runs sample on the device, pipelined, as
    // any greedy request does. Where a prompt's two answers part, its
    // alone run is repeated with logprobs (sampled on the host, the same
    // tokens): there batched's token must be among its five most likely,
    // less than INT8_WARM_BOUND below alone's (a strict bound: logits that
    // each move by up to the bound could swap tokens twice as far apart).
    // Measured: identical on a Xeon with AVX-512; on an AMD EPYC
    // (2026-12-08) prompt 2 parts at token 12 (batched took alone's second
    // token, 0.0003 below) and prompt 3 at token 4 (0.078 below).
    let prompts: Vec<Prompt> = [40, 90, 150, 260]
        .iter()
        .map(|&n| Prompt::Tokens(ids[300..300 + n].to_vec()))
        .collect();
    let run = |p: &Prompt, logprobs: Option<usize>| {
        let mut r = greedy_request(p.clone(), 16);
        r.ignore_eos = true;
        r.cache_prompt = false;
        r.logprobs = logprobs;
        r
    };
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| engine.submit(run(p, None)).expect("submit"))
        .collect();
    let together: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| collect_tokens(s).expect("run").0)
        .collect();
    let mut parted = 0;
    for (i, p) in prompts.iter().enumerate() {
        let (alone, _) = collect_tokens(engine.submit(run(p, None)).expect("submit")).expect("run");
        assert_eq!(alone.len(), 16, "prompt {i}: alone ran 16 tokens");
        assert_eq!(together[i].len(), 16, "prompt {i}: batched ran 16 tokens");
        let Some(at) = (0..16).find(|&t| alone[t] != together[i][t]) else {
            continue;
        };
        parted += 1;
        let traced = traced_tokens(engine.submit(run(p, Some(5))).expect("submit"));
        let got: Vec<u32> = traced.iter().map(|t| t.0).collect();
        assert_eq!(got, alone, "prompt {i}: alone with logprobs == alone");
        let top = &traced[at].1;
        assert_eq!(top.len(), 5, "prompt {i}: five alternatives");
        assert_eq!(top[0].0, alone[at], "prompt {i}: alone took its top token");
        let Some(&(_, batched_lp)) = top.iter().find(|t| t.0 == together[i][at]) else {
            panic!(
                "prompt {i}: batched took {} at token {at}, not among alone's top five {top:?}",
                together[i][at]
            )
        };
        let gap = top[0].1 - batched_lp;
        eprintln!(
            "int8 prompt {i}: batched parts from alone at token {at}: {} vs {}, \
             alone's top five {top:?} (gap {gap})",
            together[i][at], alone[at]
        );
        assert!(
            gap < INT8_WARM_BOUND,
            "prompt {i}: batched parts from alone at token {at} where alone's margin is {gap}"
        );
    }
    // A tie is a prompt's accident, not every prompt's: at least one must
    // answer batched exactly as alone.
    assert!(
        parted < prompts.len(),
        "every prompt parted batched from alone"
    );
}

/// The largest logit difference allowed between a warm and a cold int8
/// run (measured: 0.13 at 65 tokens, 0.18 at 200), and the largest margin
/// at which a batched int8 answer may part from its alone run.
const INT8_WARM_BOUND: f32 = 0.25;

/// A request's tokens, each with its alternatives (id, logprob), most
/// likely first.
type Traced = Vec<(u32, Vec<(u32, f32)>)>;

/// Drains a stream of a request with logprobs into its [`Traced`] tokens.
fn traced_tokens(mut stream: mlxcel_engine::api::EventStream) -> Traced {
    use mlxcel_engine::api::GenerationEvent;
    let mut out = Vec::new();
    while let Some(event) = stream.blocking_recv() {
        match event {
            GenerationEvent::Delta {
                token,
                logprobs: Some(l),
                ..
            } => out.push((token, l.top.iter().map(|t| (t.id, t.logprob)).collect())),
            GenerationEvent::Finished { .. } => return out,
            GenerationEvent::Failed { message, .. } => panic!("{message}"),
            other => panic!("unexpected event {other:?}"),
        }
    }
    panic!("the stream ended without Finished")
}

#[test]
fn greedy_answers_are_the_same_cold_warm_opted_out_and_disabled() {
    let on = engine(true);
    let ids = readme_tokens(&on);
    let prompts: Vec<Prompt> = LENGTHS
        .iter()
        .map(|&n| Prompt::Tokens(ids[..n].to_vec()))
        .collect();
    let run = |e: &Engine, p: &Prompt, cache: bool| {
        let mut r = greedy_request(p.clone(), 24);
        r.cache_prompt = cache;
        collect_tokens(e.submit(r).expect("submit")).expect("run")
    };
    // Runs that read no cache are batched (a reply doesn't depend on what
    // runs beside it: tests/batching.rs).
    let all = |e: &Engine, cache: bool| {
        let streams: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut r = greedy_request(p.clone(), 24);
                r.cache_prompt = cache;
                e.submit(r).expect("submit")
            })
            .collect();
        streams
            .into_iter()
            .map(|s| collect_tokens(s).expect("run"))
            .collect::<Vec<_>>()
    };
    let off = engine(false);
    assert!(!off.stats().prefix_cache_enabled);
    let disabled_all = all(&off, true);
    let opted_out_all = all(&on, false);
    for (i, (p, &n)) in prompts.iter().zip(LENGTHS).enumerate() {
        let (disabled, _) = disabled_all[i].clone();
        let (opted_out, u0) = opted_out_all[i].clone();
        let (cold, u1) = run(&on, p, true);
        let (warm, u2) = run(&on, p, true);
        assert_eq!(u0.cached_tokens, 0, "{n}: cache_prompt false reads nothing");
        assert_eq!(
            u2.cached_tokens,
            (n / 32 * 32).min(n - 1),
            "{n}: replay hits"
        );
        assert!(u1.cached_tokens <= u2.cached_tokens);
        assert_eq!(cold, disabled, "{n}: cold == --no-prompt-cache");
        assert_eq!(opted_out, disabled, "{n}: cache_prompt false == disabled");
        assert_eq!(
            warm, disabled,
            "{n}: warm (whole-prompt replay) == disabled"
        );
    }
    let s = settled(&on);
    assert_eq!(s.kv_blocks_active, 0);
    assert_eq!(
        s.kv_blocks_used, s.kv_blocks_cached,
        "after all end, used == cached"
    );
}

#[test]
fn concurrent_requests_share_one_copy_of_a_system_prompt_and_reset_empties_the_pool() {
    let e = engine(true);
    let ids = readme_tokens(&e);
    let system = ids[..200].to_vec();
    // 8 prompts: the same 200 tokens, then 20 distinct ones each.
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| {
            let mut p = system.clone();
            p.extend(&ids[400 + 20 * i..420 + 20 * i]);
            p
        })
        .collect();
    let max_tokens = 8;
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut r = greedy_request(Prompt::Tokens(p.clone()), max_tokens);
            r.ignore_eos = true;
            e.submit(r).expect("submit")
        })
        .collect();
    let outs: Vec<_> = streams
        .into_iter()
        .map(|s| collect_tokens(s).expect("run"))
        .collect();
    let s = settled(&e);
    // Positions with K/V: the prompt and all completion tokens but the last.
    let computed = 220 + max_tokens - 1;
    let shared = 200 / 32;
    let want = shared + 8 * (computed / 32 - shared);
    assert_eq!(
        s.kv_blocks_cached, want,
        "{shared} shared system-prompt blocks held once, plus each request's own"
    );
    assert_eq!(s.kv_blocks_used, s.kv_blocks_cached);
    assert_eq!(s.kv_blocks_active, 0);
    for (_, usage) in &outs {
        assert_eq!(usage.prompt_tokens, 220);
    }
    // Reset: everything was unreferenced, so the pool empties.
    let reset = e.reset_prefix_cache(false).expect("reset");
    assert_eq!(reset.blocks_freed, want);
    let s = e.stats();
    assert_eq!((s.kv_blocks_used, s.kv_blocks_cached), (0, 0));
    assert_eq!(
        e.reset_prefix_cache(false).expect("again").blocks_freed,
        0,
        "idempotent"
    );
    // A request right after answers as before, from a cold cache.
    let mut r = greedy_request(Prompt::Tokens(prompts[0].clone()), max_tokens);
    r.ignore_eos = true;
    let (again, usage) = collect_tokens(e.submit(r).expect("submit")).expect("run");
    assert_eq!(usage.cached_tokens, 0);
    assert_eq!(again, outs[0].0);
}

#[test]
fn a_three_turn_chat_hits_its_earlier_turns() {
    let e = engine(true);
    let mut messages = vec![ChatMessage::text(
        "system",
        "You are a concise assistant. Answer in one sentence.",
    )];
    let mut last_prompt_len = 0;
    let mut reused_before = e.stats().prefix_cache_tokens_reused;
    for (turn, question) in [
        "What is the capital of France?",
        "And of Italy?",
        "And of Spain?",
    ]
    .iter()
    .enumerate()
    {
        messages.push(ChatMessage::text("user", *question));
        let (answer, usage) = chat_turn(&e, &messages);
        let reused = e.stats().prefix_cache_tokens_reused;
        if turn > 0 {
            assert!(
                usage.cached_tokens >= last_prompt_len / 32 * 32,
                "turn {}: {} cached, earlier turns hold {last_prompt_len} prompt tokens",
                turn + 1,
                usage.cached_tokens
            );
            assert!(usage.cached_tokens < usage.prompt_tokens);
        }
        assert_eq!(
            (reused - reused_before) as usize,
            usage.cached_tokens,
            "stats move by what usage reports"
        );
        reused_before = reused;
        last_prompt_len = usage.prompt_tokens;
        messages.push(ChatMessage::text("assistant", answer));
    }
}

/// One greedy chat turn: the answer's text and the usage.
fn chat_turn(e: &Engine, messages: &[ChatMessage]) -> (String, mlxcel_engine::api::Usage) {
    use mlxcel_engine::api::GenerationEvent;
    let mut stream = e
        .submit(greedy_request(Prompt::Chat(messages.to_vec()), 24))
        .expect("submit");
    let mut text = String::new();
    while let Some(event) = stream.blocking_recv() {
        match event {
            GenerationEvent::Delta { text: t, .. } => text.push_str(&t),
            GenerationEvent::Finished { usage, .. } => return (text, usage),
            GenerationEvent::Failed { message, .. } => panic!("failed: {message}"),
            other @ (GenerationEvent::PromptLogprobs { .. }
            | GenerationEvent::ToolCallStart { .. }
            | GenerationEvent::ToolCallArguments { .. }
            | GenerationEvent::Embedding { .. }) => {
                panic!("unexpected tool call {other:?}")
            }
        }
    }
    panic!("stream ended without Finished")
}

/// Invariant 5 with KV groups: a prompt longer than the local layers'
/// window answers the same from the prefix cache as cold (and as mlx_lm),
/// and so does a longer conversation that reuses it; the window group
/// serves its part of the hit from the blocks a cold run would hold.
#[test]
fn a_prefix_hit_on_kv_groups_answers_like_a_cold_run_and_like_mlx_lm() {
    let dir = common::tiny_gemma3_dir("groups");
    let golden = common::parity::read_golden(&dir, "make_tiny_models.py");
    let ids = |key: &str| common::parity::ids(&golden, key);
    let (prompt, want) = (ids("prompt"), ids("greedy"));
    assert!(prompt.len() > 16, "the prompt runs past the window");
    let e = Engine::start(common::tiny_engine_config(&dir, 2)).expect("engine");
    let run = |prompt: &[u32], cache: bool| {
        let mut r = greedy_request(Prompt::Tokens(prompt.to_vec()), want.len());
        r.ignore_eos = true;
        r.cache_prompt = cache;
        collect_tokens(e.submit(r).expect("submit")).expect("run")
    };
    let (cold, _) = run(&prompt, false);
    assert_eq!(cold, want, "cold = mlx_lm");
    let (first, _) = run(&prompt, true);
    assert_eq!(first, want, "first cached run");
    let (warm, usage) = run(&prompt, true);
    assert_eq!(usage.cached_tokens, prompt.len() - 1, "a whole-prompt hit");
    assert_eq!(warm, want, "warm = cold");
    // The next turn: the prompt, part of its answer, and more.
    let mut longer = prompt.clone();
    longer.extend(&want[..8]);
    longer.extend(&prompt[..5]);
    let (cold, _) = run(&longer, false);
    let (warm, usage) = run(&longer, true);
    assert!(usage.cached_tokens >= 40, "{} cached", usage.cached_tokens);
    assert_eq!(warm, cold, "a longer prompt from the cache");
    let stats = settled(&e);
    assert_eq!(stats.kv_blocks_active, 0);
    assert!(stats.prefix_cache_hits >= 2);
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}
