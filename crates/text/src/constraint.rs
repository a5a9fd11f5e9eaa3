//! Constrained decoding: an output grammar enforced token by token.
//!
//! Built on [`llguidance`] (Earley parser over a lexer, masks computed against
//! a token trie) and its Hugging Face adapter [`toktrie_hf_tokenizers`], which
//! turns a `tokenizer.json` vocabulary into token bytes (byte-level BPE byte
//! map, `<0xNN>` byte fallback, added tokens of the form `<...>` as special
//! tokens).
//!
//! - [`GrammarTokenizer`]: once per model, at load (builds the trie; about a
//!   second for a 50k vocabulary).
//! - [`Grammar`]: what a request asks for (JSON object, JSON Schema, tool
//!   calls after a forced reply's start, in the Hermes, harmony, Mistral
//!   v11, Qwen3-Coder XML or Gemma 4 format).
//! - [`ConstrainedDecoder`]: one per request; per step [`mask_logits`] before
//!   sampling, then [`accept`] the sampled token, until [`is_finished`].
//!
//! JSON is generated without free whitespace: items are separated by `", "`
//! and keys by `": "` (Python's `json.dumps` defaults), so a model cannot
//! spin on endless spaces or newlines.
//!
//! [`mask_logits`]: ConstrainedDecoder::mask_logits
//! [`accept`]: ConstrainedDecoder::accept
//! [`is_finished`]: ConstrainedDecoder::is_finished

use std::sync::Arc;

use llguidance::api::{GrammarInit, ParserLimits, StopReason, TopLevelGrammar};
use llguidance::toktrie::{TokEnv, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value as Json};
use toktrie_hf_tokenizers::ByteTokenizer;

use crate::output::tool_calls::gemma4::{GEMMA4_CALL_CLOSE, GEMMA4_CALL_OPEN, GEMMA4_QUOTE};
use crate::tokenizer::TextTokenizer;

mod gemma4;

/// Errors of constrained decoding.
#[derive(Debug, thiserror::Error)]
pub enum ConstraintError {
    /// The grammar or schema does not compile (the request's fault: HTTP 400).
    /// The message is llguidance's.
    #[error("invalid grammar: {0}")]
    InvalidGrammar(String),
    /// [`ConstrainedDecoder::accept`] got a token the grammar forbids here.
    #[error("token {token} rejected by the grammar: {message}")]
    Rejected { token: u32, message: String },
    /// The matcher failed (internal error or limits hit); the decoder is
    /// unusable afterwards.
    #[error("grammar matcher failed: {0}")]
    Matcher(String),
    /// The tokenizer cannot be turned into a token trie (unknown decoder
    /// type, EOS ids out of range, model vocabulary smaller than the
    /// tokenizer's).
    #[error("grammar tokenizer: {0}")]
    Tokenizer(String),
}

/// JSON layout options handed to llguidance (`x-guidance` in a schema): fixed
/// separators, no other whitespace.
fn json_layout() -> Json {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// The model's tokenizer as llguidance needs it: token bytes, the token trie
/// and the parser factory. Built once per model at load; cheap to clone
/// (`Arc` inside), `Send + Sync`.
#[derive(Clone)]
pub struct GrammarTokenizer {
    inner: Arc<TokInner>,
}

struct TokInner {
    factory: ParserFactory,
    /// Bytes of each tokenizer id (special tokens: their text); ids at or
    /// past `len()` are padding rows of the model's output.
    token_bytes: Vec<Vec<u8>>,
    /// Rows of the model's output (the length `mask_logits` expects).
    vocab_size: usize,
    /// Whether `<tool_call>` and `</tool_call>` are single special tokens
    /// (Qwen): tool-call grammars then name the tokens, not their text.
    tool_tags_special: bool,
    /// Whether harmony's `<|constrain|>` and `<|message|>` are special
    /// tokens (gpt-oss): harmony grammars then name the tokens.
    harmony_special: bool,
    /// The ids of Mistral's `[TOOL_CALLS]` and `[ARGS]` when they are
    /// special tokens (v11 tokenizers): Mistral grammars name the tokens.
    mistral_markers: Option<(u32, u32)>,
    /// The ids of Gemma 4's `<|tool_call>`, `<tool_call|>` and `<|"|>`,
    /// each when it is a special token: Gemma 4 grammars name those tokens.
    gemma4_markers: [Option<u32>; 3],
}

impl GrammarTokenizer {
    /// Builds the trie from the model's tokenizer.
    ///
    /// `vocab_size` is the number of rows of the model's output (logits
    /// length); it may exceed the tokenizer's vocabulary, and those extra ids
    /// are never allowed. `eos` are the model's EOS token ids: the first is
    /// the trie's EOS, all of them are allowed where the grammar may end.
    /// Empty `eos` keeps the EOS the adapter detects (`</s>`,
    /// `<|endoftext|>`, ...).
    ///
    /// Errors: [`ConstraintError::Tokenizer`] when the decoder is neither
    /// byte-level nor byte-fallback, an EOS id is outside the tokenizer's
    /// vocabulary, or `vocab_size` is smaller than the tokenizer's vocabulary.
    pub fn new(
        tokenizer: &TextTokenizer,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<Self, ConstraintError> {
        let tok_err = |e: anyhow::Error| ConstraintError::Tokenizer(format!("{e:#}"));
        let mut byte_tok =
            ByteTokenizer::from_tokenizer(tokenizer.hf_tokenizer().clone()).map_err(tok_err)?;
        let n_tok = byte_tok.tokrx_info().vocab_size as usize;
        if vocab_size < n_tok {
            return Err(ConstraintError::Tokenizer(format!(
                "model vocabulary ({vocab_size} rows) is smaller than the tokenizer's ({n_tok})"
            )));
        }
        if let Some(&bad) = eos.iter().find(|&&id| id as usize >= n_tok) {
            return Err(ConstraintError::Tokenizer(format!(
                "EOS id {bad} is outside the tokenizer's vocabulary ({n_tok})"
            )));
        }
        if !eos.is_empty() {
            byte_tok.set_eos_tokens(eos);
        }
        let mut token_bytes = byte_tok.token_bytes();
        for (id, added) in byte_tok.hf_tokenizer.get_added_tokens_decoder() {
            if let Some(bytes) = token_bytes.get_mut(id as usize) {
                *bytes = added.content.into_bytes();
            }
        }
        let mut encoder = byte_tok.hf_tokenizer.clone();
        encoder.set_encode_special_tokens(true);
        let env: TokEnv = Arc::new(TextOnlyEnv {
            inner: byte_tok.into_tok_env(Some(vocab_size)).map_err(tok_err)?,
            encoder,
        });
        let trie = env.tok_trie();
        let tool_tags_special = trie.get_special_token("<tool_call>").is_some()
            && trie.get_special_token("</tool_call>").is_some();
        let harmony_special = trie.get_special_token("<|constrain|>").is_some()
            && trie.get_special_token("<|message|>").is_some();
        let mistral_markers = trie
            .get_special_token("[TOOL_CALLS]")
            .zip(trie.get_special_token("[ARGS]"));
        let gemma4_markers = [GEMMA4_CALL_OPEN, GEMMA4_CALL_CLOSE, GEMMA4_QUOTE]
            .map(|marker| trie.get_special_token(marker));
        let mut factory = ParserFactory::new_simple(&env).map_err(tok_err)?;
        factory.quiet();
        Ok(Self {
            inner: Arc::new(TokInner {
                factory,
                token_bytes,
                vocab_size,
                tool_tags_special,
                harmony_special,
                mistral_markers,
                gemma4_markers,
            }),
        })
    }

    /// Exact bytes of token `id` (special tokens: their text, e.g.
    /// `<|im_end|>`); empty for ids outside the tokenizer's vocabulary. For
    /// logprobs `bytes`.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.inner
            .token_bytes
            .get(id as usize)
            .cloned()
            .unwrap_or_default()
    }

    /// Rows of the model's output this trie was built for (the logits length
    /// [`ConstrainedDecoder::mask_logits`] expects).
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }
}

/// The tokenizer environment grammars run against: the model's trie, and
/// for text a grammar forces (a schema's `const` or `enum` string, the
/// tool-call wrapper) the model's own encoding of that text as text. The
/// Hugging Face encoder llguidance would use matches added tokens by their
/// text (`"x <|im_end|> y"` gives the EOS id, Qwen's `<tool_call>` its tag),
/// which ends a reply or breaks the grammar; here special-token strings are
/// encoded as plain text (`encode_special_tokens`), and an added token the
/// trie still marks special (a non-special added token such as Qwen's
/// `<tool_call>`) is spelled with ordinary tokens. Special tokens a grammar
/// names on purpose (Qwen's `<tool_call>` around a call) still match
/// through the trie, which never matches them to text.
struct TextOnlyEnv {
    inner: TokEnv,
    /// The model's tokenizer with special-token strings encoded as text.
    encoder: tokenizers::Tokenizer,
}

impl TokenizerEnv for TextOnlyEnv {
    fn tok_trie(&self) -> &TokTrie {
        self.inner.tok_trie()
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let trie = self.inner.tok_trie();
        let ids = trie.tokenize_with_greedy_fallback(s, |text| {
            self.encoder
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_else(|_| trie.greedy_tokenize(text.as_bytes()))
        });
        ids.into_iter()
            .flat_map(|id| match trie.is_special_token(id) {
                // The special token's text, after its marker byte.
                true => trie.greedy_tokenize(&trie.token(id)[1..]),
                false => vec![id],
            })
            .collect()
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.inner.tokenize_is_canonical()
    }
}

/// The output grammar of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this JSON Schema (OpenAI `json_schema`). Any
    /// `x-guidance` key in it is replaced by the module's layout options.
    JsonSchema(Json),
    /// Tool calls in the Hermes/Qwen format (`tool_choice: "required"`),
    /// continuing a reply that already holds `<tool_call>\n{"name": "`
    /// (the engine puts it in the prompt,
    /// [`crate::output::forced_call_prefix`]): a function's name,
    /// `", "arguments": `, arguments valid against that function's
    /// parameters schema (`Null` means any object), then `}\n</tool_call>`.
    /// The reply may end after any complete call (after an optional
    /// newline) or, with `\n<tool_call>\n{"name": "`, call again.
    ToolCalls {
        /// `(name, parameters JSON Schema)` of each function.
        tools: Vec<(String, Json)>,
        /// At most one call (`parallel_tool_calls: false`).
        single: bool,
    },
    /// One tool call in OpenAI's harmony format (gpt-oss,
    /// `tool_choice: "required"`), continuing a reply that already holds
    /// `<|channel|>commentary to=functions.` (the engine puts it in the
    /// prompt, [`crate::output::harmony::forced_call_prefix`]): a
    /// function's name, ` <|constrain|>json<|message|>`, then arguments
    /// valid against its parameters schema. The markers are the
    /// tokenizer's special tokens when it has them.
    HarmonyCall {
        /// `(name, parameters JSON Schema)` of each function.
        tools: Vec<(String, Json)>,
    },
    /// Tool calls in Mistral's v11 format (`tool_choice: "required"`),
    /// continuing a reply that already holds `[TOOL_CALLS]` (the engine
    /// puts it in the prompt,
    /// [`crate::output::tool_calls::mistral::mistral_forced_call_prefix`]):
    /// a function's name, `[ARGS]`, then arguments valid against its
    /// parameters schema; the reply may end after any call or, with
    /// `[TOOL_CALLS]`, call again (unless `single`). The markers are the
    /// tokenizer's special tokens when it has them. (A named function needs
    /// no grammar of its own: its prefix ends with `[ARGS]`, and
    /// [`Grammar::JsonSchema`] constrains the arguments.)
    MistralCalls {
        /// `(name, parameters JSON Schema)` of each function.
        tools: Vec<(String, Json)>,
        /// At most one call (`parallel_tool_calls: false`).
        single: bool,
    },
    /// Tool calls in Qwen3-Coder's XML format, continuing a reply that
    /// already holds `<tool_call>\n<function=` (`tool_choice: "required"`:
    /// a function's name, `>\n`, then its parameters) or
    /// `<tool_call>\n<function=NAME>\n` (a named function, `named`: its
    /// parameters only); the engine puts it in the prompt
    /// ([`crate::output::tool_calls::qwen3_coder::xml_forced_call_prefix`]).
    /// Parameters come in the schema's `properties` order, the required
    /// ones always, each as `<parameter=KEY>\nVALUE\n</parameter>\n`: a
    /// value whose schema has a non-string type is JSON valid against it,
    /// a string enum one of its values, any other string text without
    /// `</parameter>` within its `minLength` and `maxLength` (its other
    /// string constraints, such as `pattern`, are not enforced).
    /// A call ends with `</function>\n</tool_call>`; a required reply may
    /// call again (`\n<tool_call>\n<function=`) unless `single`.
    XmlCalls {
        /// `(name, parameters JSON Schema)` of each function (one, when
        /// `named`).
        tools: Vec<(String, Json)>,
        /// The prefix names the function: only its parameters follow.
        named: bool,
        /// At most one call (`parallel_tool_calls: false`).
        single: bool,
    },
    /// Tool calls in Gemma 4's format, continuing a reply that already
    /// holds `<|tool_call>call:` (`tool_choice: "required"`: a function's
    /// name, `{`, its arguments, `}<tool_call|>`; unless `single`, then
    /// `<|tool_call>call:` and another call, any number of times) or
    /// `<|tool_call>call:NAME{` (a named function, `named`: its arguments'
    /// members, `}<tool_call|>`); the engine puts it in the prompt
    /// ([`crate::output::tool_calls::gemma4::gemma4_forced_call_prefix`]).
    /// The arguments are the parameters' JSON Schema translated into
    /// Gemma 4's notation (keys bare, in the schema's order, the required
    /// ones always and the others each present or not; strings between
    /// `<|"|>` markers; a generic value where the schema says too little
    /// or too much to translate): see the translator's notes in
    /// `constraint/gemma4.rs`. The markers are the tokenizer's special
    /// tokens when it has all three, else text.
    Gemma4Calls {
        /// `(name, parameters JSON Schema)` of each function (one, when
        /// `named`).
        tools: Vec<(String, Json)>,
        /// The prefix names the function: only its arguments follow.
        named: bool,
        /// At most one call (`parallel_tool_calls: false`).
        single: bool,
    },
}

impl Grammar {
    /// Compiles the grammar without a tokenizer, to reject a bad schema early
    /// (at the HTTP edge). Errors: [`ConstraintError::InvalidGrammar`].
    pub fn validate(&self) -> Result<(), ConstraintError> {
        let init = GrammarInit::Serialized(self.to_llg(false, false, None, [None; 3])?);
        match init.validate(None, ParserLimits::default()).into_error() {
            Some(e) => Err(ConstraintError::InvalidGrammar(e)),
            None => Ok(()),
        }
    }

    /// The llguidance grammar; `special_tags`: name `<tool_call>` and
    /// `</tool_call>` as special tokens rather than as text;
    /// `harmony_special`: the same for harmony's `<|constrain|>` and
    /// `<|message|>`; `mistral_markers`: the ids of Mistral's
    /// `[TOOL_CALLS]` and `[ARGS]` special tokens (else their text);
    /// `gemma4_markers`: the same for each of Gemma 4's `<|tool_call>`,
    /// `<tool_call|>` and `<|"|>`.
    fn to_llg(
        &self,
        special_tags: bool,
        harmony_special: bool,
        mistral_markers: Option<(u32, u32)>,
        gemma4_markers: [Option<u32>; 3],
    ) -> Result<TopLevelGrammar, ConstraintError> {
        match self {
            Grammar::JsonObject => Ok(TopLevelGrammar::from_json_schema(with_layout(
                json!({"type": "object"}),
            )?)),
            Grammar::JsonSchema(schema) => Ok(TopLevelGrammar::from_json_schema(with_layout(
                schema.clone(),
            )?)),
            Grammar::ToolCalls { tools, single } => Ok(TopLevelGrammar::from_lark(
                tool_calls_lark(tools, *single, special_tags)?,
            )),
            Grammar::HarmonyCall { tools } => Ok(TopLevelGrammar::from_lark(harmony_call_lark(
                tools,
                harmony_special,
            )?)),
            Grammar::MistralCalls { tools, single } => Ok(TopLevelGrammar::from_lark(
                mistral_calls_lark(tools, *single, mistral_markers)?,
            )),
            Grammar::XmlCalls {
                tools,
                named,
                single,
            } => Ok(TopLevelGrammar::from_lark(xml_calls_lark(
                tools,
                *named,
                *single,
                special_tags,
            )?)),
            Grammar::Gemma4Calls {
                tools,
                named,
                single,
            } => Ok(TopLevelGrammar::from_lark(gemma4::gemma4_calls_lark(
                tools,
                *named,
                *single,
                gemma4_markers,
            )?)),
        }
    }
}

/// `schema` with the module's `x-guidance` layout options (`true` becomes
/// `{}`, the schema allowing anything), and every object that lists its
/// `properties` closed to other keys unless it says otherwise
/// ([`close_objects`]).
fn with_layout(schema: Json) -> Result<Json, ConstraintError> {
    let mut schema = match schema {
        Json::Bool(true) => json!({}),
        Json::Object(_) => schema,
        Json::Null => json!({"type": "object"}),
        other => {
            return Err(ConstraintError::InvalidGrammar(format!(
                "a JSON Schema must be an object or `true`, got {other}"
            )))
        }
    };
    close_objects(&mut schema);
    if let Some(map) = schema.as_object_mut() {
        map.insert("x-guidance".into(), json_layout());
    }
    Ok(schema)
}

/// Treats a missing `additionalProperties` as `false` in every subschema
/// that lists `properties` (as llama.cpp's grammar converter and xgrammar's
/// strict mode do): a model given `{"properties": {"city": ..}}` must not
/// invent other keys. An object schema without `properties` stays open (it
/// asks for "any object"), and an explicit `additionalProperties`,
/// `patternProperties` or `unevaluatedProperties` is kept as written.
pub fn close_objects(schema: &mut Json) {
    let Some(map) = schema.as_object_mut() else {
        return;
    };
    let open_keys = [
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
    ];
    if map.contains_key("properties") && !open_keys.iter().any(|k| map.contains_key(*k)) {
        map.insert("additionalProperties".into(), Json::Bool(false));
    }
    // Subschemas, by the keyword that holds them.
    for key in [
        "properties",
        "patternProperties",
        "$defs",
        "definitions",
        "dependentSchemas",
    ] {
        if let Some(Json::Object(children)) = map.get_mut(key) {
            children.values_mut().for_each(close_objects);
        }
    }
    for key in ["items", "prefixItems", "anyOf", "oneOf", "allOf"] {
        match map.get_mut(key) {
            Some(Json::Array(children)) => children.iter_mut().for_each(close_objects),
            Some(child) => close_objects(child),
            None => {}
        }
    }
    for key in [
        "additionalProperties",
        "unevaluatedProperties",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "additionalItems",
    ] {
        if let Some(child) = map.get_mut(key) {
            close_objects(child);
        }
    }
}

/// A Lark grammar (llguidance dialect) for Hermes/Qwen tool calls after
/// `<tool_call>\n{"name": "` (see [`Grammar::ToolCalls`]).
fn tool_calls_lark(
    tools: &[(String, Json)],
    single: bool,
    special_tags: bool,
) -> Result<String, ConstraintError> {
    if tools.is_empty() {
        return Err(ConstraintError::InvalidGrammar(
            "tool calls required but no tools given".into(),
        ));
    }
    let lit = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let (open, close) = if special_tags {
        ("<tool_call>".to_string(), "</tool_call>".to_string())
    } else {
        (lit("<tool_call>"), lit("</tool_call>"))
    };
    let mut lark = String::from(if single {
        "start: call end?\n"
    } else {
        "start: call (next call)* end?\n"
    });
    lark.push_str(&format!(
        "next: {} {close} \"\\n\" {open} {}\n",
        lit("}\n"),
        lit("\n{\"name\": \""),
    ));
    lark.push_str(&format!("end: {} {close} \"\\n\"?\n", lit("}\n")));
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    lark.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, (name, params)) in tools.iter().enumerate() {
        let head = format!("{name}\", \"arguments\": ");
        let schema = with_layout(params.clone())?;
        let schema = serde_json::to_string(&schema)
            .map_err(|e| ConstraintError::InvalidGrammar(e.to_string()))?;
        lark.push_str(&format!("call_{i}: {} %json {schema}\n", lit(&head)));
    }
    Ok(lark)
}

/// A Lark grammar (llguidance dialect) for one harmony call after
/// `<|channel|>commentary to=functions.` (see [`Grammar::HarmonyCall`]).
fn harmony_call_lark(tools: &[(String, Json)], special: bool) -> Result<String, ConstraintError> {
    if tools.is_empty() {
        return Err(ConstraintError::InvalidGrammar(
            "tool calls required but no tools given".into(),
        ));
    }
    let lit = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let (constrain, message) = if special {
        ("<|constrain|>".to_owned(), "<|message|>".to_owned())
    } else {
        (lit("<|constrain|>"), lit("<|message|>"))
    };
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    let mut lark = format!("start: {}\n", alts.join(" | "));
    for (i, (name, params)) in tools.iter().enumerate() {
        let schema = with_layout(params.clone())?;
        let schema = serde_json::to_string(&schema)
            .map_err(|e| ConstraintError::InvalidGrammar(e.to_string()))?;
        lark.push_str(&format!(
            "call_{i}: {} {constrain} \"json\" {message} %json {schema}\n",
            lit(&format!("{name} "))
        ));
    }
    Ok(lark)
}

/// A Lark grammar (llguidance dialect) for Mistral v11 calls after
/// `[TOOL_CALLS]` (see [`Grammar::MistralCalls`]); `markers`: the ids of
/// `[TOOL_CALLS]` and `[ARGS]` as special tokens, else they are text.
fn mistral_calls_lark(
    tools: &[(String, Json)],
    single: bool,
    markers: Option<(u32, u32)>,
) -> Result<String, ConstraintError> {
    if tools.is_empty() {
        return Err(ConstraintError::InvalidGrammar(
            "tool calls required but no tools given".into(),
        ));
    }
    let lit = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let (calls, args) = match markers {
        Some((calls, args)) => (format!("<[{calls}]>"), format!("<[{args}]>")),
        None => (lit("[TOOL_CALLS]"), lit("[ARGS]")),
    };
    let mut lark = if single {
        String::from("start: call\n")
    } else {
        format!("start: call ({calls} call)*\n")
    };
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    lark.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, (name, params)) in tools.iter().enumerate() {
        let schema = with_layout(params.clone())?;
        let schema = serde_json::to_string(&schema)
            .map_err(|e| ConstraintError::InvalidGrammar(e.to_string()))?;
        lark.push_str(&format!("call_{i}: {} {args} %json {schema}\n", lit(name)));
    }
    Ok(lark)
}

/// A Lark grammar (llguidance dialect) for Qwen3-Coder XML calls (see
/// [`Grammar::XmlCalls`]).
///
/// `special_tags`: `<tool_call>` and `</tool_call>` are added tokens of the
/// vocabulary (Qwen3-Coder's are), written as those tokens, as the model
/// was trained to write them; else as text.
fn xml_calls_lark(
    tools: &[(String, Json)],
    named: bool,
    single: bool,
    special_tags: bool,
) -> Result<String, ConstraintError> {
    if tools.is_empty() || (named && tools.len() != 1) {
        return Err(ConstraintError::InvalidGrammar(
            "XML tool calls need one named tool or at least one tool".into(),
        ));
    }
    let lit = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let (open, close_tag) = if special_tags {
        ("<tool_call>".to_string(), "</tool_call>".to_string())
    } else {
        (lit("<tool_call>"), lit("</tool_call>"))
    };
    let close = format!("{} {close_tag}", lit("</function>\n"));
    // Text without `</parameter>`: one lexeme with its closing tag, so the
    // first `</parameter>` is the value's end.
    let mut lark = String::from("NO_CLOSE: ~/(?s:.*)<\\/parameter>(?s:.*)/\n");
    if named {
        lark.push_str(&format!("start: params_0 {close}\n"));
    } else {
        lark.push_str(if single {
            "start: call\n"
        } else {
            "start: call (next call)*\n"
        });
        lark.push_str(&format!("next: \"\\n\" {open} {}\n", lit("\n<function=")));
        let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
        lark.push_str(&format!("call: {}\n", alts.join(" | ")));
        for (i, (name, _)) in tools.iter().enumerate() {
            lark.push_str(&format!(
                "call_{i}: {} params_{i} {close}\n",
                lit(&format!("{name}>\n"))
            ));
        }
    }
    for (i, (_, params)) in tools.iter().enumerate() {
        let properties = params
            .get("properties")
            .and_then(Json::as_object)
            .cloned()
            .unwrap_or_default();
        let required: Vec<&str> = params
            .get("required")
            .and_then(Json::as_array)
            .map(|r| r.iter().filter_map(Json::as_str).collect())
            .unwrap_or_default();
        let mut items = Vec::new();
        for (j, (key, schema)) in properties.iter().enumerate() {
            let open = format!("<parameter={key}>\n");
            let end = "\n</parameter>\n";
            let rule = format!("p_{i}_{j}");
            let body = if crate::output::tool_calls::qwen3_coder::typed_schema(schema) {
                let schema = serde_json::to_string(&with_layout(schema.clone())?)
                    .map_err(|e| ConstraintError::InvalidGrammar(e.to_string()))?;
                format!("{} %json {schema} {}", lit(&open), lit(end))
            } else if let Some(values) = schema.get("enum").and_then(Json::as_array) {
                let values: Vec<String> = values
                    .iter()
                    .filter_map(Json::as_str)
                    .map(|v| lit(&format!("{open}{v}{end}")))
                    .collect();
                if values.is_empty() {
                    return Err(ConstraintError::InvalidGrammar(format!(
                        "parameter `{key}`: an enum without strings"
                    )));
                }
                values.join(" | ")
            } else {
                // `minLength` and `maxLength` bound the text (in characters).
                let bound = |k: &str| schema.get(k).and_then(Json::as_u64);
                let length = match (bound("minLength").unwrap_or(0), bound("maxLength")) {
                    (min, Some(max)) => format!("{{{min},{max}}}"),
                    (min, None) => format!("{{{min},}}"),
                };
                let terminal = format!("P_{i}_{j}");
                lark.push_str(&format!(
                    "{terminal}: {} (/(?s:.{length})/ & NO_CLOSE) {}\n",
                    lit(&open),
                    lit(end)
                ));
                terminal
            };
            lark.push_str(&format!("{rule}: {body}\n"));
            items.push(if required.contains(&key.as_str()) {
                rule
            } else {
                format!("{rule}?")
            });
        }
        lark.push_str(&format!("params_{i}: {}\n", items.join(" ")));
    }
    Ok(lark)
}

/// The grammar state of one request. `Send`: built by the front end, moved
/// to the engine thread.
pub struct ConstrainedDecoder {
    matcher: Matcher,
    tok: GrammarTokenizer,
}

impl ConstrainedDecoder {
    /// Compiles `grammar` against the model's trie.
    ///
    /// Errors: [`ConstraintError::InvalidGrammar`] with llguidance's message
    /// when the grammar or schema does not compile (front ends answer 400).
    pub fn new(tok: &GrammarTokenizer, grammar: &Grammar) -> Result<Self, ConstraintError> {
        let top = grammar.to_llg(
            tok.inner.tool_tags_special,
            tok.inner.harmony_special,
            tok.inner.mistral_markers,
            tok.inner.gemma4_markers,
        )?;
        let parser = tok
            .inner
            .factory
            .create_parser(top)
            .map_err(|e| ConstraintError::InvalidGrammar(format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::InvalidGrammar(e));
        }
        Ok(Self {
            matcher,
            tok: tok.clone(),
        })
    }

    /// Sets every logit the grammar forbids at this position to `-inf`.
    /// `logits.len()` must be the model's vocabulary rows
    /// ([`GrammarTokenizer::vocab_size`]). EOS tokens stay allowed only where
    /// the grammar can end; once it is finished only EOS is allowed.
    ///
    /// Errors: [`ConstraintError::Matcher`] when the matcher failed or the
    /// length is wrong.
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        if logits.len() != self.tok.inner.vocab_size {
            return Err(ConstraintError::Matcher(format!(
                "{} logits, the grammar trie has {} tokens",
                logits.len(),
                self.tok.inner.vocab_size
            )));
        }
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| ConstraintError::Matcher(format!("{e:#}")))?;
        mask.iter_unset_entries(|i| logits[i] = f32::NEG_INFINITY);
        Ok(())
    }

    /// Advances past the sampled `token`. An EOS token where the grammar may
    /// end finishes it (as does EOS after it finished on its own).
    ///
    /// Errors: [`ConstraintError::Rejected`] when the grammar forbids `token`
    /// here (the state is unchanged); [`ConstraintError::Matcher`] when the
    /// matcher failed.
    pub fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        let matcher_err = |e: anyhow::Error| ConstraintError::Matcher(format!("{e:#}"));
        let is_eos = self
            .matcher
            .tok_env()
            .map_err(matcher_err)?
            .tok_trie()
            .eos_tokens()
            .contains(&token);
        let allowed = if self.is_finished() {
            is_eos
        } else if is_eos {
            self.matcher.is_accepting().map_err(matcher_err)?
        } else {
            (token as usize) < self.tok.inner.vocab_size
                && self
                    .matcher
                    .validate_tokens(&[token])
                    .map_err(matcher_err)?
                    == 1
        };
        if !allowed {
            let text = String::from_utf8_lossy(&self.tok.token_bytes(token)).into_owned();
            return Err(ConstraintError::Rejected {
                token,
                message: format!("{text:?} is not allowed here"),
            });
        }
        if self.is_finished() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(matcher_err)
    }

    /// True when the grammar is complete and nothing more may follow (by
    /// itself, or after an accepted EOS): the engine finishes the request
    /// with `finish_reason: "stop"`. False after a matcher error.
    pub fn is_finished(&self) -> bool {
        let reason = self.matcher.stop_reason();
        reason != StopReason::NotStopped && reason.is_ok()
    }
}
