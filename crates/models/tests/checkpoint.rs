//! A checkpoint opened once serves the config, the tokenizer's metadata
//! and the weights: a GGUF file's header is read once, however many of
//! them a start-up asks for (counted by `mlxcel-gguf`'s `count-reads`).

use std::path::{Path, PathBuf};

use mlxcel_gguf::count_reads::header_reads;
use mlxcel_mlx::Dtype;
use mlxcel_model::{LoadOptions, WeightMode};
use mlxcel_models::Checkpoint;

/// A metadata value as GGUF stores it.
enum Meta {
    U32(u32),
    F32(f32),
    Str(&'static str),
}

/// A minimal GGUF v3 file: `meta`, then float32 tensors (row-major shape,
/// written innermost first as GGUF does) filled with small values.
fn write_gguf(path: &Path, meta: &[(&str, Meta)], tensors: &[(&str, &[u64])]) {
    let string = |b: &mut Vec<u8>, s: &str| {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    };
    let mut b: Vec<u8> = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        string(&mut b, key);
        match value {
            Meta::U32(v) => {
                b.extend(4u32.to_le_bytes());
                b.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                b.extend(6u32.to_le_bytes());
                b.extend(v.to_le_bytes());
            }
            Meta::Str(s) => {
                b.extend(8u32.to_le_bytes());
                string(&mut b, s);
            }
        }
    }
    let mut data = Vec::new();
    for (name, shape) in tensors {
        string(&mut b, name);
        b.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            b.extend(d.to_le_bytes());
        }
        b.extend(0u32.to_le_bytes());
        b.extend((data.len() as u64).to_le_bytes());
        let count: u64 = shape.iter().product();
        for i in 0..count {
            data.extend((((i % 7) as f32 - 3.0) * 0.01).to_le_bytes());
        }
        data.resize(data.len().div_ceil(32) * 32, 0);
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    b.extend(data);
    std::fs::write(path, b).unwrap();
}

/// A one-layer llama (hidden 8, 2 query heads of 4, 1 KV head, MLP 16,
/// vocabulary 16, tied embeddings) in `dir`.
fn tiny_llama(dir: &Path) -> PathBuf {
    let path = dir.join("tiny-llama.gguf");
    write_gguf(
        &path,
        &[
            ("general.architecture", Meta::Str("llama")),
            ("llama.block_count", Meta::U32(1)),
            ("llama.embedding_length", Meta::U32(8)),
            ("llama.feed_forward_length", Meta::U32(16)),
            ("llama.attention.head_count", Meta::U32(2)),
            ("llama.attention.head_count_kv", Meta::U32(1)),
            ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
            ("llama.context_length", Meta::U32(64)),
            ("tokenizer.ggml.model", Meta::Str("gpt2")),
        ],
        &[
            ("token_embd.weight", &[16, 8]),
            ("output_norm.weight", &[8]),
            ("blk.0.attn_norm.weight", &[8]),
            ("blk.0.attn_q.weight", &[8, 8]),
            ("blk.0.attn_k.weight", &[4, 8]),
            ("blk.0.attn_v.weight", &[4, 8]),
            ("blk.0.attn_output.weight", &[8, 8]),
            ("blk.0.ffn_norm.weight", &[8]),
            ("blk.0.ffn_gate.weight", &[16, 8]),
            ("blk.0.ffn_up.weight", &[16, 8]),
            ("blk.0.ffn_down.weight", &[8, 16]),
        ],
    );
    path
}

#[test]
fn one_checkpoint_reads_a_gguf_header_once_for_config_text_and_weights() {
    let dir = std::env::temp_dir().join(format!("mlxcel-checkpoint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = tiny_llama(&dir);
    assert_eq!(header_reads(&path), 0);

    let checkpoint = Checkpoint::open(&path).expect("open");
    let config = checkpoint.config().expect("config");
    assert_eq!(config.model_type, "llama");
    assert_eq!(config.num_hidden_layers, 1);
    assert_eq!(config.num_key_value_heads, 1);
    let header = checkpoint.gguf_header().expect("a GGUF header");
    assert_eq!(
        header.get("tokenizer.ggml.model").and_then(|v| v.as_str()),
        Some("gpt2")
    );
    assert_eq!(checkpoint.gguf().unwrap().arch().name, "llama");
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let model = checkpoint.load_model(config, options).expect("load");
    assert_eq!(model.config().num_hidden_layers, 1);
    assert_eq!(
        header_reads(&path),
        1,
        "config, header and weights: one read"
    );

    // The one-shot wrappers open the file each.
    let config = mlxcel_models::read_config(&path).unwrap();
    assert_eq!(header_reads(&path), 2);
    mlxcel_models::load_model(&path, config, options).unwrap();
    assert_eq!(header_reads(&path), 3);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_directory_checkpoint_has_no_gguf_header() {
    let dir = std::env::temp_dir().join(format!("mlxcel-checkpoint-dir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let checkpoint = Checkpoint::open(&dir).expect("a directory opens lazily");
    assert!(checkpoint.gguf_header().is_none());
    assert_eq!(checkpoint.path(), dir.as_path());
    // No config.json: the error read_config gives.
    assert_eq!(
        checkpoint.config().unwrap_err().to_string(),
        mlxcel_models::read_config(&dir).unwrap_err().to_string()
    );
    std::fs::remove_dir_all(dir).unwrap();
}
