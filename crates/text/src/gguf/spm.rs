//! SentencePiece vocabularies in GGUF (`tokenizer.ggml.model = "llama"`:
//! Llama 2, Mistral, Gemma, ...) as a `tokenizers` BPE tokenizer, the way
//! Hugging Face's fast Llama and Gemma tokenizers run them.
//!
//! - **Model.** SentencePiece's BPE repeatedly joins the adjacent pair
//!   whose join is the best-ranked vocabulary piece. A `tokenizers` BPE
//!   whose merges are every split `(left, right)` of every piece into two
//!   pieces, ranked by the joined piece, applies the same rule. (A Unigram
//!   model over the same scores would pick the most probable segmentation
//!   instead, which is a different answer for BPE-trained vocabularies: not
//!   what the reference tokenizers produce.) The rank is the piece's
//!   position in the file: SentencePiece writes BPE pieces in the order
//!   their merges were learned, and their scores (`-position`, give or take
//!   an offset) agree with it, except where a GGUF converter wrote a
//!   placeholder score: Gemma's files give the user-defined whitespace runs
//!   -1000, which would push their merges after a thousand others. Only
//!   when the scores of the normal pieces rise somewhere along the file
//!   (pieces not in merge order) are the scores used instead, best first.
//! - **Unknown characters** fall back to their UTF-8 bytes (`<0xNN>`
//!   pieces), else `tokenizer.ggml.unknown_token_id`.
//! - **Spaces.** The normalizer writes each space as `▁`, after a leading
//!   `▁` when `tokenizer.ggml.add_space_prefix` is set (default true, as
//!   llama.cpp reads it; Gemma's files set it false). The prefix goes on
//!   each stretch of text between special tokens, as llama.cpp adds it.
//!   Gemma's files spell their whitespace-run pieces with real spaces;
//!   they are spelled with `▁` here, as the normalized text has them.
//! - **Decoding** turns `▁` back into spaces, `<0xNN>` pieces back into
//!   bytes, and drops the one leading space that the prefix added.
//! - Control, unknown and unused tokens are special added tokens,
//!   user-defined ones plain added tokens (matched whole in the raw text);
//!   `<bos>`/`<eos>` are added to an encoding per
//!   `tokenizer.ggml.add_bos_token` (default true, as llama.cpp does for
//!   SentencePiece) and `add_eos_token`.

use std::collections::HashMap;

use serde_json::{json, Map, Value as Json};

use super::{flag, template_post_processor, token_at, token_types, GgufHeader};

/// SentencePiece's word-boundary mark, U+2581.
const SPACE: char = '\u{2581}';

/// llama.cpp's token types (`llama_token_type`).
const NORMAL: i64 = 1;
const USER_DEFINED: i64 = 4;

/// The `tokenizer.json` of a SentencePiece vocabulary (see the module
/// docs).
///
/// # Errors
/// Token types or scores of the wrong length or kind.
pub(crate) fn tokenizer_json(header: &GgufHeader, tokens: &[&str]) -> Result<Json, String> {
    let types = token_types(header, tokens.len())?;
    let scores = scores(header, tokens.len())?;
    let pieces: Vec<String> = tokens.iter().map(|t| spelled(t)).collect();
    let mut vocab = Map::new();
    let mut ids: HashMap<&str, usize> = HashMap::new();
    let mut added = Vec::new();
    for (id, (piece, &ty)) in pieces.iter().zip(&types).enumerate() {
        if ids.contains_key(piece.as_str()) {
            tracing::warn!(
                id,
                token = piece,
                "GGUF vocabulary repeats a token; keeping the first id"
            );
        } else {
            ids.insert(piece, id);
            vocab.insert(piece.clone(), json!(id));
        }
        let respelled = piece != tokens[id];
        if matches!(ty, 2 | 3 | 5) || (ty == USER_DEFINED && !respelled) {
            added.push(json!({
                "id": id, "content": piece, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty != USER_DEFINED,
            }));
        }
    }
    let ranks = merge_ranks(&types, scores.as_deref());
    let merges = merges(&pieces, &types, &ids, &ranks);
    let prefix = flag(header, "tokenizer.ggml.add_space_prefix", true);
    let replace =
        json!({"type": "Replace", "pattern": {"String": " "}, "content": SPACE.to_string()});
    let normalizer = if prefix {
        json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPACE.to_string()}, replace,
        ]})
    } else {
        replace
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": SPACE.to_string()}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let bos = token_at(header, "tokenizer.ggml.bos_token_id", tokens)
        .filter(|_| flag(header, "tokenizer.ggml.add_bos_token", true));
    let eos = token_at(header, "tokenizer.ggml.eos_token_id", tokens)
        .filter(|_| flag(header, "tokenizer.ggml.add_eos_token", false));
    let unk = token_at(header, "tokenizer.ggml.unknown_token_id", tokens).map(|(_, t)| t);
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": template_post_processor(bos, eos),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    }))
}

/// A token as the normalized text spells it: a run of real spaces (how
/// Gemma's files store its whitespace pieces) becomes a run of `▁`.
fn spelled(token: &str) -> String {
    if !token.is_empty() && token.chars().all(|c| c == ' ') {
        token.replace(' ', &SPACE.to_string())
    } else {
        token.to_string()
    }
}

/// `tokenizer.ggml.scores`, if present.
fn scores(header: &GgufHeader, count: usize) -> Result<Option<Vec<f64>>, String> {
    let Some(items) = header.get("tokenizer.ggml.scores") else {
        return Ok(None);
    };
    let items = items
        .as_array()
        .ok_or("tokenizer.ggml.scores is not an array")?;
    if items.len() != count {
        return Err(format!("{} token scores for {count} tokens", items.len()));
    }
    items
        .iter()
        .map(|v| {
            v.as_f64()
                .ok_or_else(|| "tokenizer.ggml.scores holds a non-number".to_string())
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// The merge rank of each piece as a merge's result (lower merges first):
/// its position, unless the normal pieces' scores rise along the file,
/// then its place by score, best first (see the module docs).
fn merge_ranks(types: &[i64], scores: Option<&[f64]>) -> Vec<usize> {
    let positions = || (0..types.len()).collect();
    let Some(scores) = scores else {
        return positions();
    };
    let normal: Vec<f64> = scores
        .iter()
        .zip(types)
        .filter(|(_, &t)| t == NORMAL)
        .map(|(&s, _)| s)
        .collect();
    if normal.windows(2).all(|w| w[1] <= w[0]) {
        return positions();
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut ranks = vec![0; scores.len()];
    for (rank, id) in order.into_iter().enumerate() {
        ranks[id] = rank;
    }
    ranks
}

/// Every split of every normal or user-defined piece into two such pieces,
/// ordered by the joined piece's rank, then by the left and right ids.
fn merges(
    pieces: &[String],
    types: &[i64],
    ids: &HashMap<&str, usize>,
    ranks: &[usize],
) -> Vec<Json> {
    let mergeable = |id: usize| matches!(types[id], NORMAL | USER_DEFINED);
    let mut found: Vec<(usize, usize, usize)> = Vec::new();
    for (id, piece) in pieces.iter().enumerate() {
        if !mergeable(id) || ids.get(piece.as_str()) != Some(&id) {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                if mergeable(l) && mergeable(r) {
                    found.push((ranks[id], l, r));
                }
            }
        }
    }
    found.sort_unstable();
    found
        .into_iter()
        .map(|(_, l, r)| json!([pieces[l], pieces[r]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use crate::gguf::Value;

    use super::*;
    use crate::gguf::GgufText;

    const BYTE: i64 = 6;

    /// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte
    /// pieces, then `pieces` (normal) with `scores`, and a user-defined
    /// `<tool>`.
    fn header(pieces: &[&str], scores: &[f32], flags: &[(&str, bool)]) -> GgufHeader {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        let mut types = vec![2, 3, 3];
        let mut all_scores = vec![0.0f64; 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(BYTE);
            all_scores.push(0.0);
        }
        for (p, s) in pieces.iter().zip(scores) {
            tokens.push(p.to_string());
            types.push(NORMAL);
            all_scores.push(f64::from(*s));
        }
        tokens.push("<tool>".into());
        types.push(USER_DEFINED);
        all_scores.push(0.0);
        let mut metadata = BTreeMap::new();
        let array = |v: Vec<Value>| Value::Array(v);
        metadata.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
        metadata.insert(
            "tokenizer.ggml.tokens".into(),
            array(tokens.into_iter().map(Value::String).collect()),
        );
        metadata.insert(
            "tokenizer.ggml.token_type".into(),
            array(types.into_iter().map(Value::Int).collect()),
        );
        metadata.insert(
            "tokenizer.ggml.scores".into(),
            array(all_scores.into_iter().map(Value::Float).collect()),
        );
        metadata.insert("tokenizer.ggml.unknown_token_id".into(), Value::UInt(0));
        metadata.insert("tokenizer.ggml.bos_token_id".into(), Value::UInt(1));
        metadata.insert("tokenizer.ggml.eos_token_id".into(), Value::UInt(2));
        for (key, value) in flags {
            metadata.insert(format!("tokenizer.ggml.{key}"), Value::Bool(*value));
        }
        GgufHeader {
            version: 3,
            metadata,
            tensors: Vec::new(),
            data_start: 0,
        }
    }

    const FIRST: u32 = 3 + 256;
    // Positions FIRST.. : merge order bc, then ab, then ▁a.
    const PIECES: &[&str] = &["▁", "a", "b", "c", "bc", "ab", "▁a", "  "];
    const SCORES: &[f32] = &[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -1000.0];

    fn text(h: &GgufHeader) -> GgufText {
        GgufText::from_header(Path::new("test.gguf"), h).expect("tokenizer")
    }

    fn tokens(t: &GgufText, s: &str, special: bool) -> Vec<String> {
        t.tokenizer
            .encode(s, special)
            .unwrap()
            .into_iter()
            .map(|id| t.tokenizer.id_to_token(id).unwrap())
            .collect()
    }

    #[test]
    fn merges_follow_the_file_order_and_spaces_get_a_prefix() {
        let t = text(&header(PIECES, SCORES, &[]));
        // bc (position 4) merges before ab (5): a + bc, never ab + c.
        assert_eq!(tokens(&t, "abc", false), ["▁a", "bc"]);
        // The default adds <s> and a prefix space.
        let ids = t.tokenizer.encode("abc", true).unwrap();
        assert_eq!(ids, [1, FIRST + 6, FIRST + 4]);
        assert_eq!(t.tokenizer.decode(&ids, true).unwrap(), "abc");
        // Unknown characters fall back to their UTF-8 bytes and back.
        assert_eq!(tokens(&t, "é", false), ["▁", "<0xC3>", "<0xA9>"]);
        let ids = t.tokenizer.encode("a é", false).unwrap();
        assert_eq!(t.tokenizer.decode(&ids, false).unwrap(), "a é");
        // A user-defined token is matched whole; the text after it gets
        // its own prefix space, as llama.cpp adds it.
        assert_eq!(tokens(&t, "a<tool>b", false), ["▁a", "<tool>", "▁", "b"]);
    }

    #[test]
    fn without_a_space_prefix_spaces_and_whitespace_runs_are_kept_as_written() {
        let flags = [("add_space_prefix", false), ("add_bos_token", false)];
        let t = text(&header(PIECES, SCORES, &flags));
        assert_eq!(tokens(&t, "abc", true), ["a", "bc"]);
        // The file's two-space piece is spelled ▁▁, reached by a merge.
        assert_eq!(tokens(&t, "a  b", false), ["a", "▁▁", "b"]);
        let ids = t.tokenizer.encode(" a  bc", false).unwrap();
        assert_eq!(t.tokenizer.decode(&ids, false).unwrap(), " a  bc");
    }

    #[test]
    fn scores_rank_the_merges_when_the_pieces_are_not_in_merge_order() {
        // ab now scores above bc: a b c -> ab + c.
        let scores = [-1.0, -2.0, -3.0, -4.0, -6.0, -5.0, -7.0, -8.0];
        let flags = [("add_space_prefix", false), ("add_eos_token", true)];
        let t = text(&header(PIECES, &scores, &flags));
        assert_eq!(tokens(&t, "abc", true), ["<s>", "ab", "c", "</s>"]);
    }

    #[test]
    fn unsupported_tokenizer_models_are_named() {
        let mut h = header(PIECES, SCORES, &[]);
        h.metadata
            .insert("tokenizer.ggml.model".into(), Value::String("rwkv".into()));
        let e = GgufText::from_header(Path::new("x.gguf"), &h)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tokenizer model rwkv"), "{e}");
    }
}
