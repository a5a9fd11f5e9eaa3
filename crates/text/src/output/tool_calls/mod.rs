//! Tool calls read out of a reply's text, as the text comes.
//!
//! A [`ToolCallParser`] reads the text that passed the stop-string check
//! and sends on what it has decided: plain text, a call's start (id and
//! name), fragments of the call's arguments. Each model family's format is
//! one parser ([`ToolCallFormat`], picked from the chat template): the
//! Hermes / Qwen `<tool_call>` JSON format, Llama 3.1-3.3's bare JSON
//! calls and Mistral's v3 JSON list ([`hermes`]); Qwen3-Coder's XML calls
//! ([`qwen3_coder`]); Mistral's v11 `[TOOL_CALLS]NAME[ARGS]{..}` calls
//! ([`mistral`]); Gemma 4's `<|tool_call>call:NAME{..}<tool_call|>` calls
//! ([`gemma4`]).

use mlxcel_engine_api::ToolDefinition;

use super::{Filtered, OutputPiece};
use crate::output::stop::partial_suffix;

pub mod gemma4;
pub mod hermes;
pub mod mistral;
pub mod qwen3_coder;

pub use gemma4::Gemma4Parser;
pub use hermes::HermesParser;
pub use mistral::MistralParser;
pub use qwen3_coder::Qwen3CoderParser;

/// The tool-call format a model writes, as its chat template shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolCallFormat {
    /// `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (Hermes,
    /// Qwen2.5, Qwen3, and the default: mlxcel describes tools in this
    /// format to templates that do not know tools).
    #[default]
    Hermes,
    /// `{"name": .., "parameters": {..}}` at the start of the reply,
    /// optionally after `<|python_tag|>` (Llama 3.1-3.3).
    Llama3Json,
    /// `[{"name": .., "arguments": {..}}, ..]` at the start of the reply,
    /// after the `[TOOL_CALLS]` special token (Mistral's v3 tokenizers:
    /// Mistral 7B v0.3, Nemo).
    MistralJson,
    /// `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n
    /// </function>\n</tool_call>` (Qwen3-Coder's chat template; values read
    /// as the tools' parameter schemas say, [`qwen3_coder`]).
    Qwen3CoderXml,
    /// `[TOOL_CALLS]NAME[ARGS]{..}`, repeated for several calls, perhaps
    /// with `[CALL_ID]ID` before `[ARGS]` (Mistral's v11 tokenizers:
    /// Mistral Small 3.1/3.2, Devstral, Magistral; [`mistral`]).
    MistralV11,
    /// `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`, one
    /// block per call (Gemma 4; arguments rewritten as JSON, [`gemma4`]).
    Gemma4,
    /// OpenAI's harmony format (gpt-oss): messages on channels, calls as
    /// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>`.
    /// Read by [`crate::output::harmony::HarmonyReader`] from text and
    /// special tokens, with the reasoning; not a [`ToolCallParser`].
    Harmony,
}

impl ToolCallFormat {
    /// The format the chat template `source` teaches: harmony when it
    /// writes `<|channel|>` (gpt-oss); Gemma 4's when it writes
    /// `<|tool_call>`; Qwen3-Coder's XML
    /// when it writes `<function=` and `<parameter=` (checked first: that
    /// template writes `<tool_call>` too); Hermes when it writes
    /// `<tool_call>`; Llama 3's JSON when it is a Llama 3 template
    /// (`<|start_header_id|>`) that writes calls with `"parameters"`;
    /// Mistral's v11 calls when it writes `[TOOL_CALLS]` and `[ARGS]`, its
    /// v3 list when it writes `[TOOL_CALLS]` alone; else Hermes.
    pub fn from_template(source: &str) -> Self {
        if source.contains("<|channel|>") {
            ToolCallFormat::Harmony
        } else if source.contains(gemma4::GEMMA4_CALL_OPEN) {
            ToolCallFormat::Gemma4
        } else if source.contains("<function=") && source.contains("<parameter=") {
            ToolCallFormat::Qwen3CoderXml
        } else if source.contains("<tool_call>") {
            ToolCallFormat::Hermes
        } else if source.contains("<|start_header_id|>") && source.contains("\"parameters\"") {
            ToolCallFormat::Llama3Json
        } else if source.contains(mistral::MISTRAL_TOOL_CALLS) {
            if source.contains(mistral::MISTRAL_ARGS) {
                ToolCallFormat::MistralV11
            } else {
                ToolCallFormat::MistralJson
            }
        } else {
            ToolCallFormat::Hermes
        }
    }

    /// A parser of this format for calls of `tools` (the XML format reads
    /// their parameter schemas; the others only their names); `None` for
    /// harmony, which is not read from text alone.
    pub fn parser(self, tools: &[ToolDefinition]) -> Option<Box<dyn ToolCallParser>> {
        let names: Vec<String> = tools.iter().map(|t| t.name.clone()).collect();
        Some(match self {
            ToolCallFormat::Hermes => Box::new(HermesParser::new(&names)),
            ToolCallFormat::Llama3Json => Box::new(HermesParser::llama3_json(&names)),
            ToolCallFormat::MistralJson => Box::new(HermesParser::mistral_json(&names)),
            ToolCallFormat::Qwen3CoderXml => Box::new(Qwen3CoderParser::with_tools(tools)),
            ToolCallFormat::MistralV11 => Box::new(MistralParser::new(&names)),
            ToolCallFormat::Gemma4 => Box::new(Gemma4Parser::new(&names)),
            ToolCallFormat::Harmony => return None,
        })
    }

    /// The special tokens of this format's markup, which the output filter
    /// reads as text of the reply (the detokenizer skips special tokens):
    /// Mistral v11's `[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]`, Gemma 4's
    /// `<|tool_call>`, `<tool_call|>` and `<|"|>`. None for the other
    /// formats (harmony reads its markers itself; Mistral v3's
    /// `[TOOL_CALLS]` only opens the list, which is read without it).
    pub fn special_markers(self) -> &'static [&'static str] {
        self.markup()
    }

    /// The special token that opens a call in this format, when its markup
    /// is special tokens ([`ToolCallFormat::special_markers`]): Gemma 4's
    /// `<|tool_call>`, Mistral v11's `[TOOL_CALLS]`. A reasoning block
    /// ends there ([`crate::reasoning::ReasoningSplitter::with_call_marker`]).
    pub fn special_call_open(self) -> Option<&'static str> {
        self.markup().first().copied()
    }

    fn markup(self) -> &'static [&'static str] {
        match self {
            ToolCallFormat::MistralV11 => &[
                mistral::MISTRAL_TOOL_CALLS,
                mistral::MISTRAL_ARGS,
                mistral::MISTRAL_CALL_ID,
            ],
            ToolCallFormat::Gemma4 => &[
                gemma4::GEMMA4_CALL_OPEN,
                gemma4::GEMMA4_CALL_CLOSE,
                gemma4::GEMMA4_QUOTE,
            ],
            _ => &[],
        }
    }
}

/// Reads tool calls of one format out of a choice's text.
///
/// Text in ([`Self::push`], then [`Self::finish`] with the last of it),
/// [`OutputPiece`]s out: [`OutputPiece::Text`] for what is not a call,
/// [`OutputPiece::CallStart`] (a fresh id and an offered function's name)
/// when a call is committed, then its arguments as
/// [`OutputPiece::CallArguments`] fragments. A call of a function that was
/// not offered, or one that does not parse, is text. A parser can also
/// start in forced mode, seeded with the reply's start that the engine put
/// in the prompt (a forced `tool_choice`): then no wrapper text is ever
/// sent.
pub trait ToolCallParser: std::fmt::Debug + Send {
    /// A parser extracting calls of the functions named in `tool_names`.
    fn new(tool_names: &[String]) -> Self
    where
        Self: Sized;

    /// The parser of a forced reply whose first text, `prefix`, is in the
    /// prompt rather than generated: the generated text continues it. Text
    /// that never became a call is dropped.
    fn forced(tool_names: &[String], prefix: &str) -> Self
    where
        Self: Sized;

    /// Reads `text`, which continues the text read before; returns what it
    /// decides (text that may still become a call is held).
    fn push(&mut self, text: &str) -> Vec<OutputPiece>;

    /// Reads the last `text` of the choice: everything held is decided.
    fn finish(&mut self, text: &str) -> Vec<OutputPiece>;

    /// Tool calls found so far.
    fn calls(&self) -> usize;
}

/// Text outside any call, as every parser streams it: nothing in a forced
/// reply (its text is the call's), and whitespace between calls is
/// dropped.
pub(crate) fn emit_outside_text(out: &mut Filtered, text: &str, forced: bool, calls: usize) {
    if forced || (calls > 0 && text.trim().is_empty()) {
        return;
    }
    out.text_piece(text);
}

/// A parser's move outside any call over its `held` text: the text before
/// the call marker `open` goes out ([`emit_outside_text`]) and the marker
/// is consumed (true: a call starts). Without the marker, everything but a
/// suffix that may still become the marker goes out (all of it when
/// `last`), except whitespace after a call, which waits: dropped unless
/// text follows (false: more text is needed).
pub(crate) fn release_outside(
    held: &mut String,
    open: &str,
    out: &mut Filtered,
    (forced, calls): (bool, usize),
    last: bool,
) -> bool {
    if let Some(at) = held.find(open) {
        let before: String = held.drain(..at).collect();
        emit_outside_text(out, &before, forced, calls);
        held.drain(..open.len());
        return true;
    }
    let keep = if last { 0 } else { partial_suffix(held, open) };
    let cut = held.len() - keep;
    if calls > 0 && !last && held[..cut].trim().is_empty() {
        return false;
    }
    let text: String = held.drain(..cut).collect();
    emit_outside_text(out, &text, forced, calls);
    false
}

/// `call_` and 24 random hex digits.
pub(crate) fn new_call_id() -> String {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::try_from_os_rng()
        .unwrap_or_else(|_| rand_chacha::ChaCha8Rng::seed_from_u64(std::process::id().into()));
    format!("call_{:016x}{:08x}", rng.next_u64(), rng.next_u32())
}
