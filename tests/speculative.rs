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
    let mut c = EngineConfig::new(model_dir());
    c.parallel = parallel;
    c.storage_backend = Some(backend);
    c.prefill_tile = Some(0);
    c.kv_cache_budget = Some(128 << 20);
    c.check_invariants = true;
    c.speculative = SpeculativeConfig {
        method: if speculative {
            SpeculativeMethod::Ngram
        } else {
            SpeculativeMethod::Off
        },
        num_tokens: 6,
    };
    Engine::start(c).expect("engine")
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

    // Alone, dense storage.
    let dense = engine(true, 1, StorageBackend::Dense);
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(
            run(&dense, p, MAX_TOKENS, &[]),
            reference[i],
            "prompt {i}, dense"
        );
    }
    assert_eq!(
        run(&dense, &prompts[1], MAX_TOKENS, &stop),
        reference_stopped
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
        "alone: (verifications, proposed, accepted) = {:?}",
        speculation(&stats)
    );
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
    let paged = engine(true, 4, StorageBackend::Paged);
    let cold = run_concurrently(&paged, &prompts, MAX_TOKENS);
    let warm = run_concurrently(&paged, &prompts, MAX_TOKENS);
    for (i, want) in reference.iter().enumerate() {
        assert_eq!(&cold[i], want, "prompt {i}, batched, cold");
        assert_eq!(&warm[i], want, "prompt {i}, batched, warm");
    }
    // max_tokens landing anywhere in an accepted run (the prompts come
    // from the prefix cache now).
    for n in [1, 2, 5, 11, 17] {
        for i in [0, 1] {
            assert_eq!(
                run(&paged, &prompts[i], n, &[]),
                first(&reference[i], n),
                "prompt {i}, max_tokens {n}"
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
        "batched: (verifications, proposed, accepted) = {:?}",
        speculation(&stats)
    );
}

/// KV groups (a local layer of a 16-key window beside a global layer, tiny
/// random-weight Gemma 3): verification rows run past the window, and
/// the rejected drafts are truncated from both groups; batched rows of
/// several prompts (one repeating itself, so drafts are proposed), small
/// blocks and chunks, a warm round from the prefix cache.
#[test]
fn kv_groups_give_the_same_greedy_tokens_with_prompt_lookup() {
    let dir = common::tiny_gemma3_dir("speculative");
    let golden = common::parity::read_golden(&dir, "make_tiny_models.py");
    let prompt = common::parity::ids(&golden, "prompt");
    let mut repeated = prompt.clone();
    repeated.extend(&prompt);
    let prompts = [prompt[..20].to_vec(), prompt.clone(), repeated];
    let start = |speculative: bool| {
        let mut c = common::tiny_engine_config(&dir, 4);
        if speculative {
            c.speculative = SpeculativeConfig {
                method: SpeculativeMethod::Ngram,
                num_tokens: 5,
            };
        }
        Engine::start(c).expect("engine")
    };
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
    let off = start(false);
    let want = replies(&off);
    drop(off);
    let on = start(true);
    assert_eq!(replies(&on), want, "cold");
    assert_eq!(replies(&on), want, "warm");
    let stats = settled(&on);
    assert!(
        stats.speculative_accepted_tokens > 0,
        "drafts accepted: {:?}",
        speculation(&stats)
    );
    assert!(
        stats.speculative_accepted_tokens < stats.speculative_proposed_tokens,
        "some drafts rejected (and truncated): {:?}",
        speculation(&stats)
    );
    assert!(stats.prefix_cache_hits > 0);
    assert_eq!(stats.kv_blocks_active, 0, "blocks conserved");
    eprintln!(
        "tiny gemma3: (verifications, proposed, accepted) = {:?}",
        speculation(&stats)
    );
    drop(on);
    let _ = std::fs::remove_dir_all(&dir);
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
