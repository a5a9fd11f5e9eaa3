//! Speculative decoding with prompt lookup (`--speculative ngram`) on the
//! real model: with greedy sampling every reply is the one decoding
//! without speculation gives, token for token, alone and batched, on dense
//! and paged storage, cold and warm prefix cache, with stop strings and
//! with `max_tokens` landing inside an accepted run; drafts are really
//! proposed and accepted (the prompts ask for code and text to be copied
//! back); every block returns; a request can opt out.
//!
//! The reference is the same model without speculation (`--parallel 1`,
//! dense storage), whose greedy tokens `tests/batching.rs` holds to
//! mlx_lm's goldens.

mod common;

use common::{collect_tokens, greedy_request, model_dir, settled};
use mlxcel_engine::api::{ChatMessage, EngineStats, InferenceService, Prompt};
use mlxcel_engine::{Engine, EngineConfig, SpeculativeConfig, SpeculativeMethod, StorageBackend};

/// Replies long enough for several verifications.
const MAX_TOKENS: usize = 40;

const CODE: &str = "def total_price(items, tax):\n    total = 0\n    for item in items:\n        total += item.price * item.count\n    total = total * (1 + tax)\n    return round(total, 2)\n\n\ndef describe(items):\n    lines = []\n    for item in items:\n        lines.append(f\"{item.name}: {item.count} x {item.price}\")\n    return \"\\n\".join(lines)\n";

const TEXT: &str = "The quick brown fox jumps over the lazy dog. The dog does not move; it sleeps in the warm afternoon sun while the fox runs back into the forest.";

fn prompts() -> Vec<Prompt> {
    let chat = |content: String| Prompt::Chat(vec![ChatMessage::text("user", content)]);
    vec![
        chat(format!(
            "Rename `total` to `acc` in this code and print the whole code.\n\n```python\n{CODE}```"
        )),
        chat(format!(
            "Repeat this text exactly, word for word:\n\n{TEXT}"
        )),
        chat(format!(
            "Add a docstring to each function and print the whole code.\n\n```python\n{CODE}```"
        )),
        chat("What is the capital of France? Answer in one sentence.".into()),
        Prompt::Text(format!("{TEXT}\n{TEXT}\n")),
    ]
}

fn engine(speculative: bool, parallel: usize, backend: StorageBackend) -> Engine {
    engine_with(speculative, parallel, backend, false)
}

/// [`engine`], verifying inside the decode pipeline when `pipelined`
/// (`--pipelined-verification`).
fn engine_with(
    speculative: bool,
    parallel: usize,
    backend: StorageBackend,
    pipelined: bool,
) -> Engine {
    let mut c = EngineConfig::new(model_dir());
    c.pipelined_verification = pipelined;
    c.parallel = parallel;
    c.storage_backend = Some(backend);
    c.prefill_tile = Some(0);
    c.kv_cache_budget = Some(128 << 20);
    c.check_invariants = true;
    c.speculative = ngram_or_off(speculative, 6);
    Engine::start(c).expect("engine")
}

/// Prompt lookup with drafts of up to `num_tokens` tokens, or none.
fn ngram_or_off(speculative: bool, num_tokens: usize) -> SpeculativeConfig {
    SpeculativeConfig {
        method: if speculative {
            SpeculativeMethod::Ngram
        } else {
            SpeculativeMethod::Off
        },
        num_tokens,
        ..SpeculativeConfig::default()
    }
}

fn run(engine: &Engine, prompt: &Prompt, max_tokens: usize, stop: &[&str]) -> Vec<u32> {
    let mut r = greedy_request(prompt.clone(), max_tokens);
    r.stop = stop.iter().map(|s| s.to_string()).collect();
    let stream = engine.submit(r).expect("submit");
    collect_tokens(stream).expect("run").0
}

/// Submits every prompt at once and returns the replies in prompt order.
fn run_concurrently(engine: &Engine, prompts: &[Prompt], max_tokens: usize) -> Vec<Vec<u32>> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(greedy_request(p.clone(), max_tokens))
                .expect("submit")
        })
        .collect();
    streams
        .into_iter()
        .map(|s| collect_tokens(s).expect("run").0)
        .collect()
}

/// The first `n` tokens of a reply (all of a shorter one).
fn first(reply: &[u32], n: usize) -> Vec<u32> {
    reply[..n.min(reply.len())].to_vec()
}

fn speculation(stats: &EngineStats) -> (u64, u64, u64) {
    (
        stats.speculative_verifications,
        stats.speculative_proposed_tokens,
        stats.speculative_accepted_tokens,
    )
}

#[test]
fn greedy_replies_are_identical_with_prompt_lookup() {
    let prompts = prompts();
    let reference_engine = engine(false, 1, StorageBackend::Dense);
    let reference: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| run(&reference_engine, p, MAX_TOKENS, &[]))
        .collect();
    // Stop strings end a reply at the same token (a later word of the
    // repeated text, inside a copied run).
    let stop = ["sleeps"];
    let reference_stopped = run(&reference_engine, &prompts[1], MAX_TOKENS, &stop);
    assert!(
        reference_stopped.len() < reference[1].len(),
        "the stop string must cut the reply: {reference_stopped:?}"
    );
    assert_eq!(speculation(&settled(&reference_engine)), (0, 0, 0));
    drop(reference_engine);

    // Verifying synchronously (the default) and inside the decode
    // pipeline (`--pipelined-verification`).
    for pipelined in [false, true] {
        check_prompt_lookup(&prompts, &reference, &reference_stopped, pipelined);
    }
}

/// [`greedy_replies_are_identical_with_prompt_lookup`] with verification
/// inside the decode pipeline or not: every reply is the reference's.
fn check_prompt_lookup(
    prompts: &[Prompt],
    reference: &[Vec<u32>],
    reference_stopped: &[u32],
    pipelined: bool,
) {
    let stop = ["sleeps"];
    // Alone, dense storage.
    let dense = engine_with(true, 1, StorageBackend::Dense, pipelined);
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(
            run(&dense, p, MAX_TOKENS, &[]),
            reference[i],
            "prompt {i}, dense, pipelined {pipelined}"
        );
    }
    assert_eq!(
        run(&dense, &prompts[1], MAX_TOKENS, &stop),
        reference_stopped,
        "stopped, pipelined {pipelined}"
    );
    let stats = settled(&dense);
    let (verified, proposed, accepted) = speculation(&stats);
    assert!(
        verified > 0 && accepted > 0 && accepted <= proposed,
        "drafts proposed and accepted: {:?}",
        speculation(&stats)
    );
    assert_eq!(stats.kv_blocks_active, 0, "dense: blocks conserved");
    eprintln!(
        "alone, pipelined {pipelined}: (verifications, proposed, accepted) = {:?}, pipelined verify steps {}, discarded {}",
        speculation(&stats),
        stats.pipelined_verify_steps,
        stats.discarded_steps
    );
    // With `pipelined`, verification runs inside the decode pipeline (the
    // replies above are the reference's): steps queued behind another one,
    // and some of them discarded after a rejected draft. Without, none.
    if pipelined {
        assert!(
            stats.pipelined_verify_steps > 0 && stats.discarded_steps > 0,
            "pipelined verification: {stats:?}"
        );
    } else {
        assert_eq!(
            (stats.pipelined_verify_steps, stats.discarded_steps),
            (0, 0)
        );
    }
    // A request that opts out verifies nothing.
    let mut r = greedy_request(prompts[1].clone(), MAX_TOKENS);
    r.speculative = false;
    let opted_out = collect_tokens(dense.submit(r).expect("submit"))
        .expect("run")
        .0;
    assert_eq!(opted_out, reference[1]);
    assert_eq!(speculation(&settled(&dense)).0, verified, "opted out");
    drop(dense);

    // Batched, paged storage, cold then warm prefix cache.
    let paged = engine_with(true, 4, StorageBackend::Paged, pipelined);
    let cold = run_concurrently(&paged, prompts, MAX_TOKENS);
    let warm = run_concurrently(&paged, prompts, MAX_TOKENS);
    for (i, want) in reference.iter().enumerate() {
        assert_eq!(
            &cold[i], want,
            "prompt {i}, batched, cold, pipelined {pipelined}"
        );
        assert_eq!(
            &warm[i], want,
            "prompt {i}, batched, warm, pipelined {pipelined}"
        );
    }
    // max_tokens landing anywhere in an accepted run (the prompts come
    // from the prefix cache now).
    for n in [1, 2, 5, 11, 17] {
        for i in [0, 1] {
            assert_eq!(
                run(&paged, &prompts[i], n, &[]),
                first(&reference[i], n),
                "prompt {i}, max_tokens {n}, pipelined {pipelined}"
            );
        }
    }
    let stats = settled(&paged);
    assert!(stats.prefix_cache_hits > 0, "the warm round hit the cache");
    assert!(
        stats.speculative_accepted_tokens > 0,
        "batched rows verified drafts: {:?}",
        speculation(&stats)
    );
    assert_eq!(stats.kv_blocks_active, 0, "paged: blocks conserved");
    eprintln!(
        "batched, pipelined {pipelined}: (verifications, proposed, accepted) = {:?}, pipelined verify steps {}, discarded {}",
        speculation(&stats),
        stats.pipelined_verify_steps,
        stats.discarded_steps
    );
    assert_eq!(
        stats.pipelined_verify_steps > 0,
        pipelined,
        "batched rows verified inside the pipeline: {stats:?}"
    );
}

/// KV groups (a local layer of a 16-key window beside a global layer, tiny
/// random-weight Gemma 3): verification rows run past the window, and
/// the rejected drafts are truncated from both groups; batched rows of
/// several prompts (one repeating itself, so drafts are proposed), small
/// blocks and chunks, a warm round from the prefix cache. Prompt lookup
/// over a random model's output is nearly always rejected (its decode
/// pipelines between verifications); the model as its own draft
/// (`--speculative draft`) is nearly always accepted, so both the kept
/// and the truncated drafts cross the window.
#[test]
fn kv_groups_give_the_same_greedy_tokens_when_speculating() {
    let dir = common::tiny_gemma3_dir("speculative");
    let golden = common::parity::read_golden(&dir, "make_tiny_models.py");
    let prompt = common::parity::ids(&golden, "prompt");
    let mut repeated = prompt.clone();
    repeated.extend(&prompt);
    let prompts = [prompt[..20].to_vec(), prompt.clone(), repeated];
    let start_with = |method: Option<SpeculativeMethod>, pipelined: bool| {
        let mut c = common::tiny_engine_config(&dir, 4);
        c.pipelined_verification = pipelined;
        if let Some(method) = method {
            c.speculative = SpeculativeConfig {
                method,
                num_tokens: 5,
                ..SpeculativeConfig::default()
            };
            if method == SpeculativeMethod::Draft {
                c.draft_model = Some(dir.clone());
            }
        }
        Engine::start(c).expect("engine")
    };
    let start = |method| start_with(method, false);
    let replies = |e: &Engine| -> Vec<Vec<u32>> {
        let streams: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut r = greedy_request(Prompt::Tokens(p.clone()), 48);
                r.ignore_eos = true;
                e.submit(r).expect("submit")
            })
            .collect();
        streams
            .into_iter()
            .map(|s| collect_tokens(s).expect("run").0)
            .collect()
    };
    let off = start(None);
    let want = replies(&off);
    drop(off);
    let on = start(Some(SpeculativeMethod::Ngram));
    assert_eq!(replies(&on), want, "prompt lookup, cold");
    assert_eq!(replies(&on), want, "prompt lookup, warm");
    let stats = settled(&on);
    let (verified, proposed, accepted) = speculation(&stats);
    eprintln!("tiny gemma3, prompt lookup: (verifications, proposed, accepted) = {verified}, {proposed}, {accepted}");
    assert!(verified > 0, "drafts verified");
    assert!(accepted < proposed, "some drafts rejected (and truncated)");
    assert!(stats.prefix_cache_hits > 0);
    assert_eq!(stats.kv_blocks_active, 0, "blocks conserved");
    drop(on);
    // Inside the decode pipeline: verification steps queued behind
    // others across the window, those behind a rejected draft discarded.
    let on = start_with(Some(SpeculativeMethod::Ngram), true);
    assert_eq!(replies(&on), want, "prompt lookup pipelined, cold");
    assert_eq!(replies(&on), want, "prompt lookup pipelined, warm");
    let stats = settled(&on);
    eprintln!(
        "tiny gemma3, prompt lookup pipelined: {:?}, pipelined verify steps {}, discarded {}",
        speculation(&stats),
        stats.pipelined_verify_steps,
        stats.discarded_steps
    );
    assert!(stats.pipelined_verify_steps > 0 && stats.discarded_steps > 0);
    assert_eq!(stats.kv_blocks_active, 0, "blocks conserved");
    drop(on);
    let on = start(Some(SpeculativeMethod::Draft));
    assert_eq!(on.stats().speculative_method, "draft");
    assert_eq!(replies(&on), want, "its own draft, cold");
    assert_eq!(replies(&on), want, "its own draft, warm");
    let stats = settled(&on);
    let (verified, proposed, accepted) = speculation(&stats);
    eprintln!("tiny gemma3, its own draft: (verifications, proposed, accepted) = {verified}, {proposed}, {accepted}");
    assert!(verified > 0 && accepted <= proposed);
    assert!(
        accepted * 3 >= proposed * 2,
        "its own greedy draft mostly agrees"
    );
    assert_eq!(stats.kv_blocks_active, 0, "blocks conserved");
}

/// One reply's token ids and, where asked, each token's logprob.
fn collect_with_logprobs(
    mut stream: mlxcel_engine::api::EventStream,
) -> (Vec<u32>, Vec<Option<f32>>) {
    use mlxcel_engine::api::GenerationEvent;
    let (mut ids, mut logprobs) = (Vec::new(), Vec::new());
    while let Some(event) = stream.blocking_recv() {
        match event {
            GenerationEvent::Delta {
                token, logprobs: l, ..
            } => {
                ids.push(token);
                logprobs.push(l.map(|l| l.token.logprob));
            }
            GenerationEvent::Finished { .. } => break,
            GenerationEvent::Failed { message, .. } => panic!("request failed: {message}"),
            _ => {}
        }
    }
    (ids, logprobs)
}

/// Rows sampled on the host verify drafts too, and keep exactly what
/// decoding without speculation gives: seeded sampling (temperature,
/// top-p, top-k) draws the same tokens from the same random stream, so
/// the replies are identical token for token, seed by seed (the target
/// distribution is kept by construction; see `worker/speculate.rs`);
/// greedy rows with logprobs and penalties, and rows under a grammar,
/// give the same tokens and the target model's logprobs. All of them are
/// submitted at once (batched rows) on the paged engine, cold and warm.
#[test]
fn sampled_replies_are_identical_with_prompt_lookup() {
    let requests = mixed_requests();
    let want = replies_without_speculation();
    let on = engine(true, 4, StorageBackend::Paged);
    for round in ["cold", "warm"] {
        assert_same_replies(&replies_of(&on, &requests), want, round);
    }
    assert!(want[8].1.iter().all(Option::is_some), "logprobs came back");
    let stats = settled(&on);
    let (verified, proposed, accepted) = speculation(&stats);
    assert!(
        verified > 0 && accepted > 0 && accepted < proposed,
        "sampled rows verified drafts, some rejected: {:?}",
        speculation(&stats)
    );
    assert_eq!(stats.kv_blocks_active, 0, "blocks conserved");
    eprintln!("sampled: (verifications, proposed, accepted) = {verified}, {proposed}, {accepted}");
}

/// Eight seeded sampled requests (temperature 0.3 to 1, top-p, top-k)
/// over the copy prompts, a greedy one with logprobs and a frequency
/// penalty (index 8), one under a JSON grammar.
fn mixed_requests() -> Vec<mlxcel_engine::api::GenerationRequest> {
    use mlxcel_engine::api::{GenerationRequest, ResponseFormat, SamplingParams};
    let prompts = prompts();
    let mut requests: Vec<GenerationRequest> = Vec::new();
    for seed in 0..8u64 {
        let sampling = SamplingParams {
            temperature: [0.3, 0.7, 1.0][seed as usize % 3],
            top_p: if seed % 2 == 0 { 0.95 } else { 1.0 },
            top_k: if seed % 4 == 1 { 20 } else { 0 },
            seed: Some(seed),
            ..SamplingParams::default()
        };
        let prompt = prompts[seed as usize % 3].clone();
        requests.push(GenerationRequest::new(prompt, sampling, MAX_TOKENS));
    }
    // Greedy on the host: logprobs and a frequency penalty.
    let mut r = greedy_request(prompts[0].clone(), MAX_TOKENS);
    r.logprobs = Some(2);
    r.sampling.frequency_penalty = 0.2;
    requests.push(r);
    // A grammar (any JSON object) over a prompt that repeats itself.
    let mut r = greedy_request(prompts[4].clone(), MAX_TOKENS);
    r.response_format = Some(ResponseFormat::JsonObject);
    requests.push(r);

    requests
}

type Reply = (Vec<u32>, Vec<Option<f32>>);

/// The replies of [`mixed_requests`] without speculation (paged, `--parallel
/// 4`, all submitted at once), computed once for the tests that hold
/// speculation to them (a request's reply does not depend on what runs
/// beside it: tests/batching.rs).
fn replies_without_speculation() -> &'static [Reply] {
    static WANT: std::sync::OnceLock<Vec<Reply>> = std::sync::OnceLock::new();
    WANT.get_or_init(|| {
        let off = engine(false, 4, StorageBackend::Paged);
        replies_of(&off, &mixed_requests())
    })
}

/// Submits every request at once; the replies in request order.
fn replies_of(e: &Engine, requests: &[mlxcel_engine::api::GenerationRequest]) -> Vec<Reply> {
    let streams: Vec<_> = requests
        .iter()
        .map(|r| e.submit(r.clone()).expect("submit"))
        .collect();
    streams.into_iter().map(collect_with_logprobs).collect()
}

/// The same tokens, and logprobs within 1e-3, request by request.
fn assert_same_replies(got: &[Reply], want: &[Reply], round: &str) {
    assert_eq!(got.len(), want.len());
    for (i, ((tokens, logprobs), (want_tokens, want_logprobs))) in got.iter().zip(want).enumerate()
    {
        assert_eq!(tokens, want_tokens, "request {i}, {round}");
        for (a, b) in logprobs.iter().zip(want_logprobs) {
            match (a, b) {
                (Some(a), Some(b)) => {
                    assert!((a - b).abs() < 1e-3, "request {i}: logprob {a} vs {b}")
                }
                (None, None) => {}
                _ => panic!("request {i}: logprobs on one side only"),
            }
        }
    }
}

/// A draft model (`--speculative draft`) keeps every reply of the mixed
/// requests (greedy, seeded sampling, logprobs, a grammar), batched on
/// paged storage, cold and warm: with the model itself as its draft
/// (nearly every draft accepted) and with a random-weight Llama of the
/// same vocabulary (tiny `llama_chat`: nearly every draft rejected, the
/// rows pause). A draft whose tokenizer differs is refused at start-up.
#[test]
fn draft_model_replies_are_identical() {
    // Three sampled requests, the greedy one with logprobs, the grammar.
    let picked = [0, 1, 2, 8, 9];
    let requests: Vec<_> = picked
        .iter()
        .map(|&i| mixed_requests()[i].clone())
        .collect();
    let want: Vec<Reply> = picked
        .iter()
        .map(|&i| replies_without_speculation()[i].clone())
        .collect();
    let tiny = common::tiny_model_dir("llama_chat", "draft");
    let start = |draft: std::path::PathBuf| {
        let mut c = EngineConfig::new(model_dir());
        c.parallel = 4;
        c.storage_backend = Some(StorageBackend::Paged);
        c.prefill_tile = Some(0);
        c.kv_cache_budget = Some(128 << 20);
        c.check_invariants = true;
        // Small chunks: a new row's draft catches up over several rounds.
        c.prefill_chunk_size = 64;
        c.speculative = SpeculativeConfig {
            method: SpeculativeMethod::Auto,
            num_tokens: 4,
            ..SpeculativeConfig::default()
        };
        c.draft_model = Some(draft);
        Engine::start(c)
    };
    for (name, draft) in [("itself", model_dir()), ("random", tiny.clone())] {
        let on = start(draft).expect("engine with a draft model");
        assert_eq!(on.stats().speculative_method, "draft");
        let rounds: &[&str] = if name == "itself" {
            &["cold", "warm"]
        } else {
            &["cold"]
        };
        for round in rounds {
            let got = replies_of(&on, &requests);
            assert_same_replies(&got, &want, &format!("draft {name}, {round}"));
        }
        let stats = settled(&on);
        let (verified, proposed, accepted) = speculation(&stats);
        eprintln!("draft {name}: (verifications, proposed, accepted) = {verified}, {proposed}, {accepted}");
        assert!(verified > 0 && accepted <= proposed);
        if name == "itself" {
            // Greedy rows accept every draft; sampled ones each with its
            // probability.
            assert!(accepted * 3 >= proposed * 2, "its own draft mostly agrees");
        } else {
            assert!(accepted < proposed, "a random draft is rejected");
        }
        assert_eq!(stats.kv_blocks_active, 0, "blocks conserved");
    }
    let _ = std::fs::remove_dir_all(&tiny);

    let qwen = common::parity::real_model_dir("MLXCEL_QWEN_CODER_MODEL", "qwen2.5-coder-0.5b")
        .join("qwen2.5-coder-0.5b-instruct.gguf");
    let err = start(qwen)
        .err()
        .expect("a draft of another vocabulary is refused");
    let msg = err.to_string();
    assert!(
        msg.contains("--draft-model") && msg.contains("vocabulary"),
        "{msg}"
    );
}

/// Temperature sampling keeps the model's distribution under prompt
/// lookup (the issue's statistical check; the acceptance rule is in
/// `crates/engine/src/worker/speculate.rs`). The tiny random-weight Llama
/// with its LM head scaled by 1/20 (so its own logits differ by a few
/// tenths and a logit bias shapes the distribution), a prompt that
/// repeats `A B C D` and a bias that leaves only those four tokens likely
/// (C the likeliest, then D: most rows propose `D A` after a first C, and
/// thousands of drafts are accepted and rejected). 10,000 samples of four
/// sampled tokens (500 seeded requests of 20 choices) run without
/// speculation and 10,000 with other seeds with it. A chi-square test of
/// homogeneity over the 256 four-token outcomes (cells expected below 5
/// pooled) must not reject at the 0.001
/// level, and the total-variation distance between the two samples'
/// distributions of each position's token must stay below 0.03
/// (`chi_square_tells_a_shifted_distribution_apart` shows both checks
/// reject a sample with about a tenth of its outcomes moved to one). With
/// the head scaled the distribution depends little on the context, so the
/// chi-square mostly guards the acceptance rule's law; the first 1,000
/// samples' seeds also run with speculation and must give the same tokens
/// as without it, which catches a draw taken from the wrong position or
/// row. The seeds are fixed; which rows share a step depends on timing,
/// so a draw within float noise of a boundary between two tokens could
/// differ (never seen). Up to 64 rows a step, speculating ones included.
#[test]
fn sampled_distribution_is_kept_with_prompt_lookup() {
    use mlxcel_engine::api::{GenerationRequest, SamplingParams};
    const SAMPLES: u64 = 10_000;
    let (a, b, c, d) = (10u32, 11, 12, 13);
    let dir = common::tiny_model_dir("llama", "distribution");
    // The LM head scaled by 1/20 in a copy of the checkpoint.
    let weights = dir.join("model.safetensors");
    let mut st = mlxcel_mlx::SafeTensors::load(&weights).expect("tiny weights");
    let names = st.names();
    let mut tensors: Vec<(String, mlxcel_mlx::Array)> = names
        .iter()
        .map(|n| (n.clone(), st.take(n).expect("tensor")))
        .collect();
    let head = tensors
        .iter_mut()
        .find(|(name, _)| name == "lm_head.weight")
        .expect("the tiny Llama has an untied LM head");
    let scale = mlxcel_mlx::Array::scalar(0.05).expect("scalar");
    head.1 = head.1.multiply(&scale).expect("scale");
    std::fs::remove_file(&weights).expect("unlink the symlink");
    let refs: Vec<(String, &mlxcel_mlx::Array)> =
        tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
    mlxcel_mlx::save_safetensors(&weights, &refs).expect("save");
    let start = |speculative: bool| {
        let mut cfg = common::tiny_engine_config(&dir, 64);
        cfg.check_invariants = false;
        cfg.kv_cache_budget = Some(4 << 20);
        // Many new prompts a step (a step's prefill is bounded by it).
        cfg.prefill_chunk_size = 1024;
        cfg.speculative = SpeculativeConfig {
            max_rows: 64,
            ..ngram_or_off(speculative, 3)
        };
        Engine::start(cfg).expect("engine")
    };
    // One seed per request; its 20 choices draw from 20 independent
    // streams of it (the sampler's ChaCha streams).
    const CHOICES: usize = 20;
    let request = |seed: u64| {
        let sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        let mut r = GenerationRequest::new(
            Prompt::Tokens(vec![a, b, c, d, a, b, c, d, a, b]),
            sampling,
            4,
        );
        r.n = CHOICES;
        r.ignore_eos = true;
        // Everything else ~e^-40 less likely than these four.
        r.logit_bias = vec![(a, 40.0), (b, 40.0), (c, 41.5), (d, 41.0)];
        r
    };
    // The choices' tokens, request by request, choice by choice.
    let outcomes = |engine: &Engine, seeds: std::ops::Range<u64>| -> Vec<Vec<u32>> {
        use mlxcel_engine::api::GenerationEvent;
        let streams: Vec<_> = seeds
            .map(|s| engine.submit(request(s)).expect("submit"))
            .collect();
        let mut out = Vec::new();
        for mut stream in streams {
            let mut choices = vec![Vec::new(); CHOICES];
            let mut finished = 0;
            while finished < CHOICES {
                match stream.blocking_recv().expect("stream ended early") {
                    GenerationEvent::Delta { index, token, .. } => choices[index].push(token),
                    GenerationEvent::Finished { .. } => finished += 1,
                    other => panic!("unexpected event {other:?}"),
                }
            }
            out.extend(choices);
        }
        out
    };
    let requests = SAMPLES / CHOICES as u64;
    let off = start(false);
    let without = outcomes(&off, 0..requests);
    drop(off);
    let on = start(true);
    let with = outcomes(&on, requests..2 * requests);
    let same_seeds = outcomes(&on, 0..requests / 10);
    let stats = settled(&on);
    let _ = std::fs::remove_dir_all(&dir);

    assert_eq!(
        same_seeds[..],
        without[..same_seeds.len()],
        "seeded draws are kept"
    );
    assert_eq!(same_seeds.len(), 1_000);
    assert_eq!(
        (without.len(), with.len()),
        (SAMPLES as usize, SAMPLES as usize)
    );
    let (verified, proposed, accepted) = speculation(&stats);
    eprintln!(
        "distribution: (verifications, proposed, accepted) = {verified}, {proposed}, {accepted}"
    );
    assert!(
        verified > SAMPLES / 2 && accepted > 1_000 && proposed - accepted > 1_000,
        "drafts proposed, many accepted and many rejected: {:?}",
        speculation(&stats)
    );
    let cell = |t: &[u32]| -> usize {
        assert_eq!(t.len(), 4, "four tokens: {t:?}");
        t.iter().fold(0, |acc, &x| {
            assert!((a..=d).contains(&x), "only the biased tokens: {t:?}");
            acc * 4 + (x - a) as usize
        })
    };
    let count = |runs: &[Vec<u32>]| {
        let mut n = vec![0u64; 256];
        for t in runs {
            n[cell(t)] += 1;
        }
        n
    };
    let (x, y) = (count(&without), count(&with));
    let (chi2, df) = chi_square_homogeneity(&x, &y);
    let bound = chi_square_critical_0001(df);
    let tv = marginal_total_variation(&x, &y);
    eprintln!(
        "distribution: chi-square {chi2:.1} on {df} df (0.001 bound {bound:.1}), per-position TV {tv:.4?}"
    );
    assert!(df >= 20, "enough cells to compare: {df}");
    assert!(
        chi2 < bound,
        "chi-square {chi2:.1} >= {bound:.1} on {df} df"
    );
    assert!(
        tv.iter().all(|&t| t < 0.03),
        "total variation per position {tv:.4?}"
    );
}

/// The check above can fail: the same sample against one where about a
/// tenth of the outcomes (a tenth of each cell, rounded down) are moved to
/// the outcome an always-accepting speculation favours (`C D A B`) is
/// rejected by the chi-square bound, and two multinomial samples of one
/// distribution are not.
#[test]
fn chi_square_tells_a_shifted_distribution_apart() {
    // A fixed distribution over 256 cells and a deterministic sampler
    // (splitmix64), two samples of 10,000.
    let weights: Vec<f64> = (0..256)
        .map(|i| [1.0, 1.0, 4.5, 2.7][i % 4] * [1.0, 1.0, 4.5, 2.7][(i / 4) % 4])
        .collect();
    let total: f64 = weights.iter().sum();
    let mut state = 7u64;
    let mut draw = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let u = ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 * total;
        let mut acc = 0.0;
        weights
            .iter()
            .position(|w| {
                acc += w;
                acc > u
            })
            .unwrap_or(255)
    };
    let mut sample = || {
        let mut n = vec![0u64; 256];
        for _ in 0..10_000 {
            n[draw()] += 1;
        }
        n
    };
    let (x, y) = (sample(), sample());
    let (chi2, df) = chi_square_homogeneity(&x, &y);
    let tv = marginal_total_variation(&x, &y);
    eprintln!("same distribution: chi-square {chi2:.1} on {df} df, per-position TV {tv:.4?}");
    assert!(
        chi2 < chi_square_critical_0001(df),
        "same distribution: {chi2:.1} on {df}"
    );
    assert!(tv.iter().all(|&t| t < 0.03), "{tv:?}");
    // Move a tenth of each cell (at most 1,000 outcomes in all) to cell
    // C D A B = 2·64 + 3·16 + 0·4 + 1.
    let mut shifted = y.clone();
    let mut moved = 0;
    for n in shifted.iter_mut() {
        let take = (*n / 10).min(1_000 - moved);
        *n -= take;
        moved += take;
    }
    shifted[2 * 64 + 3 * 16 + 1] += moved;
    let (chi2, df) = chi_square_homogeneity(&x, &shifted);
    let tv = marginal_total_variation(&x, &shifted);
    eprintln!("shifted: chi-square {chi2:.1} on {df} df, per-position TV {tv:.4?}");
    assert!(
        chi2 > chi_square_critical_0001(df),
        "shifted: {chi2:.1} on {df}"
    );
    assert!(tv.iter().any(|&t| t >= 0.03), "{tv:?}");
}

/// Pearson's chi-square test of homogeneity of two samples of equal size
/// over the same cells: cells whose pooled expected count (half the
/// combined count) is below 5 are merged into one (itself joined to the
/// smallest other cell when still below 5); the statistic and its degrees
/// of freedom (cells - 1).
fn chi_square_homogeneity(x: &[u64], y: &[u64]) -> (f64, usize) {
    assert_eq!(
        x.iter().sum::<u64>(),
        y.iter().sum::<u64>(),
        "equal samples"
    );
    let mut cells: Vec<(u64, u64)> = Vec::new();
    let mut rest = (0u64, 0u64);
    for (&a, &b) in x.iter().zip(y) {
        if a + b >= 10 {
            cells.push((a, b));
        } else {
            rest = (rest.0 + a, rest.1 + b);
        }
    }
    // The pooled remainder is a cell of its own when it is as large;
    // else it joins the smallest kept cell.
    if rest.0 + rest.1 >= 10 || cells.is_empty() {
        cells.push(rest);
    } else if let Some(small) = cells.iter_mut().min_by_key(|(a, b)| a + b) {
        small.0 += rest.0;
        small.1 += rest.1;
    }
    // Equal sizes: each cell's expected count is (a + b) / 2 per sample.
    let chi2 = cells
        .iter()
        .map(|&(a, b)| (a as f64 - b as f64).powi(2) / (a + b) as f64)
        .sum();
    (chi2, cells.len().saturating_sub(1))
}

/// The chi-square distribution's 0.999 quantile on `df` degrees of
/// freedom (Wilson and Hilferty 1931: within 1 % for df >= 10).
fn chi_square_critical_0001(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.090_232; // the standard normal's 0.999 quantile
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// Half the L1 distance between two empirical distributions.
fn total_variation(x: &[u64], y: &[u64]) -> f64 {
    let (nx, ny) = (x.iter().sum::<u64>() as f64, y.iter().sum::<u64>() as f64);
    x.iter()
        .zip(y)
        .map(|(&a, &b)| (a as f64 / nx - b as f64 / ny).abs())
        .sum::<f64>()
        / 2.0
}

/// [`total_variation`] of each of the four positions' distributions over
/// the four tokens, from counts over the 256 four-token outcomes (cell
/// `t0·64 + t1·16 + t2·4 + t3`).
fn marginal_total_variation(x: &[u64], y: &[u64]) -> [f64; 4] {
    let marginal = |n: &[u64], position: u32| {
        let mut m = [0u64; 4];
        for (cell, &count) in n.iter().enumerate() {
            m[(cell >> (2 * (3 - position))) & 3] += count;
        }
        m
    };
    [0, 1, 2, 3].map(|p| total_variation(&marginal(x, p), &marginal(y, p)))
}
