//! Gemma 3 270M served from its GGUF file (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0
//! and F32 tensors) directly, against `models/gemma-3-270m` (or
//! `MLXCEL_GEMMA3_MODEL`), which `scripts/prepare_real_models.py` made from
//! the same file: `model.safetensors` (every tensor dequantized to float32
//! by the `gguf` package, 1 taken off the norms) and mlx_lm's greedy
//! tokens and last logits on it (`golden.json`). The tokenizer built from
//! the GGUF's SentencePiece metadata is checked against the one
//! transformers builds from the same metadata
//! (tests/goldens/gemma3_gguf_tokenizer.json, made by
//! scripts/make_gemma3_tokenizer_golden.py). Missing files are failures.

mod common;

use std::path::PathBuf;

use common::parity::{
    check_model, config_shape, floats, ids, read_golden, real_model_dir, AS_SERVED,
};
use mlxcel_engine::api::{InferenceService, Prompt};
use mlxcel_engine::loader::{load_model, read_config};
use mlxcel_engine::{Engine, EngineConfig};
use mlxcel_mlx::Dtype;
use mlxcel_model::config::QuantSpec;
use mlxcel_model::gguf::{GgufModel, Requantize};
use mlxcel_model::{LoadOptions, WeightMode, Weights};
use mlxcel_models::gguf_arch;
use mlxcel_text::gguf::GgufText;
use serde_json::Value;

const GGUF_NAME: &str = "gemma-3-270m-q4_k_m.gguf";

fn dir() -> PathBuf {
    real_model_dir("MLXCEL_GEMMA3_MODEL", "gemma-3-270m")
}

fn gguf() -> PathBuf {
    let path = dir().join(GGUF_NAME);
    assert!(
        path.is_file(),
        "{} missing: run scripts/setup.sh (step 7)",
        path.display()
    );
    path
}

#[test]
fn the_metadata_describes_the_converted_config() {
    let ours = read_config(&gguf()).expect("config from GGUF metadata");
    let theirs = read_config(&dir()).expect("converted config");
    assert_eq!(config_shape(&ours), config_shape(&theirs));
    for key in [
        "query_pre_attn_scalar",
        "sliding_window",
        "sliding_window_pattern",
        "rope_local_base_freq",
        "hidden_activation",
    ] {
        let as_f64 = |v: &Value| v.as_f64().map(Value::from).unwrap_or(v.clone());
        assert_eq!(
            as_f64(&ours.raw[key]),
            as_f64(&theirs.raw[key]),
            "config key {key}"
        );
    }
    assert_eq!(ours.raw["query_pre_attn_scalar"], 256);
    // A GPU computes in Gemma's bfloat16 (it refuses float16, the default
    // for a file that names no dtype); the CPU in float32.
    assert_eq!(mlxcel_model::auto_dtype(&ours, true), Dtype::Bfloat16);
    assert_eq!(mlxcel_model::auto_dtype(&ours, false), Dtype::Float32);
    // No tensor stays quantized: MLX's reader cannot read Q5_0, so the
    // file is decoded to float32.
    assert!(ours
        .raw
        .get("quantization")
        .is_none_or(|q| q.as_object().is_some_and(|o| o.is_empty())));
}

#[test]
fn decoded_tensors_equal_the_float32_conversion() {
    let model = GgufModel::open(&gguf(), gguf_arch).expect("open GGUF");
    assert!(!model.mlx_reads_all(), "the file has Q5_0 tensors");
    let config = read_config(&gguf()).unwrap();
    let mut ours = model.weights(&config).expect("decode GGUF");
    let mut theirs = Weights::open(&dir()).expect("converted weights");
    let mut names = ours.remaining();
    names.sort();
    let mut want = theirs.remaining();
    want.sort();
    assert_eq!(names, want);
    let mut worst = (0.0f32, String::new());
    for name in &names {
        let a = ours.take(name).unwrap();
        let b = theirs.take(name).unwrap();
        assert_eq!(a.shape(), b.shape(), "{name}");
        let (a, b) = (a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap());
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        if diff >= worst.0 {
            worst = (diff, name.clone());
        }
    }
    eprintln!(
        "max |GGUF decoded - converted| = {:.2e} ({})",
        worst.0, worst.1
    );
    // Both sides compute ggml's d · q (- m) in float32 from the same
    // bytes, in the same order: equal (measured: 0 for every tensor).
    assert_eq!(worst.0, 0.0, "{} differs", worst.1);
}

#[test]
fn the_gguf_file_served_directly_matches_mlx_lm() {
    let path = gguf();
    let golden = read_golden(&dir(), "prepare_real_models.py");
    let config = read_config(&path).expect("config");
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let model = load_model(&path, config, options).expect("load GGUF");
    let prompts = golden["prompts"].as_array().expect("prompts");
    assert_eq!(prompts.len(), 2);
    for case in prompts {
        let prompt = ids(case, "prompt");
        let name = format!("{GGUF_NAME}, {} prompt tokens", prompt.len());
        // The same float32 weights as mlx_lm's (see the test above): the
        // logits differ only by float32 summation order (measured: 2.2e-5
        // and 3.3e-5 for the two prompts).
        check_model(
            &name,
            model.as_ref(),
            &prompt,
            &ids(case, "greedy"),
            &floats(case, "last_logits"),
            1e-4,
            AS_SERVED,
        );
    }
}

/// `--quantize 8`: every floating-point matrix of the file (Gemma 3 270M
/// has no tensor MLX keeps quantized: its Q5_0 tensors make MLX's reader
/// refuse the file, so all are decoded to float32) becomes an 8-bit MLX
/// matrix, which stays close to mlx_lm's float32 logits and keeps its
/// greedy tokens. Run dequantized (the CPU's way), so the check is of the
/// quantization itself.
#[test]
fn quantize_8_quantizes_every_matrix_and_keeps_the_greedy_tokens() {
    let path = gguf();
    let spec = QuantSpec {
        group_size: 32,
        bits: 8,
    };
    let mut config = read_config(&path).expect("config");
    let layers = config.num_hidden_layers;
    let (mut weights, quantized) = GgufModel::open(&path, gguf_arch)
        .unwrap()
        .weights_requantized(&mut config, Requantize::All(spec))
        .expect("re-quantized");
    // q, k, v, o, gate, up, down per layer, and the (tied) embedding.
    assert_eq!(quantized, layers * 7 + 1);
    for module in [
        "model.embed_tokens",
        "model.layers.0.self_attn.q_proj",
        "model.layers.17.mlp.down_proj",
    ] {
        assert_eq!(
            config.quantization.for_module(module),
            Some(spec),
            "{module}"
        );
        let w = weights.take(&format!("{module}.weight")).unwrap();
        assert_eq!(w.dtype(), Dtype::Uint32, "{module} packed");
        assert!(weights.contains(&format!("{module}.scales")), "{module}");
    }
    // Norm weights (1-D) stay float.
    assert_eq!(
        config
            .quantization
            .for_module("model.layers.0.input_layernorm"),
        None
    );

    let golden = read_golden(&dir(), "prepare_real_models.py");
    let case = &golden["prompts"][0];
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: Some(Requantize::All(spec)),
    };
    let model = load_model(&path, read_config(&path).unwrap(), options).expect("load");
    // 8-bit groups of 32 move the logits by rounding only (measured: 0.34
    // at most, over 262 144 logits: the tied embedding, which Gemma scales
    // by √640, is quantized too); the greedy tokens stay mlx_lm's.
    check_model(
        &format!("{GGUF_NAME} --quantize 8"),
        model.as_ref(),
        &ids(case, "prompt"),
        &ids(case, "greedy"),
        &floats(case, "last_logits"),
        0.5,
        AS_SERVED,
    );
}

/// `--quantize auto` on a GPU (`Requantize::MatchSource`): the matrices
/// the file stores at 4 bits (Q4_K) become 4-bit MLX matrices, those at 5
/// to 8 bits (Q5_0, Q6_K, Q8_0) 8-bit ones, and F32 tensors stay float.
/// Run dequantized on this CPU, so the check is of the quantization.
#[test]
fn quantize_auto_follows_the_stored_precision() {
    let path = gguf();
    let file = GgufModel::open(&path, gguf_arch).unwrap();
    let mut want = std::collections::HashMap::new();
    for t in &file.header.tensors {
        let Some(bits) = t.ty.stored_bits() else {
            continue;
        };
        let module = mlxcel_model::gguf::arch::checkpoint_name(file.arch(), &t.name)
            .unwrap()
            .trim_end_matches(".weight")
            .to_string();
        want.insert(module, if bits <= 4 { 4 } else { 8 });
    }
    assert!(want.values().any(|&b| b == 4) && want.values().any(|&b| b == 8));
    let mut config = read_config(&path).expect("config");
    let (_, quantized) = file
        .weights_requantized(&mut config, Requantize::MatchSource)
        .expect("re-quantized");
    assert_eq!(quantized, want.len());
    for (module, bits) in &want {
        let spec = config.quantization.for_module(module);
        assert_eq!(spec.map(|s| s.bits), Some(*bits), "{module}");
    }

    let golden = read_golden(&dir(), "prepare_real_models.py");
    let case = &golden["prompts"][0];
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: Some(Requantize::MatchSource),
    };
    let model = load_model(&path, read_config(&path).unwrap(), options).expect("load");
    // The Q4_K matrices move from ggml's 4-bit grid to MLX's (measured:
    // 2.66 at most, over 262 144 logits); the greedy tokens stay mlx_lm's.
    check_model(
        &format!("{GGUF_NAME} --quantize auto"),
        model.as_ref(),
        &ids(case, "prompt"),
        &ids(case, "greedy"),
        &floats(case, "last_logits"),
        4.0,
        AS_SERVED,
    );
}

#[test]
fn the_sentencepiece_tokenizer_matches_the_reference() {
    let path = gguf();
    let header = GgufModel::open(&path, gguf_arch).unwrap().header;
    let text = GgufText::from_header(&path, &header).expect("tokenizer from metadata");
    let tok = &text.tokenizer;
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(text.bos_token.as_deref(), Some("<bos>"));
    assert_eq!(text.eos_ids, vec![1]);
    let golden_path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/gemma3_gguf_tokenizer.json");
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(golden_path).unwrap()).unwrap();
    let samples = golden["samples"].as_array().unwrap();
    assert!(samples.len() >= 10);
    for sample in samples {
        let s = sample["text"].as_str().unwrap();
        let want = ids(sample, "ids");
        assert_eq!(tok.encode(s, false).unwrap(), want, "{s:?}");
        // add_bos_token: <bos> (id 2) in front.
        let mut with_bos = vec![2];
        with_bos.extend(&want);
        assert_eq!(tok.encode(s, true).unwrap(), with_bos, "{s:?}");
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            sample["decoded"].as_str().unwrap(),
            "{s:?}"
        );
    }
    // The whitespace-run pieces are spelled with ▁, as the reference has
    // them; the others as the file has them.
    for (id, piece) in golden["id_to_token"].as_object().unwrap() {
        let id: u32 = id.parse().unwrap();
        assert_eq!(tok.id_to_token(id).as_deref(), piece.as_str(), "id {id}");
    }
    // The prompt of mlx_lm's golden (ids looked up in the vocabulary).
    let golden = read_golden(&dir(), "prepare_real_models.py");
    let counting = ids(&golden["prompts"][0], "prompt");
    assert_eq!(
        tok.encode_text_prompt("One, two, three, four,").unwrap(),
        counting
    );
}

#[test]
fn the_engine_serves_the_gguf_file_with_its_own_tokenizer() {
    let path = gguf();
    let golden = read_golden(&dir(), "prepare_real_models.py");
    let case = &golden["prompts"][0];
    let engine = Engine::start(EngineConfig::new(path)).expect("engine on the GGUF file");
    // `<eos>` from the metadata, and `<end_of_turn>` (106), which ends a
    // chat turn (Gemma's own generation config names both).
    assert_eq!(engine.eos_token_ids(), &[1, 106]);
    let prompt = Prompt::Text("One, two, three, four,".into());
    assert_eq!(
        engine.tokenize_prompt(&prompt, &[]).unwrap(),
        ids(case, "prompt")
    );
    let want = ids(case, "greedy");
    let stream = engine
        .submit(common::greedy_request(prompt, want.len()))
        .unwrap();
    let (got, _) = common::collect_tokens(stream).expect("generation");
    assert_eq!(got, want, "served tokens");
}
