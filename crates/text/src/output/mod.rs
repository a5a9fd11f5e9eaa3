//! What a choice's text becomes on its stream: reasoning, stop strings and
//! tool calls.
//!
//! The detokenizer turns tokens into text; [`OutputFilter`] decides which of
//! that text the client sees, as what, and when. It composes, in order:
//!
//! - **Reasoning** ([`crate::reasoning`]), split off first when the choice
//!   has a reasoning splitter: the rest goes on as the answer.
//! - **Stop strings** (`stop`). Text that might be the start of a stop
//!   string is held back until the next text decides it; the first complete
//!   stop string ends the choice, and neither it nor anything after it is
//!   sent (OpenAI's `stop`). The search runs over everything not yet sent,
//!   so a stop string split across any number of tokens is found.
//! - **Tool calls** ([`tool_calls`]: a [`ToolCallParser`] of the model's
//!   format, [`ToolCallFormat`]; by default the Hermes / Qwen2.5 format
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`).
//!   Calls of offered functions become [`OutputPiece::CallStart`] and
//!   [`OutputPiece::CallArguments`] fragments, streamed as generated; a
//!   call that does not parse, or names a function that was not offered,
//!   is sent as text, unchanged. Whitespace between calls is dropped.
//!   Where a format's markup is special tokens, which the detokenizer
//!   skips (Mistral v11, Gemma 4), the engine hands them to
//!   [`OutputFilter::push_special_token`], and they are read as text.
//! - **Forced calls.** Under a named or required `tool_choice` the engine
//!   puts the start of the call in the prompt ([`forced_call_prefix`]) and
//!   constrains only what follows; the filter is seeded with that same
//!   prefix ([`OutputFilter::forced`]), so the call is built from the
//!   generated arguments and no wrapper text is ever sent, even when the
//!   choice is cut short.

use mlxcel_engine_api::ToolDefinition;

use crate::reasoning::{ReasoningSplitter, ReplyPart};
use crate::tokenizer::TextTokenizer;

pub mod harmony;
mod stop;
pub mod tool_calls;

use harmony::HarmonyReader;
use stop::StopStrings;
pub use tool_calls::hermes::{
    forced_call_prefix, parse_tool_call, TOOL_CALL_CLOSE, TOOL_CALL_OPEN,
};
pub use tool_calls::ToolCallFormat;
use tool_calls::{Gemma4Parser, HermesParser, MistralParser, Qwen3CoderParser, ToolCallParser};

/// One piece of a choice's visible output.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputPiece {
    /// Text for the message content.
    Text(String),
    /// A tool call begins.
    CallStart {
        /// `call_` and 24 random hex digits.
        id: String,
        /// The function called (one of the offered ones).
        name: String,
    },
    /// More of the latest call's arguments: JSON text as generated. A
    /// call's arguments are the concatenation of its fragments.
    CallArguments(String),
    /// Reasoning (see [`crate::reasoning`]): never content, never parsed
    /// for stop strings or calls.
    Reasoning(String),
}

/// What one push of text produced.
#[derive(Debug, Default, PartialEq)]
pub struct Filtered {
    /// What to send now, in order (adjacent text, and adjacent argument
    /// fragments, are merged).
    pub pieces: Vec<OutputPiece>,
    /// A stop string appeared: the choice ends here.
    pub stopped: bool,
}

impl Filtered {
    /// All the text pieces, concatenated.
    pub fn text(&self) -> String {
        self.pieces
            .iter()
            .filter_map(|p| match p {
                OutputPiece::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }

    /// All the reasoning pieces, concatenated.
    pub fn reasoning(&self) -> String {
        self.pieces
            .iter()
            .filter_map(|p| match p {
                OutputPiece::Reasoning(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }

    /// Appends `other`'s pieces.
    pub fn extend(&mut self, other: Filtered) {
        for piece in other.pieces {
            self.push(piece);
        }
        self.stopped |= other.stopped;
    }

    fn push(&mut self, piece: OutputPiece) {
        match (self.pieces.last_mut(), piece) {
            (
                _,
                OutputPiece::Text(t) | OutputPiece::CallArguments(t) | OutputPiece::Reasoning(t),
            ) if t.is_empty() => {}
            (Some(OutputPiece::Text(a)), OutputPiece::Text(b)) => a.push_str(&b),
            (Some(OutputPiece::Reasoning(a)), OutputPiece::Reasoning(b)) => a.push_str(&b),
            (Some(OutputPiece::CallArguments(a)), OutputPiece::CallArguments(b)) => a.push_str(&b),
            (_, piece) => self.pieces.push(piece),
        }
    }

    fn text_piece(&mut self, text: &str) {
        self.push(OutputPiece::Text(text.to_owned()));
    }

    fn arguments(&mut self, text: &str) {
        self.push(OutputPiece::CallArguments(text.to_owned()));
    }
}

/// Per-choice output filter; see the module docs.
#[derive(Debug)]
pub struct OutputFilter {
    /// The stop strings and the text not yet past them.
    stop: StopStrings,
    /// Reads calls out of the text past the stop check (`None`: no
    /// parsing, no functions offered).
    tool_calls: Option<Box<dyn ToolCallParser>>,
    /// Splits reasoning off before everything else (reasoning models).
    reasoning: Option<ReasoningSplitter>,
    /// Reads a harmony reply (gpt-oss) before everything else: its
    /// reasoning, its calls; its content goes on through the stop strings.
    harmony: Option<HarmonyReader>,
    /// Special tokens read as text of the reply: the markup of the tool-call
    /// format ([`ToolCallFormat::special_markers`]), when calls are parsed,
    /// and the reasoning markers' ([`crate::reasoning::ReasoningMarkers::special_tokens`]).
    markers: Vec<&'static str>,
    /// The call-opening special token of the format whose calls are parsed
    /// ([`ToolCallFormat::special_call_open`]), where a reasoning block
    /// ends.
    call_open: Option<&'static str>,
}

impl OutputFilter {
    /// A filter ending at any of `stop` (empty strings are ignored) and
    /// extracting calls of the functions named in `tool_names` (a call of
    /// any other name stays text: it is not a call the client can answer).
    pub fn new(stop: &[String], tool_names: &[String]) -> Self {
        Self::with_parser(stop, tool_names, |names| Box::new(HermesParser::new(names)))
    }

    /// A filter ending at any of `stop` that reads calls of `tools` in
    /// `format` (the model's own, [`ToolCallFormat::from_template`]). The
    /// tools' names decide what is a call; the XML format also reads their
    /// parameter schemas (which values are JSON rather than strings).
    ///
    /// Harmony ([`ToolCallFormat::Harmony`]) is read whether or not tools
    /// are offered (it carries the reasoning too), from the text and the
    /// special tokens ([`OutputFilter::push_special`]). With tools, the
    /// special tokens of the format's markup (Mistral v11's, Gemma 4's)
    /// are read as text of the reply.
    pub fn with_format(stop: &[String], tools: &[ToolDefinition], format: ToolCallFormat) -> Self {
        let harmony = (format == ToolCallFormat::Harmony).then(|| HarmonyReader::new(tools));
        let tool_calls = if tools.is_empty() {
            None
        } else {
            format.parser(tools)
        };
        Self {
            stop: StopStrings::new(stop),
            markers: if tool_calls.is_some() {
                format.special_markers().to_vec()
            } else {
                Vec::new()
            },
            call_open: tool_calls.as_ref().and(format.special_call_open()),
            tool_calls,
            reasoning: None,
            harmony,
        }
    }

    /// Whether this filter reads special tokens ([`OutputFilter::push_special`]):
    /// true for a harmony reply, whose markers are special tokens, and for
    /// calls in a format whose markup is special tokens
    /// ([`ToolCallFormat::special_markers`]).
    pub fn reads_special_tokens(&self) -> bool {
        self.harmony.is_some() || !self.markers.is_empty()
    }

    /// Whether generated token `id` is a special token this filter reads as
    /// text of the reply (a marker of the tool-call format,
    /// [`ToolCallFormat::special_markers`]): the detokenizer should then
    /// release the text before it
    /// ([`crate::detokenizer::IncrementalDetokenizer::push_marker`]).
    pub fn reads_marker(&self, tokenizer: &TextTokenizer, id: u32) -> bool {
        !self.markers.is_empty()
            && tokenizer.is_special_token(id)
            && tokenizer
                .id_to_token(id)
                .is_some_and(|token| self.markers.contains(&token.as_str()))
    }

    /// Feeds generated token `id` to [`OutputFilter::push_special`] when it
    /// is a special token of `tokenizer` and this filter reads them (call
    /// it after the token's text went through [`OutputFilter::push`]; the
    /// detokenizer gives a special token no text). Nothing otherwise.
    pub fn push_special_token(&mut self, tokenizer: &TextTokenizer, id: u32) -> Filtered {
        if !self.reads_special_tokens() || !tokenizer.is_special_token(id) {
            return Filtered::default();
        }
        match tokenizer.id_to_token(id) {
            Some(token) => self.push_special(&token),
            None => Filtered::default(),
        }
    }

    /// Feeds a generated special token, `token` its text (such as
    /// `<|channel|>`), after the text before it went through
    /// [`OutputFilter::push`]. A harmony filter reads them all; a filter
    /// of calls whose markup is special tokens reads those as text (as if
    /// the detokenizer had written them); others skip them, as the
    /// detokenizer does.
    pub fn push_special(&mut self, token: &str) -> Filtered {
        if self.stop.stopped() {
            return Filtered::default();
        }
        if self.markers.contains(&token) {
            return self.push(token);
        }
        match self.harmony.as_mut().map(|h| h.marker(token)) {
            Some(pieces) => self.route_harmony(pieces),
            None => Filtered::default(),
        }
    }

    /// A harmony reader's pieces: content through the stop strings, the
    /// rest as is.
    fn route_harmony(&mut self, pieces: Vec<OutputPiece>) -> Filtered {
        let mut out = Filtered::default();
        for piece in pieces {
            if self.stop.stopped() {
                break;
            }
            match piece {
                OutputPiece::Text(t) => out.extend(self.push_content(&t)),
                piece => out.push(piece),
            }
        }
        out
    }

    /// The same filter, after `splitter` has taken the reasoning out: only
    /// the answer goes through stop strings and tool-call parsing. The
    /// special tokens among its markers (Gemma 4's `<|channel>`) are then
    /// read as text of the reply.
    pub fn with_reasoning(mut self, splitter: ReasoningSplitter) -> Self {
        for token in splitter.markers().special_tokens {
            if !self.markers.contains(token) {
                self.markers.push(token);
            }
        }
        self.reasoning = Some(splitter.with_call_marker(self.call_open));
        self
    }

    /// The filter of a forced reply whose first text, `prefix` (from
    /// [`forced_call_prefix`]), is in the prompt rather than generated:
    /// the generated text continues it. Text that never became a call (a
    /// choice cut before the function name was complete) is dropped.
    pub fn forced(stop: &[String], tool_names: &[String], prefix: &str) -> Self {
        Self::with_parser(stop, tool_names, |names| {
            Box::new(HermesParser::forced(names, prefix))
        })
    }

    /// [`OutputFilter::forced`] for a reply in `format`, whose `prefix`
    /// comes from that format's forced prefix: harmony's
    /// ([`harmony::forced_call_prefix`]) for [`ToolCallFormat::Harmony`],
    /// the XML one ([`tool_calls::qwen3_coder::xml_forced_call_prefix`]) for
    /// [`ToolCallFormat::Qwen3CoderXml`], Mistral's
    /// ([`tool_calls::mistral::mistral_forced_call_prefix`]) for
    /// [`ToolCallFormat::MistralV11`] and Gemma 4's
    /// ([`tool_calls::gemma4::gemma4_forced_call_prefix`]) for
    /// [`ToolCallFormat::Gemma4`] (the markers of both, special tokens, are
    /// read as text), [`forced_call_prefix`] for the others.
    pub fn forced_in(
        format: ToolCallFormat,
        stop: &[String],
        tools: &[ToolDefinition],
        prefix: &str,
    ) -> Self {
        let names: Vec<String> = tools.iter().map(|t| t.name.clone()).collect();
        let (tool_calls, harmony): (Option<Box<dyn ToolCallParser>>, _) = match format {
            ToolCallFormat::Harmony => (None, Some(HarmonyReader::forced(tools, prefix))),
            ToolCallFormat::MistralV11 => {
                (Some(Box::new(MistralParser::forced(&names, prefix))), None)
            }
            ToolCallFormat::Gemma4 => (Some(Box::new(Gemma4Parser::forced(&names, prefix))), None),
            ToolCallFormat::Qwen3CoderXml => (
                Some(Box::new(Qwen3CoderParser::forced_with_tools(tools, prefix))),
                None,
            ),
            _ => return Self::forced(stop, &names, prefix),
        };
        Self {
            stop: StopStrings::new(stop),
            tool_calls,
            reasoning: None,
            harmony,
            markers: format.special_markers().to_vec(),
            call_open: None,
        }
    }

    /// A filter whose tool-call parser `parser` builds for `tool_names`
    /// (none when `tool_names` is empty).
    fn with_parser(
        stop: &[String],
        tool_names: &[String],
        parser: impl FnOnce(&[String]) -> Box<dyn ToolCallParser>,
    ) -> Self {
        Self {
            stop: StopStrings::new(stop),
            tool_calls: (!tool_names.is_empty()).then(|| parser(tool_names)),
            reasoning: None,
            harmony: None,
            markers: Vec::new(),
            call_open: None,
        }
    }

    /// The stop string that ended the choice, if one did (Anthropic's
    /// `stop_sequence`).
    pub fn stop_sequence(&self) -> Option<&str> {
        self.stop.matched()
    }

    /// Tool calls found so far.
    pub fn tool_calls(&self) -> usize {
        self.tool_calls.as_ref().map_or(0, |p| p.calls())
            + self.harmony.as_ref().map_or(0, HarmonyReader::calls)
    }

    /// Feeds newly decoded text. After a stop, further text is ignored.
    pub fn push(&mut self, text: &str) -> Filtered {
        if self.stop.stopped() {
            return Filtered::default();
        }
        if let Some(pieces) = self.harmony.as_mut().map(|h| h.push(text)) {
            return self.route_harmony(pieces);
        }
        match self.reasoning.as_mut().map(|r| r.push(text)) {
            Some(parts) => self.route(parts),
            None => self.push_content(text),
        }
    }

    /// Reasoning parts become pieces; content goes through the filter.
    fn route(&mut self, parts: Vec<ReplyPart>) -> Filtered {
        let mut out = Filtered::default();
        for part in parts {
            if self.stop.stopped() {
                break;
            }
            match part {
                ReplyPart::Reasoning(t) => out.push(OutputPiece::Reasoning(t)),
                ReplyPart::Content(t) => out.extend(self.push_content(&t)),
            }
        }
        out
    }

    /// [`OutputFilter::push`] of the answer's text.
    fn push_content(&mut self, text: &str) -> Filtered {
        let released = self.stop.push(text);
        let stopped = self.stop.stopped();
        let mut out = self.parse(&released, stopped);
        out.stopped = stopped;
        out
    }

    /// Ends the choice (EOS, length, grammar complete): everything held is
    /// decided now.
    pub fn finish(&mut self) -> Filtered {
        let mut out = match self.reasoning.as_mut().map(ReasoningSplitter::finish) {
            Some(parts) if !self.stop.stopped() => self.route(parts),
            _ => Filtered::default(),
        };
        if let Some(pieces) = self.harmony.as_mut().map(HarmonyReader::finish) {
            if !self.stop.stopped() {
                out.extend(self.route_harmony(pieces));
            }
        }
        let rest = self.stop.finish();
        out.extend(self.parse(&rest, true));
        out
    }

    /// Runs released text through the tool-call parser; `last` decides
    /// whatever is still held.
    fn parse(&mut self, released: &str, last: bool) -> Filtered {
        let mut out = Filtered::default();
        match &mut self.tool_calls {
            None => out.text_piece(released),
            Some(parser) => {
                let pieces = if last {
                    parser.finish(released)
                } else {
                    parser.push(released)
                };
                for piece in pieces {
                    out.push(piece);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
