//! The text side of a GGUF checkpoint: the tokenizer built from its
//! `tokenizer.ggml.*` metadata (as a `tokenizers` tokenizer), the chat
//! template from `tokenizer.chat_template`, and the BOS/EOS tokens.
//!
//! Vocabularies: `tokenizer.ggml.model` `gpt2` (byte-level BPE: `tokens`,
//! `merges`, `token_type`) with the pre-tokenizer named by
//! `tokenizer.ggml.pre` (`smollm`, `gpt-2`/`default`, `llama-bpe`/`llama3`,
//! `qwen2`), and `llama` (SentencePiece BPE: `tokens`, `scores`,
//! `token_type`, see [`spm`]). Other tokenizer models and
//! pre-tokenizers are refused by name. Token types (llama.cpp's
//! `llama_token_type`): control (3), unknown (2) and unused (5) tokens
//! become special added tokens, user-defined ones (4) plain added tokens.

use std::path::Path;

/// The GGUF header and its metadata values (`mlxcel-gguf`, no MLX).
pub(crate) use mlxcel_gguf::{GgufHeader, Value};
use serde_json::{json, Value as Json};

use crate::tokenizer::{TextError, TextTokenizer};

mod spm;

/// The split that GPT-2 style byte-level BPEs apply before byte-level
/// mapping, for `llama-bpe` (numbers in runs of up to 3 digits).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The same for `qwen2` (every digit alone).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What the engine needs from a GGUF's tokenizer metadata.
#[derive(Debug)]
pub struct GgufText {
    pub tokenizer: TextTokenizer,
    /// `tokenizer.chat_template`, if any.
    pub chat_template: Option<String>,
    /// The BOS and EOS strings (`tokens[bos_token_id]`, ...).
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Ids that end a generation: `eos_token_id`, then `eot_token_id` and
    /// `eom_token_id` when present.
    pub eos_ids: Vec<u32>,
}

impl GgufText {
    /// Builds the text side from `header` (of the file at `path`, for
    /// errors).
    ///
    /// # Errors
    /// [`TextError::InvalidModelFile`] naming a missing key, an unsupported
    /// tokenizer model or pre-tokenizer; [`TextError::TokenizerLoad`] when
    /// `tokenizers` refuses the result.
    pub fn from_header(path: &Path, header: &GgufHeader) -> Result<Self, TextError> {
        let invalid = |message: String| TextError::InvalidModelFile {
            path: path.to_path_buf(),
            message,
        };
        let tokens = strings(header, "tokenizer.ggml.tokens").map_err(invalid)?;
        let json = tokenizer_json(header, &tokens).map_err(invalid)?;
        let inner: tokenizers::Tokenizer =
            json.to_string()
                .parse()
                .map_err(|e: tokenizers::Error| TextError::TokenizerLoad {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
        let token = |key: &str| -> Option<(u32, String)> {
            let id = header.get(key)?.as_u64()?;
            let text = tokens.get(usize::try_from(id).ok()?)?;
            Some((u32::try_from(id).ok()?, text.to_string()))
        };
        let bos_token = token("tokenizer.ggml.bos_token_id").map(|t| t.1);
        let eos = token("tokenizer.ggml.eos_token_id");
        let mut eos_ids: Vec<u32> = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some((id, _)) = token(key) {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        let eos_token = eos.map(|t| t.1);
        let chat_template = header
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
            .map(str::to_string);
        let tokenizer = TextTokenizer::from_tokenizer(inner, bos_token.clone(), eos_token.clone());
        Ok(GgufText {
            tokenizer,
            chat_template,
            bos_token,
            eos_token,
            eos_ids,
        })
    }
}

/// The string array `key`.
fn strings<'a>(header: &'a GgufHeader, key: &str) -> Result<Vec<&'a str>, String> {
    let items = header
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| format!("GGUF has no {key}"))?;
    items
        .iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| format!("{key} holds a non-string"))
        })
        .collect()
}

/// The `tokenizer.json` (the `tokenizers` serialization) that the metadata
/// describes.
fn tokenizer_json(header: &GgufHeader, tokens: &[&str]) -> Result<Json, String> {
    let model = header
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or("GGUF has no tokenizer.ggml.model")?;
    match model {
        "gpt2" => byte_level_json(header, tokens),
        "llama" => spm::tokenizer_json(header, tokens),
        other => Err(format!(
            "tokenizer model {other} (supported: gpt2, byte-level BPE; llama, SentencePiece)"
        )),
    }
}

/// `tokenizer.ggml.token_type`, one per token (all normal, 1, when the
/// key is missing).
pub(crate) fn token_types(header: &GgufHeader, count: usize) -> Result<Vec<i64>, String> {
    let types: Vec<i64> = match header.get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::Int(i) => Ok(*i),
                Value::UInt(u) => i64::try_from(*u).map_err(|_| "bad token type".to_string()),
                _ => Err("tokenizer.ggml.token_type holds a non-integer".to_string()),
            })
            .collect::<Result<_, _>>()?,
        _ => vec![1; count],
    };
    if types.len() != count {
        return Err(format!("{} token types for {count} tokens", types.len()));
    }
    Ok(types)
}

/// The id and text of the token whose id is at `key`, if any.
pub(crate) fn token_at<'a>(
    header: &GgufHeader,
    key: &str,
    tokens: &[&'a str],
) -> Option<(u64, &'a str)> {
    let id = header.get(key)?.as_u64()?;
    Some((id, *tokens.get(usize::try_from(id).ok()?)?))
}

/// Whether the bool `key` is set (`default` when missing).
pub(crate) fn flag(header: &GgufHeader, key: &str, default: bool) -> bool {
    header.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// A `TemplateProcessing` post-processor that puts `bos` before and `eos`
/// after each sequence (either may be absent), or `None` when both are.
pub(crate) fn template_post_processor(
    bos: Option<(u64, &str)>,
    eos: Option<(u64, &str)>,
) -> Option<Json> {
    if bos.is_none() && eos.is_none() {
        return None;
    }
    let special = |(_, text): (u64, &str), type_id: u32| json!({"SpecialToken": {"id": text, "type_id": type_id}});
    let sequence = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    for (items, parts) in [
        (&mut single, &[("A", 0u32)][..]),
        (&mut pair, &[("A", 0), ("B", 1)][..]),
    ] {
        for &(id, type_id) in parts {
            items.extend(bos.map(|t| special(t, type_id)));
            items.push(sequence(id, type_id));
            items.extend(eos.map(|t| special(t, type_id)));
        }
    }
    let mut special_tokens = serde_json::Map::new();
    for (id, text) in bos.into_iter().chain(eos) {
        special_tokens.insert(
            text.to_string(),
            json!({"id": text, "ids": [id], "tokens": [text]}),
        );
    }
    Some(json!({
        "type": "TemplateProcessing", "single": single, "pair": pair,
        "special_tokens": special_tokens,
    }))
}

/// The `tokenizer.json` of a byte-level BPE vocabulary (`gpt2`).
fn byte_level_json(header: &GgufHeader, tokens: &[&str]) -> Result<Json, String> {
    let pre = header
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let (normalizer, pre_tokenizer) = pre_tokenizer(pre)?;
    let types = token_types(header, tokens.len())?;
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (id, (&text, &ty)) in tokens.iter().zip(&types).enumerate() {
        if vocab.contains_key(text) {
            tracing::warn!(
                id,
                token = text,
                "GGUF vocabulary repeats a token; keeping the first id"
            );
        } else {
            vocab.insert(text.to_string(), json!(id));
        }
        if matches!(ty, 2..=5) {
            added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty != 4,
            }));
        }
    }
    let merges: Vec<Json> = strings(header, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| format!("merge {m:?} is not two tokens"))
        })
        .collect::<Result<_, _>>()?;
    let bos = token_at(header, "tokenizer.ggml.bos_token_id", tokens)
        .filter(|_| flag(header, "tokenizer.ggml.add_bos_token", false));
    let eos = token_at(header, "tokenizer.ggml.eos_token_id", tokens)
        .filter(|_| flag(header, "tokenizer.ggml.add_eos_token", false));
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false,
    });
    let post_processor = template_post_processor(bos, eos).unwrap_or_else(|| byte_level.clone());
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    }))
}

/// The normalizer and pre-tokenizer of llama.cpp's pre-tokenizer `pre`.
fn pre_tokenizer(pre: &str) -> Result<(Json, Json), String> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |regex: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    Ok(match pre {
        // GPT-2's own split, inside ByteLevel.
        "default" | "gpt-2" => (Json::Null, byte_level(true)),
        // Every digit alone, then GPT-2's split.
        "smollm" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true),
            ]}),
        ),
        "llama-bpe" | "llama3" => (Json::Null, split(LLAMA3_SPLIT)),
        "qwen2" => (json!({"type": "NFC"}), split(QWEN2_SPLIT)),
        other => {
            return Err(format!(
                "pre-tokenizer {other} (supported: default, gpt-2, smollm, llama-bpe, qwen2)"
            ))
        }
    })
}
