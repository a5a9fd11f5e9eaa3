//! Text <-> token ids, through a Hugging Face `tokenizer.json`.
//!
//! [`TextTokenizer`] wraps the `tokenizers` crate (the Rust core of HF
//! `tokenizers`), so byte-level BPE (GPT-2, SmolLM2, Qwen2, Llama-3) and
//! sentencepiece-style BPE with byte fallback (Llama-2, Mistral) both decode
//! and encode exactly as `transformers` does with a fast tokenizer.
//!
//! How prompts are tokenized follows mlx-lm 0.32 (`mlx_lm/generate.py`,
//! `mlx_lm/server.py`, `mlx_lm/tokenizer_utils.py`):
//! - a rendered chat template is encoded with `add_special_tokens = false`,
//!   because the template itself writes the BOS (and every other special
//!   token) it wants: [`TextTokenizer::encode_chat_prompt`];
//! - raw text adds the tokenizer's special tokens unless the text already
//!   starts with the BOS string: [`TextTokenizer::encode_text_prompt`].
//!
//! Control tokens typed in message content stay text: a user who writes
//! `<|im_end|>` must not end their turn. [`TextTokenizer::mark_special_text`]
//! puts [`CONTENT_MARK`] before every special-token string in a piece of
//! content before the template renders it, and
//! [`TextTokenizer::encode_marked_chat_prompt`] then encodes only the
//! unmarked special-token strings (the template's own markup) as control
//! tokens, and everything between them as plain text (`transformers`'
//! `split_special_tokens=True`).
//!
//! [`TextError`], the error type of all of the crate's text modules, lives
//! here too.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

/// Errors of the text side of the engine: tokenizer, chat template,
/// detokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A model file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model file is not valid JSON.
    #[error("cannot parse {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// `tokenizer.json` could not be loaded by the `tokenizers` crate.
    #[error("cannot load tokenizer {path}: {message}")]
    TokenizerLoad { path: PathBuf, message: String },
    /// A model file parsed but holds something we cannot use (for example a
    /// `chat_template` that is neither a string nor a list of named
    /// templates).
    #[error("invalid {path}: {message}")]
    InvalidModelFile { path: PathBuf, message: String },
    /// Encoding text failed inside the tokenizer.
    #[error("tokenizer encode failed: {0}")]
    Encode(String),
    /// Decoding ids failed inside the tokenizer.
    #[error("tokenizer decode failed: {0}")]
    Decode(String),
    /// The chat template does not compile (a problem of the model, found at
    /// load time).
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// The template called `raise_exception(message)`: the messages are not
    /// acceptable to this model (HTTP 400; the message is the template's own).
    #[error("{0}")]
    TemplateException(String),
    /// Rendering failed for another reason (undefined operation, type error
    /// on the given messages). Shown to the client as a 400.
    #[error("chat template error: {0}")]
    TemplateRender(String),
}

/// Marks a special-token string inside message content (a private-use
/// character, inserted before it and removed again when encoding).
pub const CONTENT_MARK: char = '\u{E000}';

/// After [`CONTENT_MARK`]: the content itself held a `CONTENT_MARK`
/// character (kept as text), so a typed mark can never turn the template's
/// next control token into text.
const ESCAPED_MARK: char = '\u{E001}';

/// A special added token, as the splitter needs it.
#[derive(Debug, Clone)]
struct SpecialToken {
    content: String,
    id: u32,
    /// Whitespace before / after it is part of the match (`AddedToken`'s
    /// `lstrip` / `rstrip`).
    lstrip: bool,
    rstrip: bool,
}

/// A tokenizer loaded from a model directory, plus the special-token strings
/// the chat template needs. Cheap to share: `Send + Sync`, all methods take
/// `&self`.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special-token strings encoded as plain text.
    plain: tokenizers::Tokenizer,
    /// The special added tokens, longest string first.
    specials: Vec<SpecialToken>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Ids of special added tokens (skipped by `decode(.., true)`), sorted.
    special_ids: Vec<u32>,
    /// Ids of the `<0xNN>` tokens when the decoder has `ByteFallback`
    /// (sentencepiece style), sorted; empty otherwise.
    byte_fallback_ids: Vec<u32>,
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json`, and the BOS/EOS strings from
    /// `dir/tokenizer_config.json` (falling back to
    /// `dir/special_tokens_map.json`, as `transformers` merges both).
    ///
    /// Errors: [`TextError::TokenizerLoad`] when `tokenizer.json` is missing
    /// or invalid; [`TextError::Io`]/[`TextError::Json`] when a config file
    /// exists but cannot be read or parsed.
    pub fn from_model_dir(dir: &Path) -> Result<Self, TextError> {
        let path = dir.join("tokenizer.json");
        let inner =
            tokenizers::Tokenizer::from_file(&path).map_err(|e| TextError::TokenizerLoad {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let (bos_token, eos_token) = bos_eos_strings(dir)?;
        Ok(Self::from_tokenizer(inner, bos_token, eos_token))
    }

    /// Wraps a `tokenizers` tokenizer built elsewhere (a GGUF's metadata,
    /// `crate::gguf`), with its BOS/EOS strings.
    pub fn from_tokenizer(
        inner: tokenizers::Tokenizer,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Self {
        let mut special_ids: Vec<u32> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, token)| token.special)
            .map(|(&id, _)| id)
            .collect();
        special_ids.sort_unstable();
        let mut byte_fallback_ids: Vec<u32> = if decoder_has_byte_fallback(&inner) {
            (0..=255u8)
                .filter_map(|b| inner.token_to_id(&format!("<0x{b:02X}>")))
                .collect()
        } else {
            Vec::new()
        };
        byte_fallback_ids.sort_unstable();
        let mut specials: Vec<SpecialToken> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, token)| token.special && !token.content.is_empty())
            .map(|(&id, token)| SpecialToken {
                content: token.content.clone(),
                id,
                lstrip: token.lstrip,
                rstrip: token.rstrip,
            })
            .collect();
        specials.sort_by(|a, b| b.content.len().cmp(&a.content.len()).then(a.id.cmp(&b.id)));
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        Self {
            inner,
            plain,
            specials,
            bos_token,
            eos_token,
            special_ids,
            byte_fallback_ids,
        }
    }

    /// The wrapped `tokenizers` tokenizer, for adapters that need the whole
    /// vocabulary (the grammar trie of [`crate::constraint`]).
    pub fn hf_tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Whether `id` is a special added token (BOS, EOS, `<|im_end|>`, ...),
    /// which `decode(.., skip_special_tokens = true)` drops.
    pub fn is_special_token(&self, id: u32) -> bool {
        self.special_ids.binary_search(&id).is_ok()
    }

    /// Whether the decoder turns byte tokens `<0xNN>` back into bytes
    /// (`ByteFallback`, as in Llama-2/Mistral sentencepiece tokenizers).
    /// Such a decoder decodes a run of byte tokens all at once: if the run
    /// is not valid UTF-8, *every* byte of it becomes U+FFFD.
    pub fn has_byte_fallback(&self) -> bool {
        !self.byte_fallback_ids.is_empty()
    }

    /// Whether `id` is a `<0xNN>` byte token of a `ByteFallback` decoder.
    pub fn is_byte_fallback_token(&self, id: u32) -> bool {
        self.byte_fallback_ids.binary_search(&id).is_ok()
    }

    /// Encodes `text` to token ids. With `add_special_tokens`, the
    /// tokenizer's post-processor adds what the model expects around a
    /// single sequence (e.g. `<s>` for Llama-2, `<|begin_of_text|>` for
    /// Llama-3; nothing for Qwen2/SmolLM2). Special-token strings inside
    /// `text` (e.g. `<|im_start|>`) always become their single ids.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|enc| enc.get_ids().to_vec())
            .map_err(|e| TextError::Encode(e.to_string()))
    }

    /// Encodes a prompt rendered by the chat template exactly as mlx-lm 0.32
    /// and `transformers.apply_chat_template(tokenize=True)` do: with
    /// `add_special_tokens = false`. The template already wrote the BOS if
    /// the model wants one; adding it again would double it.
    pub fn encode_chat_prompt(&self, rendered: &str) -> Result<Vec<u32>, TextError> {
        self.encode(rendered, false)
    }

    /// The longest special token whose string starts `text`.
    fn special_at(&self, text: &str) -> Option<&SpecialToken> {
        self.specials
            .iter()
            .find(|t| text.starts_with(t.content.as_str()))
    }

    /// `text` with [`CONTENT_MARK`] before every special-token string in
    /// it (and a `CONTENT_MARK` typed in it escaped), or `None` when it
    /// holds neither (the common case: nothing to do).
    pub fn mark_special_text(&self, text: &str) -> Option<String> {
        let mut out: Option<String> = None;
        let mut i = 0;
        while i < text.len() {
            let rest = &text[i..];
            if let Some(t) = self.special_at(rest) {
                let o = out.get_or_insert_with(|| text[..i].to_owned());
                o.push(CONTENT_MARK);
                o.push_str(&t.content);
                i += t.content.len();
                continue;
            }
            let c = rest.chars().next().unwrap_or(CONTENT_MARK);
            if c == CONTENT_MARK {
                let o = out.get_or_insert_with(|| text[..i].to_owned());
                o.push(CONTENT_MARK);
                o.push(ESCAPED_MARK);
            } else if let Some(o) = out.as_mut() {
                o.push(c);
            }
            i += c.len_utf8();
        }
        out
    }

    /// Encodes a chat prompt rendered from content marked by
    /// [`TextTokenizer::mark_special_text`]: a special-token string right
    /// after [`CONTENT_MARK`] came from content and is encoded as plain
    /// text (the mark dropped), every other one is the template's markup
    /// and becomes its control token; the text between control tokens is
    /// encoded with special-token strings as plain text, and an escaped
    /// mark as the character it was. Without marks the ids equal
    /// [`TextTokenizer::encode_chat_prompt`]'s.
    pub fn encode_marked_chat_prompt(&self, rendered: &str) -> Result<Vec<u32>, TextError> {
        let mut ids = Vec::new();
        let mut text = String::new();
        let mut i = 0;
        while i < rendered.len() {
            let rest = &rendered[i..];
            if let Some(stripped) = rest.strip_prefix(CONTENT_MARK) {
                if stripped.starts_with(ESCAPED_MARK) {
                    text.push(CONTENT_MARK);
                    i += CONTENT_MARK.len_utf8() + ESCAPED_MARK.len_utf8();
                    continue;
                }
                if let Some(t) = self.special_at(stripped) {
                    text.push_str(&t.content);
                    i += CONTENT_MARK.len_utf8() + t.content.len();
                    continue;
                }
            }
            if let Some(t) = self.special_at(rest) {
                if t.lstrip {
                    text.truncate(text.trim_end().len());
                }
                self.encode_plain(&text, &mut ids)?;
                text.clear();
                ids.push(t.id);
                i += t.content.len();
                if t.rstrip {
                    i += rendered[i..].len() - rendered[i..].trim_start().len();
                }
                continue;
            }
            let c = rest.chars().next().map_or(1, char::len_utf8);
            text.push_str(&rest[..c]);
            i += c;
        }
        self.encode_plain(&text, &mut ids)?;
        Ok(ids)
    }

    /// Encodes `text` with special-token strings as plain text and nothing
    /// added around it (client text that must not become control tokens:
    /// the parts of a fill-in-the-middle prompt).
    ///
    /// # Errors
    /// [`TextError::Encode`].
    pub fn encode_as_text(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let mut ids = Vec::new();
        self.encode_plain(text, &mut ids)?;
        Ok(ids)
    }

    /// The tokens the post-processor puts before a single sequence (a BOS
    /// for Llama-2/3 and CodeLlama; none for Qwen2 and SmolLM2).
    ///
    /// # Errors
    /// [`TextError::Encode`].
    pub fn leading_special_ids(&self) -> Result<Vec<u32>, TextError> {
        let plain = self.encode("a", false)?;
        let with = self.encode("a", true)?;
        Ok(match with.iter().position(|id| plain.first() == Some(id)) {
            Some(at) => with[..at].to_vec(),
            None => Vec::new(),
        })
    }

    /// Appends the ids of `text`, special-token strings as plain text.
    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) -> Result<(), TextError> {
        if text.is_empty() {
            return Ok(());
        }
        let enc = self
            .plain
            .encode_fast(text, false)
            .map_err(|e| TextError::Encode(e.to_string()))?;
        ids.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// Encodes a raw (non-chat) prompt the way mlx-lm 0.32's
    /// `stream_generate` does: special tokens are added unless the model has
    /// a BOS string and `text` already starts with it.
    pub fn encode_text_prompt(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let add_special_tokens = match &self.bos_token {
            Some(bos) => !text.starts_with(bos.as_str()),
            None => true,
        };
        self.encode(text, add_special_tokens)
    }

    /// Decodes ids to text. Ids outside the vocabulary are ignored (as the
    /// `tokenizers` crate does). With `skip_special_tokens`, special tokens
    /// (BOS, EOS, `<|im_end|>`, ...) produce no text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::Decode(e.to_string()))
    }

    /// Number of ids the tokenizer knows, added tokens included. The
    /// model's embedding table may be larger (padded); never smaller.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token given its exact vocabulary string (e.g.
    /// `"<|im_end|>"`, or `"Ġthe"` for a byte-level BPE piece).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary string of an id, if the id exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The BOS string from `tokenizer_config.json` (`bos_token`), if any.
    /// Passed to the chat template as `bos_token`.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS string from `tokenizer_config.json` (`eos_token`), if any.
    /// Passed to the chat template as `eos_token`.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }
}

/// The ids that end a generation: the union of `eos_token_id` in
/// `generation_config.json`, `eos_token_id` in `config.json` (top level, or
/// under `text_config` for multimodal configs; each an int or a list of
/// ints), and the id of the tokenizer's `eos_token` string. Deduplicated,
/// in that order of first appearance.
///
/// mlx-lm 0.32 uses generation_config's value when present, else config's,
/// plus the tokenizer's EOS; the union is a superset of that and never stops
/// on a token neither file names. Missing or unreadable files contribute
/// nothing (logged at `warn` when a file exists but cannot be parsed).
pub fn eos_token_ids(dir: &Path, tok: &TextTokenizer) -> Vec<u32> {
    let mut ids: Vec<u32> = Vec::new();
    let mut push = |id: u32| {
        if !ids.contains(&id) {
            ids.push(id);
        }
    };
    for file in ["generation_config.json", "config.json"] {
        let path = dir.join(file);
        let json = match read_json_opt(&path) {
            Ok(json) => json,
            Err(e) => {
                tracing::warn!(error = %e, "ignoring eos_token_id of an unreadable file");
                None
            }
        };
        let Some(json) = json else { continue };
        let value = json
            .get("eos_token_id")
            .or_else(|| json.get("text_config").and_then(|t| t.get("eos_token_id")));
        for id in json_ids(value) {
            push(id);
        }
    }
    if let Some(id) = tok.eos_token().and_then(|eos| tok.token_to_id(eos)) {
        push(id);
    }
    ids
}

/// Special-token strings that end a turn or a document in the chat
/// formats and vocabularies mlxcel serves (llama.cpp's end-of-generation
/// tokens by text: ChatML's `<|im_end|>`, GPT-2's and Qwen's
/// `<|endoftext|>`, Llama 3's `<|eot_id|>`, `<|eom_id|>` and
/// `<|end_of_text|>`, Phi-3's `<|end|>`, Gemma's `<end_of_turn>`, gpt-oss's
/// `<|return|>` and `<|call|>`, CodeLlama's `<EOT>`, DeepSeek's
/// end of sentence).
pub const END_OF_GENERATION_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
];

impl TextTokenizer {
    /// Ids of this vocabulary's special tokens whose text is one of
    /// [`END_OF_GENERATION_TOKENS`], ascending: sampling one ends the
    /// reply whatever the checkpoint's configs name as EOS (a Qwen model
    /// emitting `<|endoftext|>` where its config names only `<|im_end|>`),
    /// as llama.cpp and the generation configs of these families do.
    pub fn end_of_generation_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .specials
            .iter()
            .filter(|t| END_OF_GENERATION_TOKENS.contains(&t.content.as_str()))
            .map(|t| t.id)
            .collect();
        ids.sort_unstable();
        ids
    }
}

/// `ids` followed by every end-of-generation id of `tok` not in it
/// ([`TextTokenizer::end_of_generation_ids`]): the EOS ids generation
/// stops at, the configured ones first.
pub fn with_end_of_generation(mut ids: Vec<u32>, tok: &TextTokenizer) -> Vec<u32> {
    for id in tok.end_of_generation_ids() {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// Whether the tokenizer's decoder (or one in its `Sequence`) is
/// `ByteFallback`, read from the decoder's serialized form.
fn decoder_has_byte_fallback(inner: &tokenizers::Tokenizer) -> bool {
    inner
        .get_decoder()
        .and_then(|d| serde_json::to_value(d).ok())
        .is_some_and(|json| json_has_type(&json, "ByteFallback"))
}

/// Whether a JSON tree has an object with `"type": ty` anywhere.
fn json_has_type(json: &Json, ty: &str) -> bool {
    match json {
        Json::Object(map) => {
            map.get("type").and_then(Json::as_str) == Some(ty)
                || map.values().any(|v| json_has_type(v, ty))
        }
        Json::Array(items) => items.iter().any(|v| json_has_type(v, ty)),
        _ => false,
    }
}

/// Ids from a JSON value that is an int or a list of ints (other shapes give
/// nothing).
fn json_ids(value: Option<&Json>) -> Vec<u32> {
    let as_id = |v: &Json| v.as_u64().and_then(|n| u32::try_from(n).ok());
    match value {
        Some(Json::Array(items)) => items.iter().filter_map(as_id).collect(),
        Some(v) => as_id(v).into_iter().collect(),
        None => Vec::new(),
    }
}

/// The `(bos_token, eos_token)` strings of a model directory: from
/// `tokenizer_config.json`, else from `special_tokens_map.json` (both
/// optional).
pub(crate) fn bos_eos_strings(dir: &Path) -> Result<(Option<String>, Option<String>), TextError> {
    let config = read_json_opt(&dir.join("tokenizer_config.json"))?;
    let special = read_json_opt(&dir.join("special_tokens_map.json"))?;
    let lookup = |key: &str| {
        config
            .as_ref()
            .and_then(|c| special_token_string(c.get(key)))
            .or_else(|| {
                special
                    .as_ref()
                    .and_then(|s| special_token_string(s.get(key)))
            })
    };
    Ok((lookup("bos_token"), lookup("eos_token")))
}

/// A special token as `tokenizer_config.json` writes it: a string, or an
/// `AddedToken` object `{"content": "...", ...}`; `null` or absent is `None`.
pub(crate) fn special_token_string(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(s) => Some(s.clone()),
        Json::Object(map) => map.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// Reads and parses a JSON file; `Ok(None)` when it does not exist.
pub(crate) fn read_json_opt(path: &Path) -> Result<Option<Json>, TextError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TextError::Io {
                path: path.to_owned(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TextError::Json {
            path: path.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests;
