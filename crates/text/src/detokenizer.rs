//! Streaming decode of generated tokens into text deltas.
//!
//! Decoding one token at a time is wrong for two reasons: a byte-level BPE
//! token (or a sentencepiece `<0xNN>` byte-fallback token) may hold only
//! part of a UTF-8 character, and sentencepiece decoders drop the leading
//! space of the *first* token of what they decode. [`IncrementalDetokenizer`]
//! uses the two-offset window of HF text-generation-inference
//! (`server/text_generation_server/models/model.py`, `decode_token`) and
//! vLLM (`vllm/transformers_utils/detokenizer_utils.py`,
//! `detokenize_incrementally`): it decodes `ids[prefix..read]` (text already
//! sent) and `ids[prefix..]`, and sends the difference only when it does not
//! end in U+FFFD (an unfinished character). Both windows start at the same
//! token, so a decoder's start-of-text rule (strip one leading space) acts on
//! both alike. One addition for sentencepiece `ByteFallback` decoders, which
//! turn a whole run of `<0xNN>` tokens into U+FFFDs when any byte of the run
//! is invalid (so text already sent could change): a run is held until a
//! token that is neither a byte token nor a special token closes it.
//!
//! Property (tested): the concatenation of every [`IncrementalDetokenizer::push`]
//! result and the final [`IncrementalDetokenizer::flush`] equals
//! `tok.decode(all_ids, true)`.

use crate::tokenizer::{TextError, TextTokenizer};

/// The replacement character a lossy UTF-8 decode (byte-level BPE) or the
/// `ByteFallback` decoder writes for incomplete bytes.
const REPLACEMENT: char = '\u{FFFD}';

/// Per-request streaming decoder state. Special tokens are skipped (as with
/// `decode(ids, skip_special_tokens = true)`). Memory grows with the number
/// of tokens pushed (the ids are kept); each push decodes only the short
/// window since the last emitted text.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    /// Start of the decode window: the first token of the last emitted text.
    prefix_offset: usize,
    /// End of the text already emitted, in tokens.
    read_offset: usize,
}

impl IncrementalDetokenizer {
    /// A detokenizer for a new completion (no tokens yet).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one generated token and returns the text it completes, possibly
    /// empty (an unfinished multi-byte character is held back, as is a token
    /// that decodes to nothing, such as a special token).
    ///
    /// Errors: [`TextError::Decode`] from the tokenizer.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        // A `ByteFallback` decoder decodes a run of byte tokens as one unit
        // (all of it becomes U+FFFD if any byte is bad), and skipped special
        // tokens do not end a run: wait for a token that closes it.
        if tok.has_byte_fallback() && (tok.is_byte_fallback_token(id) || tok.is_special_token(id)) {
            return Ok(String::new());
        }
        self.release(tok)
    }

    /// [`Self::push`] of a special token that the output filter reads as
    /// text of the reply (a tool-call marker such as Gemma 4's `<|"|>`,
    /// [`crate::output::OutputFilter::reads_marker`]): a run of byte tokens
    /// before it is decoded now instead of being held past it, so its text
    /// reaches the filter before the marker does. (Bytes of one character
    /// on both sides of the marker would come out as U+FFFD; a model does
    /// not write those.)
    ///
    /// Errors: [`TextError::Decode`] from the tokenizer.
    pub fn push_marker(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        self.release(tok)
    }

    /// The text of the tokens not yet sent, when it does not end inside a
    /// character.
    fn release(&mut self, tok: &TextTokenizer) -> Result<String, TextError> {
        let (sent, all) = self.decode_windows(tok)?;
        if all.len() > sent.len() && !all.ends_with(REPLACEMENT) {
            if let Some(delta) = all.strip_prefix(sent.as_str()) {
                let delta = delta.to_owned();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return Ok(delta);
            }
        }
        Ok(String::new())
    }

    /// Returns whatever is held back (at the end of generation), including a
    /// trailing U+FFFD for bytes that never formed a character, exactly as a
    /// full decode would show them. The detokenizer is then drained: a later
    /// `flush` returns an empty string.
    ///
    /// Errors: [`TextError::Decode`] from the tokenizer.
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<String, TextError> {
        let (sent, all) = self.decode_windows(tok)?;
        let delta = match all.strip_prefix(sent.as_str()) {
            Some(delta) => delta.to_owned(),
            // A decoder whose output is not prefix-stable (none of the
            // byte-level or sentencepiece decoders): send the part after the
            // common prefix rather than lose it.
            None => all[common_prefix_len(&sent, &all)..].to_owned(),
        };
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Decodes the already-sent window `ids[prefix..read]` and the whole
    /// window `ids[prefix..]`.
    fn decode_windows(&self, tok: &TextTokenizer) -> Result<(String, String), TextError> {
        let sent = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let all = tok.decode(&self.ids[self.prefix_offset..], true)?;
        Ok((sent, all))
    }
}

/// Byte length of the longest common prefix of `a` and `b` that ends on a
/// char boundary of both.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    use std::path::Path;

    fn load(name: &str) -> TextTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        TextTokenizer::from_model_dir(&dir).expect("fixture tokenizer loads")
    }

    /// Streams `ids` through a detokenizer; returns the pieces (last one is
    /// the flush).
    fn stream(tok: &TextTokenizer, ids: &[u32]) -> Vec<String> {
        let mut detok = IncrementalDetokenizer::new();
        let mut pieces: Vec<String> = ids.iter().map(|&id| detok.push(tok, id).unwrap()).collect();
        pieces.push(detok.flush(tok).unwrap());
        pieces
    }

    fn assert_streams_like_decode(tok: &TextTokenizer, ids: &[u32]) {
        let pieces = stream(tok, ids);
        assert_eq!(
            pieces.concat(),
            tok.decode(ids, true).unwrap(),
            "ids {ids:?}"
        );
        // No piece but the flush may carry an unfinished character.
        for piece in &pieces[..pieces.len() - 1] {
            assert!(
                !piece.ends_with(REPLACEMENT),
                "ids {ids:?}: piece {piece:?}"
            );
        }
    }

    const TEXTS: &[&str] = &[
        "Hello world! This is a test.",
        "  leading spaces and trailing  ",
        "Emoji: 🙂 👍🏽 🇫🇷 ❤️ 🚀 and more 🧪",
        "你好，世界。日本語のテキストです。한국어 텍스트",
        "café naïve résumé — “quotes”",
        "tabs\tand\nnewlines\n\n  indented",
        "<|im_start|>assistant\nHi<|im_end|> after",
    ];

    #[test]
    fn texts_stream_exactly_for_both_tokenizer_kinds() {
        for name in ["bytelevel", "spm"] {
            let tok = load(name);
            for text in TEXTS {
                for add_special in [false, true] {
                    let ids = tok.encode(text, add_special).unwrap();
                    assert_streams_like_decode(&tok, &ids);
                    if !text.contains("<|") {
                        assert_eq!(stream(&tok, &ids).concat(), *text, "{name}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_split_emoji_is_held_back_until_complete() {
        let tok = load("spm");
        // "🙂" is four <0xNN> byte-fallback tokens in this vocabulary.
        let ids = tok.encode("a🙂", false).unwrap();
        let pieces = stream(&tok, &ids);
        let emoji_at = pieces.iter().position(|p| p.contains('🙂')).unwrap();
        assert!(pieces[emoji_at - 3..emoji_at].iter().all(String::is_empty));
        assert_eq!(pieces.concat(), "a🙂");

        let tok = load("bytelevel");
        let ids = tok.encode("你好🙂", false).unwrap();
        assert!(ids.len() > 3, "test needs multi-token chars: {ids:?}");
        assert_eq!(stream(&tok, &ids).concat(), "你好🙂");
    }

    #[test]
    fn unfinished_bytes_come_out_at_flush() {
        let tok = load("spm");
        let f0 = tok.token_to_id("<0xF0>").unwrap();
        let ids = [tok.encode("ok", false).unwrap(), vec![f0]].concat();
        let pieces = stream(&tok, &ids);
        assert_eq!(pieces.last().unwrap(), "\u{FFFD}");
        assert_eq!(pieces.concat(), tok.decode(&ids, true).unwrap());
    }

    #[test]
    fn random_id_sequences_stream_like_decode() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
        for name in ["bytelevel", "spm"] {
            let tok = load(name);
            let vocab = tok.vocab_size() as u32;
            for _ in 0..300 {
                let len = 1 + (rng.next_u32() % 40) as usize;
                let ids: Vec<u32> = (0..len).map(|_| rng.next_u32() % vocab).collect();
                assert_streams_like_decode(&tok, &ids);
            }
        }
    }

    #[test]
    fn random_byte_token_sequences_stream_like_decode() {
        // Sequences of byte tokens only: most split characters arbitrarily.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let spm = load("spm");
        let spm_bytes: Vec<u32> = (0..=255u8)
            .filter_map(|b| spm.token_to_id(&format!("<0x{b:02X}>")))
            .collect();
        assert_eq!(spm_bytes.len(), 256);
        for _ in 0..300 {
            let len = 1 + (rng.next_u32() % 24) as usize;
            let ids: Vec<u32> = (0..len)
                .map(|_| spm_bytes[(rng.next_u32() % 256) as usize])
                .collect();
            assert_streams_like_decode(&spm, &ids);
        }
        // Valid multi-byte text cut into single-byte tokens.
        let text = "ü€😀 中文 ok";
        let ids: Vec<u32> = text.bytes().map(|b| spm_bytes[b as usize]).collect();
        assert_eq!(stream(&spm, &ids).concat(), text);
    }

    #[test]
    fn a_marker_releases_the_bytes_before_it() {
        let tok = load("spm");
        // "🙂" is four byte tokens here; the BOS `<s>` stands in for a
        // marker.
        let ids = tok.encode("a🙂", false).unwrap();
        let marker = tok.token_to_id("<s>").unwrap();
        assert!(tok.is_special_token(marker));
        let mut detok = IncrementalDetokenizer::new();
        let before: String = ids
            .iter()
            .map(|&id| detok.push(&tok, id).unwrap())
            .collect();
        assert_eq!(before, "a");
        // Held by a plain push (the run goes on past a special token)...
        let mut held = detok.clone();
        assert_eq!(held.push(&tok, marker).unwrap(), "");
        // ...released before the marker by `push_marker`.
        assert_eq!(detok.push_marker(&tok, marker).unwrap(), "🙂");
        assert_eq!(detok.flush(&tok).unwrap(), "");
    }

    #[test]
    fn flush_twice_is_empty() {
        let tok = load("bytelevel");
        let mut detok = IncrementalDetokenizer::new();
        for id in tok.encode("hi there", false).unwrap() {
            detok.push(&tok, id).unwrap();
        }
        detok.flush(&tok).unwrap();
        assert_eq!(detok.flush(&tok).unwrap(), "");
    }

    #[test]
    fn common_prefix_respects_char_boundaries() {
        assert_eq!(common_prefix_len("aé", "aè"), 1);
        assert_eq!(common_prefix_len("abc", "ab"), 2);
        assert_eq!(common_prefix_len("", "x"), 0);
    }
}
