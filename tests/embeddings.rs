//! Embeddings through the engine on the tiny random-weight Qwen3
//! (`scripts/make_tiny_models.py`): vectors equal mlx_lm's bare decoder's
//! final hidden states pooled the same way (`embedding.json`, made from
//! the same saved weights), for last-token and mean pooling read from
//! sentence-transformers files, and for `--embeddings`; batched equals
//! alone, warm equals cold, and embedding rows share steps with
//! generation rows without changing them.

mod common;

use std::path::Path;

use common::{collect_embedding, collect_tokens, greedy_request, tiny_model_dir};
use mlxcel_engine::api::{
    EmbeddingRequest, InferenceService, Pooling, Prompt, RequestField, SubmitError,
};
use mlxcel_engine::Engine;
use serde_json::Value;

/// Tolerance against mlx_lm's vectors (unit length, float32).
const TOL: f32 = 1e-4;

/// One golden case: the prompt and its two pooled vectors.
struct Case {
    prompt: Vec<u32>,
    last: Vec<f32>,
    mean: Vec<f32>,
}

fn cases(dir: &Path) -> Vec<Case> {
    let text = std::fs::read_to_string(dir.join("embedding.json"))
        .expect("embedding.json: run scripts/setup.sh (scripts/make_tiny_models.py)");
    let golden: Value = serde_json::from_str(&text).expect("json");
    let floats = |v: &Value| -> Vec<f32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_f64().expect("number") as f32)
            .collect()
    };
    golden["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            prompt: floats(&c["prompt"]).iter().map(|&t| t as u32).collect(),
            last: floats(&c["last"]),
            mean: floats(&c["mean"]),
        })
        .collect()
}

/// The tiny Qwen3 in a temporary directory, with sentence-transformers
/// files selecting `mode` (`None`: none, a plain decoder).
fn model(tag: &str, mode: Option<&str>) -> std::path::PathBuf {
    let dir = tiny_model_dir("qwen3", tag);
    let tiny = std::fs::read_link(dir.join("golden.json")).expect("link");
    let from = tiny.parent().expect("dir").join("embedding.json");
    let _ = std::fs::remove_file(dir.join("embedding.json"));
    std::os::unix::fs::symlink(from, dir.join("embedding.json")).expect("symlink");
    if let Some(mode) = mode {
        let modules = r#"[
 {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
 {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
 {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
]"#;
        std::fs::write(dir.join("modules.json"), modules).expect("modules.json");
        std::fs::create_dir_all(dir.join("1_Pooling")).expect("1_Pooling");
        let config = format!(r#"{{"word_embedding_dimension": 64, "{mode}": true}}"#);
        std::fs::write(dir.join("1_Pooling/config.json"), config).expect("pooling config");
    }
    dir
}

/// An engine on `dir` whose prefill runs in chunks of 16 (so the longer
/// prompts span several steps) with blocks of 8.
fn engine(dir: &Path, embeddings: bool) -> Engine {
    let mut c = common::tiny_engine_config(dir, 4);
    c.embeddings = embeddings;
    Engine::start(c).expect("engine")
}

fn request(prompt: &[u32]) -> EmbeddingRequest {
    EmbeddingRequest {
        prompt: Prompt::Tokens(prompt.to_vec()),
        cache_prompt: true,
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every case alone, then all at once (one batch), each against `want`.
fn check_alone_and_batched(e: &Engine, cases: &[Case], want: fn(&Case) -> &[f32], what: &str) {
    let mut alone = Vec::new();
    for c in cases {
        let (v, usage) =
            collect_embedding(e.embed(request(&c.prompt)).expect("embed")).expect(what);
        assert_eq!(usage.prompt_tokens, c.prompt.len(), "{what}: usage");
        assert_eq!(usage.completion_tokens, 0, "{what}: usage");
        let d = max_diff(&v, want(c));
        eprintln!("{what}: {} tokens, {d:.2e} from mlx_lm", c.prompt.len());
        assert!(d < TOL, "{what}: {d}");
        alone.push(v);
    }
    let streams: Vec<_> = cases
        .iter()
        .map(|c| e.embed(request(&c.prompt)).expect("embed"))
        .collect();
    for (s, a) in streams.into_iter().zip(&alone) {
        let (v, _) = collect_embedding(s).expect(what);
        let d = max_diff(&v, a);
        eprintln!("{what}: batched vs alone {d:.2e}");
        assert!(d < 1e-5, "{what}: batched vs alone {d}");
    }
}

#[test]
fn last_token_pooling_from_the_checkpoint_matches_mlx_lm_cold_and_warm() {
    let dir = model("embed-last", Some("pooling_mode_lasttoken"));
    let cases = cases(&dir);
    let e = engine(&dir, false);
    assert_eq!(
        e.embedding_model().map(|m| (m.pooling, m.dimensions)),
        Some((Pooling::LastToken, 64))
    );
    // Cold: a fresh cache (the first case's blocks are not cached yet).
    check_alone_and_batched(&e, &cases, |c| &c.last, "last");
    // Warm: the whole prompt is cached; only its last token is recomputed.
    let c = &cases[0];
    let (cold, _) = collect_embedding(
        e.embed(EmbeddingRequest {
            cache_prompt: false,
            ..request(&c.prompt)
        })
        .expect("embed"),
    )
    .expect("cold");
    let (warm, usage) =
        collect_embedding(e.embed(request(&c.prompt)).expect("embed")).expect("warm");
    assert_eq!(
        usage.cached_tokens,
        c.prompt.len() - 1,
        "a whole-prompt hit"
    );
    let d = max_diff(&warm, &cold);
    eprintln!("last: warm vs cold {d:.2e}");
    assert!(d < 1e-5, "warm vs cold {d}");
    // A chat request still runs on an embedding checkpoint, and shares a
    // step with embedding rows without changing its tokens.
    let golden = common::parity::read_golden(&dir, "make_tiny_models.py");
    let (prompt, greedy) = (
        common::parity::ids(&golden, "prompt"),
        common::parity::ids(&golden, "greedy"),
    );
    let mut r = greedy_request(Prompt::Tokens(prompt), greedy.len());
    r.ignore_eos = true;
    r.cache_prompt = false;
    let generation = e.submit(r).expect("submit");
    let embedding = e.embed(request(&cases[2].prompt)).expect("embed");
    let (tokens, _) = collect_tokens(generation).expect("generate");
    assert_eq!(tokens, greedy, "greedy tokens beside an embedding");
    let (v, _) = collect_embedding(embedding).expect("embed");
    assert!(max_diff(&v, &cases[2].last) < TOL);
    let stats = common::settled(&e);
    assert_eq!(stats.kv_blocks_active, 0, "every block returned");
}

#[test]
fn mean_pooling_computes_every_token_even_when_cached() {
    let dir = model("embed-mean", Some("pooling_mode_mean_tokens"));
    let cases = cases(&dir);
    let e = engine(&dir, false);
    assert_eq!(e.embedding_model().map(|m| m.pooling), Some(Pooling::Mean));
    check_alone_and_batched(&e, &cases, |c| &c.mean, "mean");
    // The prompts' blocks are cached by now; a mean is computed whole.
    let c = &cases[2];
    let (again, usage) =
        collect_embedding(e.embed(request(&c.prompt)).expect("embed")).expect("again");
    assert_eq!(
        usage.cached_tokens, 0,
        "mean pooling reads no cached prefix"
    );
    assert!(max_diff(&again, &c.mean) < TOL);
}

#[test]
fn embeddings_flag_serves_a_plain_decoder_and_other_models_refuse() {
    let dir = model("embed-flag", None);
    let cases = cases(&dir);
    let plain = engine(&dir, false);
    assert_eq!(plain.embedding_model(), None);
    match plain.embed(request(&cases[0].prompt)) {
        Err(SubmitError::InvalidRequest { message, .. }) => {
            assert!(message.contains("--embeddings"), "{message}")
        }
        other => panic!("not refused: {:?}", other.map(|_| ())),
    }
    drop(plain);
    let e = engine(&dir, true);
    assert_eq!(
        e.embedding_model().map(|m| m.pooling),
        Some(Pooling::LastToken)
    );
    let (v, _) =
        collect_embedding(e.embed(request(&cases[1].prompt)).expect("embed")).expect("embed");
    assert!(max_diff(&v, &cases[1].last) < TOL);
    // An empty prompt and an id past the vocabulary name the prompt.
    for bad in [vec![], vec![1_000_000]] {
        match e.embed(request(&bad)) {
            Err(SubmitError::InvalidRequest { field, .. }) => {
                assert_eq!(field, Some(RequestField::Prompt))
            }
            other => panic!("{bad:?} not refused: {:?}", other.map(|_| ())),
        }
    }
}
