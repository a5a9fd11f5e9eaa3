//! gpt-oss's replies in OpenAI's harmony format, read into reasoning,
//! content and tool calls.
//!
//! A harmony reply is a run of messages. The prompt ends with
//! `<|start|>assistant`, so the first message's header starts at
//! `<|channel|>`:
//!
//! ```text
//! <|channel|>analysis<|message|>Need the weather.<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
//! ```
//!
//! or, for an answer, `...<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`.
//! The recipient may also come before the channel:
//! `<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{..}`.
//!
//! What each message becomes:
//! - a recipient `to=functions.NAME` with `NAME` an offered function: a
//!   tool call ([`OutputPiece::CallStart`], then the message's text as
//!   [`OutputPiece::CallArguments`] fragments, as generated), whatever the
//!   channel;
//! - any other recipient (a function not offered, a built-in tool): the
//!   message as text, unchanged (its markers spelled out);
//! - channel `analysis`: reasoning ([`OutputPiece::Reasoning`]);
//! - channel `final`, `commentary` without a recipient (a preamble the user
//!   sees), or any other: content ([`OutputPiece::Text`]);
//! - text outside any message (a reply held to a grammar writes no
//!   markers): content.
//!
//! The markers (`<|start|>`, `<|channel|>`, `<|constrain|>`,
//! `<|message|>`, `<|end|>`, `<|call|>`, `<|return|>`) are special tokens
//! of gpt-oss's tokenizer, so they reach the reader apart from the text
//! ([`HarmonyReader::marker`], one call per special token), never inside
//! it: text that spells `<|channel|>` in ordinary tokens is text, and no
//! marker can be cut between two pieces of text. `<|call|>` and
//! `<|return|>` end generation (they are EOS tokens), so a reply's last
//! message usually ends with the reply itself ([`HarmonyReader::finish`]).
//! A reply cut inside a header drops that header.

use mlxcel_engine_api::ToolDefinition;

use super::tool_calls::new_call_id;
use super::OutputPiece;

/// Starts a message (then its role, optionally its recipient).
pub const START: &str = "<|start|>";
/// Starts a message's channel (then its name, optionally the recipient and
/// the content type).
pub const CHANNEL: &str = "<|channel|>";
/// Before a message's content type (`json`).
pub const CONSTRAIN: &str = "<|constrain|>";
/// Ends the header: the message's text follows.
pub const MESSAGE: &str = "<|message|>";
/// Ends a message.
pub const END: &str = "<|end|>";
/// Ends a tool-call message, and generation.
pub const CALL: &str = "<|call|>";
/// Ends the final message, and generation.
pub const RETURN: &str = "<|return|>";

/// The harmony markers, each one special token.
const MARKERS: [&str; 7] = [START, CHANNEL, CONSTRAIN, MESSAGE, END, CALL, RETURN];

/// The start of a forced reply in harmony, put after the prompt's
/// `<|start|>assistant`: `<|channel|>commentary to=functions.NAME
/// <|constrain|>json<|message|>` for a call to `name` (`tool_choice`
/// naming a function: the model writes only the arguments), or
/// `<|channel|>commentary to=functions.` for a call to any function
/// (`tool_choice: "required"`: the model writes the name on,
/// [`crate::constraint::Grammar::HarmonyCall`]).
pub fn forced_call_prefix(name: Option<&str>) -> String {
    match name {
        Some(name) => {
            format!("{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}")
        }
        None => format!("{CHANNEL}commentary to=functions."),
    }
}

/// What a message's text is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Reasoning,
    Content,
    Call,
    /// A message addressed to something that is not an offered function:
    /// content, markers spelled out.
    Unchanged,
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Between messages.
    Idle,
    /// Reading a header: its markers and text as written (`raw`), the text
    /// before `<|channel|>` (`role`) and after it (`channel`, `None` before
    /// the marker).
    Header {
        raw: String,
        role: String,
        channel: Option<String>,
    },
    /// Inside a message's text.
    Body(Kind),
}

/// Reads one choice's harmony reply; see the module docs.
#[derive(Debug)]
pub struct HarmonyReader {
    tool_names: Vec<String>,
    state: State,
    calls: usize,
    /// Pieces decided while seeding a forced reply (a named call's start),
    /// sent with the first output.
    pending: Vec<OutputPiece>,
}

impl HarmonyReader {
    /// A reader whose calls of `tools` (by name) are tool calls.
    pub fn new(tools: &[ToolDefinition]) -> Self {
        Self {
            tool_names: tools.iter().map(|t| t.name.clone()).collect(),
            state: State::Idle,
            calls: 0,
            pending: Vec::new(),
        }
    }

    /// The reader of a forced reply whose first text, `prefix` (from
    /// [`forced_call_prefix`]), is in the prompt rather than generated:
    /// the generated tokens continue it.
    pub fn forced(tools: &[ToolDefinition], prefix: &str) -> Self {
        let mut reader = Self::new(tools);
        let mut rest = prefix;
        while !rest.is_empty() {
            let next = MARKERS
                .iter()
                .filter_map(|m| rest.find(m).map(|at| (at, *m)))
                .min();
            let (text, marker) = match next {
                Some((at, marker)) => (&rest[..at], Some(marker)),
                None => (rest, None),
            };
            // What seeding decides (a named call's start; a required call
            // starts only once its generated name is read) waits in
            // `pending` and goes out with the first output.
            let mut seeded = reader.push(text);
            rest = &rest[text.len()..];
            if let Some(marker) = marker {
                seeded.extend(reader.marker(marker));
                rest = &rest[marker.len()..];
            }
            reader.pending.extend(seeded);
        }
        reader
    }

    /// Tool calls read so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads ordinary text (no markers): it continues the open header or
    /// message. [`OutputPiece::Text`] out is content.
    pub fn push(&mut self, text: &str) -> Vec<OutputPiece> {
        let mut out = std::mem::take(&mut self.pending);
        out.extend(self.read(text));
        out
    }

    /// [`Self::push`] without what seeding left.
    fn read(&mut self, text: &str) -> Vec<OutputPiece> {
        if text.is_empty() {
            return Vec::new();
        }
        match &mut self.state {
            State::Idle => vec![OutputPiece::Text(text.to_owned())],
            State::Header { raw, role, channel } => {
                raw.push_str(text);
                channel.as_mut().unwrap_or(role).push_str(text);
                Vec::new()
            }
            State::Body(kind) => vec![match kind {
                Kind::Reasoning => OutputPiece::Reasoning(text.to_owned()),
                Kind::Content | Kind::Unchanged => OutputPiece::Text(text.to_owned()),
                Kind::Call => OutputPiece::CallArguments(text.to_owned()),
            }],
        }
    }

    /// Reads one special token, `marker` (its text, such as `<|channel|>`);
    /// special tokens that are not harmony markers are skipped.
    pub fn marker(&mut self, marker: &str) -> Vec<OutputPiece> {
        let mut out = std::mem::take(&mut self.pending);
        out.extend(self.read_marker(marker));
        out
    }

    /// [`Self::marker`] without what seeding left.
    fn read_marker(&mut self, marker: &str) -> Vec<OutputPiece> {
        let state = std::mem::replace(&mut self.state, State::Idle);
        match (state, marker) {
            (State::Header { raw, role, channel }, MESSAGE) => self.open(raw, &role, channel),
            (
                State::Header {
                    mut raw,
                    role,
                    channel: None,
                },
                CHANNEL,
            ) => {
                raw.push_str(CHANNEL);
                self.state = State::Header {
                    raw,
                    role,
                    channel: Some(String::new()),
                };
                Vec::new()
            }
            (
                State::Header {
                    mut raw,
                    mut role,
                    mut channel,
                },
                CONSTRAIN,
            ) => {
                raw.push_str(CONSTRAIN);
                // The content type is a word of its own.
                channel.as_mut().unwrap_or(&mut role).push(' ');
                self.state = State::Header { raw, role, channel };
                Vec::new()
            }
            // A new header (the reply's first starts at `<|channel|>`); an
            // unfinished message or header before it ends there.
            (_, START | CHANNEL) => {
                self.state = State::Header {
                    raw: marker.to_owned(),
                    role: String::new(),
                    channel: (marker == CHANNEL).then(String::new),
                };
                Vec::new()
            }
            (State::Body(Kind::Unchanged), END | CALL | RETURN) => {
                vec![OutputPiece::Text(marker.to_owned())]
            }
            (State::Body(_), END | CALL | RETURN) => Vec::new(),
            (state, _) => {
                // Another special token: skipped, as elsewhere.
                self.state = state;
                Vec::new()
            }
        }
    }

    /// A header ends (`<|message|>`): what its message is, from its
    /// recipient and channel.
    fn open(&mut self, raw: String, role: &str, channel: Option<String>) -> Vec<OutputPiece> {
        let channel = channel.unwrap_or_default();
        let recipient = role
            .split_whitespace()
            .chain(channel.split_whitespace())
            .find_map(|word| word.strip_prefix("to="));
        let function = recipient
            .and_then(|r| r.strip_prefix("functions."))
            .filter(|name| self.tool_names.iter().any(|n| n == name));
        let (kind, out) = match (recipient, function) {
            (_, Some(name)) => {
                self.calls += 1;
                let start = OutputPiece::CallStart {
                    id: new_call_id(),
                    name: name.to_owned(),
                };
                (Kind::Call, vec![start])
            }
            (Some(_), None) => (Kind::Unchanged, vec![OutputPiece::Text(raw + MESSAGE)]),
            (None, None) if channel.split_whitespace().next() == Some("analysis") => {
                (Kind::Reasoning, Vec::new())
            }
            (None, None) => (Kind::Content, Vec::new()),
        };
        self.state = State::Body(kind);
        out
    }

    /// The reply ended: a message still open ends with it; a header still
    /// open is dropped.
    pub fn finish(&mut self) -> Vec<OutputPiece> {
        self.state = State::Idle;
        std::mem::take(&mut self.pending)
    }
}
