//! What a choice's text becomes on its stream: stop strings and tool calls.
//!
//! The detokenizer turns tokens into text; [`OutputFilter`] decides which of
//! that text the client sees, as what, and when:
//!
//! - **Stop strings.** Text that might be the start of a stop string is held
//!   back until the next text decides it; the first complete stop string
//!   ends the choice, and neither it nor anything after it is sent (OpenAI's
//!   `stop`). The search runs over everything not yet sent, so a stop string
//!   split across any number of tokens is found.
//! - **Tool calls** (Hermes / Qwen2.5 format:
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`). After
//!   the opening tag the call's JSON is read as JSON, not searched for the
//!   closing tag, so a `</tool_call>` inside an argument string is just
//!   text of the argument. Once `{"name": "<fn>", "arguments": ` has been
//!   read and `<fn>` is one of the offered functions, the call is committed:
//!   [`OutputPiece::CallStart`] goes out, then the arguments stream as
//!   [`OutputPiece::CallArguments`] fragments, exactly as generated, until
//!   the arguments object ends (as OpenAI and vLLM stream them). A call
//!   whose keys come in another order, or whose arguments are a JSON
//!   string, is held whole and sent when it ends. A call that does not
//!   parse, or names a function that was not offered, is sent as text,
//!   unchanged. Whitespace between calls is dropped.
//! - **Forced calls.** Under a named or required `tool_choice` the engine
//!   puts the start of the call in the prompt ([`forced_call_prefix`]) and
//!   constrains only what follows; the filter is seeded with that same
//!   prefix ([`OutputFilter::forced`]), so the call is built from the
//!   generated arguments and no wrapper text is ever sent, even when the
//!   choice is cut short.

use crate::reasoning::{ReasoningSplitter, ReplyPart};
use mlxcel_engine_api::ToolCall;

/// Opening tag of a Hermes-style tool call.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// Closing tag of a Hermes-style tool call.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// The start of a forced reply, put after the prompt's generation prompt:
/// `<tool_call>\n{"name": "<name>", "arguments": ` for a call to `name`
/// (`tool_choice` naming a function; the model then writes only the
/// arguments), or `<tool_call>\n{"name": "` for a call to any function
/// (`tool_choice: "required"`; the model writes the name on).
pub fn forced_call_prefix(name: Option<&str>) -> String {
    match name {
        // Names are `[a-zA-Z0-9_-]{1,64}` (checked at the HTTP edge), so no
        // JSON escaping is needed; `to_string` escapes anyway.
        Some(name) => format!(
            "{TOOL_CALL_OPEN}\n{{\"name\": {}, \"arguments\": ",
            serde_json::Value::from(name)
        ),
        None => format!("{TOOL_CALL_OPEN}\n{{\"name\": \""),
    }
}

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

/// Where the tool-call parser is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum CallState {
    /// Outside any call.
    Outside,
    /// After the opening tag, before the arguments' first character: held.
    Header,
    /// Committed; the arguments object streams.
    Arguments(JsonScan),
    /// Committed; the arguments are a JSON string, held until it ends and
    /// then sent decoded.
    EncodedArguments(JsonScan),
    /// Committed and complete; what is left of the wrapper (`}`, the
    /// closing tag) is dropped. `brace`: the call's own `}` was seen.
    Tail { brace: bool },
    /// Not streamable: held whole until it ends, then parsed.
    Held,
}

/// Per-choice output filter; see the module docs.
#[derive(Debug)]
pub struct OutputFilter {
    stop: Vec<String>,
    /// Functions whose calls are parsed out of the text (empty: no parsing).
    tool_names: Vec<String>,
    /// Under a forced `tool_choice`: wrapper text is never sent.
    forced: bool,
    /// Text not yet past the stop-string check.
    pending: String,
    /// Text past the stop check but not yet decided by the tool-call parser.
    held: String,
    /// Bytes of `held` an incremental [`JsonScan`] has already read.
    scanned: usize,
    call: CallState,
    calls: usize,
    stopped: bool,
    /// Splits reasoning off before everything else (reasoning models).
    reasoning: Option<ReasoningSplitter>,
}

impl OutputFilter {
    /// A filter ending at any of `stop` (empty strings are ignored) and
    /// extracting calls of the functions named in `tool_names` (a call of
    /// any other name stays text: it is not a call the client can answer).
    pub fn new(stop: &[String], tool_names: &[String]) -> Self {
        Self {
            stop: stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
            tool_names: tool_names.to_vec(),
            forced: false,
            pending: String::new(),
            held: String::new(),
            scanned: 0,
            call: CallState::Outside,
            calls: 0,
            stopped: false,
            reasoning: None,
        }
    }

    /// The same filter, after `splitter` has taken the reasoning out: only
    /// the answer goes through stop strings and tool-call parsing.
    pub fn with_reasoning(mut self, splitter: ReasoningSplitter) -> Self {
        self.reasoning = Some(splitter);
        self
    }

    /// The filter of a forced reply whose first text, `prefix` (from
    /// [`forced_call_prefix`]), is in the prompt rather than generated:
    /// the generated text continues it. Text that never became a call (a
    /// choice cut before the function name was complete) is dropped.
    pub fn forced(stop: &[String], tool_names: &[String], prefix: &str) -> Self {
        let mut filter = Self::new(stop, tool_names);
        filter.forced = true;
        filter.held = prefix.to_owned();
        filter
    }

    /// Tool calls found so far.
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    /// Feeds newly decoded text. After a stop, further text is ignored.
    pub fn push(&mut self, text: &str) -> Filtered {
        if self.stopped {
            return Filtered::default();
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
            if self.stopped {
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
        self.pending.push_str(text);
        let released = match self.earliest_stop() {
            Some(at) => {
                self.stopped = true;
                let before = self.pending[..at].to_owned();
                self.pending.clear();
                before
            }
            None => {
                let keep = self.stop_prefix_len();
                let cut = self.pending.len() - keep;
                self.pending.drain(..cut).collect()
            }
        };
        let mut out = self.parse(&released, self.stopped);
        out.stopped = self.stopped;
        out
    }

    /// Ends the choice (EOS, length, grammar complete): everything held is
    /// decided now.
    pub fn finish(&mut self) -> Filtered {
        let mut out = match self.reasoning.as_mut().map(ReasoningSplitter::finish) {
            Some(parts) if !self.stopped => self.route(parts),
            _ => Filtered::default(),
        };
        let rest = std::mem::take(&mut self.pending);
        out.extend(self.parse(&rest, true));
        out
    }

    /// Byte offset of the first stop string in `pending`.
    fn earliest_stop(&self) -> Option<usize> {
        self.stop
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
    }

    /// Length of the longest suffix of `pending` that starts some stop
    /// string (held back until decided).
    fn stop_prefix_len(&self) -> usize {
        self.stop
            .iter()
            .map(|s| partial_suffix(&self.pending, s))
            .max()
            .unwrap_or(0)
    }

    /// Runs released text through the tool-call parser; `last` decides
    /// whatever is still held.
    fn parse(&mut self, released: &str, last: bool) -> Filtered {
        let mut out = Filtered::default();
        if self.tool_names.is_empty() {
            out.text_piece(released);
            return out;
        }
        self.held.push_str(released);
        while self.step(&mut out, last) {}
        if last {
            self.end(&mut out);
        }
        out
    }

    /// One move of the tool-call parser over `held`; false when it needs
    /// more text.
    fn step(&mut self, out: &mut Filtered, last: bool) -> bool {
        match self.call {
            CallState::Outside => {
                if let Some(start) = self.held.find(TOOL_CALL_OPEN) {
                    let before: String = self.held.drain(..start).collect();
                    self.emit_text(out, &before);
                    self.held.drain(..TOOL_CALL_OPEN.len());
                    self.call = CallState::Header;
                    return true;
                }
                let keep = if last {
                    0
                } else {
                    partial_suffix(&self.held, TOOL_CALL_OPEN)
                };
                let cut = self.held.len() - keep;
                // Whitespace after a call waits: it is dropped unless text
                // follows.
                if self.calls > 0 && !last && self.held[..cut].trim().is_empty() {
                    return false;
                }
                let text: String = self.held.drain(..cut).collect();
                self.emit_text(out, &text);
                false
            }
            CallState::Header => match parse_header(&self.held) {
                Header::Incomplete => false,
                Header::Arguments { name, at, encoded } if self.tool_names.contains(&name) => {
                    self.calls += 1;
                    out.push(OutputPiece::CallStart {
                        id: new_call_id(),
                        name,
                    });
                    self.held.drain(..at);
                    self.scanned = 0;
                    self.call = if encoded {
                        CallState::EncodedArguments(JsonScan::default())
                    } else {
                        CallState::Arguments(JsonScan::default())
                    };
                    true
                }
                Header::Arguments { .. } | Header::Other => {
                    self.scanned = 0;
                    self.call = CallState::Held;
                    true
                }
            },
            CallState::Arguments(mut scan) => match scan.feed(&self.held) {
                Some(end) => {
                    let arguments: String = self.held.drain(..end).collect();
                    out.arguments(&arguments);
                    self.call = CallState::Tail { brace: false };
                    true
                }
                None => {
                    out.arguments(&std::mem::take(&mut self.held));
                    self.call = CallState::Arguments(scan);
                    false
                }
            },
            CallState::EncodedArguments(mut scan) => match scan.feed(&self.held[self.scanned..]) {
                Some(end) => {
                    let end = self.scanned + end;
                    let raw: String = self.held.drain(..end).collect();
                    let arguments = serde_json::from_str::<String>(&raw).unwrap_or(raw);
                    out.arguments(&arguments);
                    self.call = CallState::Tail { brace: false };
                    true
                }
                None => {
                    self.scanned = self.held.len();
                    self.call = CallState::EncodedArguments(scan);
                    false
                }
            },
            CallState::Tail { brace } => {
                let ws = self.held.len() - self.held.trim_start().len();
                self.held.drain(..ws);
                if !brace && self.held.starts_with('}') {
                    self.held.drain(..1);
                    self.call = CallState::Tail { brace: true };
                    return true;
                }
                if self.held.starts_with(TOOL_CALL_CLOSE) {
                    self.held.drain(..TOOL_CALL_CLOSE.len());
                    self.call = CallState::Outside;
                    return true;
                }
                if TOOL_CALL_CLOSE.starts_with(self.held.as_str()) {
                    // Empty, or the start of the closing tag: wait for the
                    // rest, or at the end drop it (it is wrapper).
                    if !last {
                        return false;
                    }
                    self.held.clear();
                }
                // The wrapper ended without its tag: what follows is text.
                self.call = CallState::Outside;
                true
            }
            CallState::Held => {
                let Some(end) = self.held_call_end() else {
                    return false;
                };
                let body = self.held[..end].to_owned();
                self.held.drain(..end + TOOL_CALL_CLOSE.len());
                self.close_held(out, &body, true);
                true
            }
        }
    }

    /// Where the closing tag of a held call starts: after its JSON object
    /// when the body is one (a tag inside a string is not the end), else
    /// at the first tag.
    fn held_call_end(&mut self) -> Option<usize> {
        let body_start = self.held.len() - self.held.trim_start().len();
        let from = if self.held[body_start..].starts_with('{') {
            let mut scan = JsonScan::default();
            body_start + scan.feed(&self.held[body_start..])?
        } else {
            0
        };
        self.held[from..].find(TOOL_CALL_CLOSE).map(|at| from + at)
    }

    /// The choice ended: a call still open is decided.
    fn end(&mut self, out: &mut Filtered) {
        match std::mem::replace(&mut self.call, CallState::Outside) {
            CallState::Outside | CallState::Tail { .. } | CallState::Arguments(_) => {}
            CallState::EncodedArguments(_) => {
                // Cut inside the string: the arguments as generated.
                out.arguments(&std::mem::take(&mut self.held));
            }
            CallState::Header | CallState::Held => {
                let body = std::mem::take(&mut self.held);
                self.close_held(out, &body, false);
            }
        }
        self.held.clear();
    }

    /// Ends a held call whose JSON is `body` (`closed`: by its closing
    /// tag): a call when it parses and names an offered function, else its
    /// text, unchanged (dropped under a forced choice).
    fn close_held(&mut self, out: &mut Filtered, body: &str, closed: bool) {
        self.call = CallState::Outside;
        match parse_tool_call(body).filter(|c| self.tool_names.contains(&c.name)) {
            Some(call) => {
                self.calls += 1;
                out.push(OutputPiece::CallStart {
                    id: call.id,
                    name: call.name,
                });
                out.arguments(&call.arguments);
            }
            None if self.forced => {}
            None => {
                out.text_piece(TOOL_CALL_OPEN);
                out.text_piece(body);
                if closed {
                    out.text_piece(TOOL_CALL_CLOSE);
                }
            }
        }
    }

    fn emit_text(&self, out: &mut Filtered, text: &str) {
        if self.calls > 0 && text.trim().is_empty() {
            return;
        }
        if self.forced && text.trim().is_empty() {
            return;
        }
        out.text_piece(text);
    }
}

/// An incremental scan for the end of one JSON object, array or string:
/// tracks nesting and string state only (the grammar, or the final parse,
/// checks the rest).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct JsonScan {
    depth: u32,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    /// Reads `text`, which continues what was read before; the byte
    /// offset just past the value's end when it ends in `text`.
    fn feed(&mut self, text: &str) -> Option<usize> {
        for (i, b) in text.bytes().enumerate() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                    if self.depth == 0 {
                        return Some(i + 1);
                    }
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return Some(i + 1);
                    }
                }
                _ => {}
            }
        }
        None
    }
}

/// What the text after an opening tag says so far.
#[derive(Debug, PartialEq)]
enum Header {
    /// Could still become `{"name": "..", "arguments": `: more text needed.
    Incomplete,
    /// `{"name": "<name>", "arguments": ` (or `"parameters"`), whose value
    /// starts at byte `at` with `{` (or `"` when `encoded`).
    Arguments {
        name: String,
        at: usize,
        encoded: bool,
    },
    /// Anything else (other key order, other value types, not JSON).
    Other,
}

/// Reads the header of a call: `{"name": <string>, "arguments": ` up to the
/// first byte of the arguments value, JSON whitespace allowed between
/// tokens.
fn parse_header(s: &str) -> Header {
    read_header(s).unwrap_or_else(|h| h)
}

/// [`parse_header`], with `Err` for the early outcomes.
fn read_header(s: &str) -> Result<Header, Header> {
    let b = s.as_bytes();
    let ws = |i: &mut usize| {
        while *i < b.len() && matches!(b[*i], b' ' | b'\n' | b'\r' | b'\t') {
            *i += 1;
        }
    };
    // One of `options` at `i` (advanced past it).
    let literal = |i: &mut usize, options: &[&str]| -> Result<(), Header> {
        let rest = &s[*i..];
        if let Some(l) = options.iter().find(|l| rest.starts_with(**l)) {
            *i += l.len();
            Ok(())
        } else if options.iter().any(|l| l.starts_with(rest)) {
            Err(Header::Incomplete)
        } else {
            Err(Header::Other)
        }
    };
    let mut i = 0;
    for options in [&["{"][..], &["\"name\""], &[":"]] {
        ws(&mut i);
        literal(&mut i, options)?;
    }
    ws(&mut i);
    match b.get(i) {
        None => return Err(Header::Incomplete),
        Some(b'"') => {}
        Some(_) => return Err(Header::Other),
    }
    let len = JsonScan::default()
        .feed(&s[i..])
        .ok_or(Header::Incomplete)?;
    let name: String = serde_json::from_str(&s[i..i + len]).map_err(|_| Header::Other)?;
    i += len;
    for options in [&[","][..], &["\"arguments\"", "\"parameters\""], &[":"]] {
        ws(&mut i);
        literal(&mut i, options)?;
    }
    ws(&mut i);
    let encoded = match b.get(i) {
        None => return Err(Header::Incomplete),
        Some(b'{') => false,
        Some(b'"') => true,
        Some(_) => return Err(Header::Other),
    };
    Ok(Header::Arguments {
        name,
        at: i,
        encoded,
    })
}

/// Length in bytes of the longest proper suffix of `text` that is a prefix
/// of `pattern` (on character boundaries).
fn partial_suffix(text: &str, pattern: &str) -> usize {
    let longest = pattern.len().saturating_sub(1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && pattern.is_char_boundary(n)
                && pattern
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

/// `{"name": str, "arguments": object | JSON string}` → a call with a fresh
/// id; `None` when it isn't that.
pub fn parse_tool_call(body: &str) -> Option<ToolCall> {
    let value: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None | Some(serde_json::Value::Null) => "{}".to_owned(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(v) => serde_json::to_string(v).ok()?,
    };
    Some(ToolCall {
        id: new_call_id(),
        name,
        arguments,
    })
}

/// `call_` and 24 random hex digits.
fn new_call_id() -> String {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::try_from_os_rng()
        .unwrap_or_else(|_| rand_chacha::ChaCha8Rng::seed_from_u64(std::process::id().into()));
    format!("call_{:016x}{:08x}", rng.next_u64(), rng.next_u32())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reasoning::ReasoningSplitter;

    /// A call as the pieces built it.
    #[derive(Debug, Clone, PartialEq)]
    struct Call {
        id: String,
        name: String,
        arguments: String,
    }

    /// What a choice sent: its text, its calls, whether a stop string ended
    /// it, and every argument fragment in order.
    #[derive(Debug, Default)]
    struct Sent {
        text: String,
        reasoning: String,
        calls: Vec<Call>,
        stopped: bool,
        fragments: Vec<String>,
    }

    impl Sent {
        fn take(&mut self, f: Filtered) {
            for piece in f.pieces {
                match piece {
                    OutputPiece::Text(t) => self.text += &t,
                    OutputPiece::Reasoning(t) => self.reasoning += &t,
                    OutputPiece::CallStart { id, name } => self.calls.push(Call {
                        id,
                        name,
                        arguments: String::new(),
                    }),
                    OutputPiece::CallArguments(a) => {
                        self.calls
                            .last_mut()
                            .expect("arguments before a call")
                            .arguments += &a;
                        self.fragments.push(a);
                    }
                }
            }
            self.stopped |= f.stopped;
        }
    }

    /// Feeds `pieces` one by one, then finishes.
    fn run(filter: &mut OutputFilter, pieces: &[&str]) -> Sent {
        let mut sent = Sent::default();
        for p in pieces {
            sent.take(filter.push(p));
            if sent.stopped {
                return sent;
            }
        }
        sent.take(filter.finish());
        sent
    }

    /// `text` split into pieces of `n` characters (tokens of a sort).
    fn chunks(text: &str, n: usize) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        chars.chunks(n).map(|c| c.iter().collect()).collect()
    }

    fn run_chunked(filter: &mut OutputFilter, text: &str, n: usize) -> Sent {
        let pieces = chunks(text, n);
        let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
        run(filter, &pieces)
    }

    fn tools(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    /// Stop strings and calls are looked for in the answer only: inside
    /// the reasoning they are text.
    #[test]
    fn reasoning_is_split_off_before_stops_and_calls() {
        let text = "<think>\nSTOP is no stop here, nor <tool_call> a call.\n</think>\n\n\
                    Calling. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\
                    STOP after";
        for n in 1..=text.chars().count() {
            let mut f = OutputFilter::new(&["STOP".into()], &tools(&["f"]))
                .with_reasoning(ReasoningSplitter::new(false));
            let sent = run_chunked(&mut f, text, n);
            assert_eq!(
                sent.reasoning, "STOP is no stop here, nor <tool_call> a call.",
                "pieces of {n}"
            );
            assert_eq!(sent.text.trim_end(), "Calling.", "pieces of {n}");
            assert_eq!(sent.calls.len(), 1, "pieces of {n}");
            assert_eq!(sent.calls[0].arguments, "{\"x\": 1}", "pieces of {n}");
            assert!(sent.stopped, "pieces of {n}");
        }
    }

    #[test]
    fn a_stop_string_split_across_pieces_ends_the_text_before_it() {
        let mut f = OutputFilter::new(&["END".into()], &[]);
        assert_eq!(f.push("Hello E").text(), "Hello ");
        assert_eq!(f.push("N").text(), "");
        let last = f.push("D and more");
        assert_eq!(last.text(), "");
        assert!(last.stopped);
        assert_eq!(f.push("ignored"), Filtered::default());
    }

    #[test]
    fn held_text_that_turns_out_not_to_stop_is_sent() {
        let mut f = OutputFilter::new(&["\n\n".into(), "###".into()], &[]);
        assert_eq!(f.push("a\n").text(), "a");
        assert_eq!(f.push("b#").text(), "\nb");
        assert_eq!(f.push("#x").text(), "##x");
        assert_eq!(f.finish().text(), "");
        let sent = run(&mut OutputFilter::new(&["##".into()], &[]), &["1#", "2#"]);
        assert_eq!((sent.text.as_str(), sent.stopped), ("1#2#", false));
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let stops = ["world".to_string(), "lo w".to_string()];
        let sent = run(&mut OutputFilter::new(&stops, &[]), &["hello world"]);
        assert_eq!((sent.text.as_str(), sent.stopped), ("hel", true));
    }

    #[test]
    fn multibyte_text_is_cut_on_character_boundaries() {
        let mut f = OutputFilter::new(&["éa".into()], &[]);
        assert_eq!(f.push("xyé").text(), "xy");
        assert_eq!(f.push("b").text(), "éb");
    }

    #[test]
    fn tool_calls_are_parsed_and_their_text_withheld() {
        let mut f = OutputFilter::new(&[], &tools(&["get_weather", "now", "f"]));
        let pieces = [
            "Let me check.",
            "<tool_",
            "call>\n{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "\n<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>\n",
        ];
        let sent = run(&mut f, &pieces);
        assert_eq!(sent.text, "Let me check.");
        assert_eq!(sent.calls.len(), 2);
        assert_eq!(sent.calls[0].name, "get_weather");
        // The arguments exactly as generated.
        assert_eq!(sent.calls[0].arguments, r#"{"city": "Paris"}"#);
        assert_eq!(sent.calls[1].name, "now");
        assert_eq!(sent.calls[1].arguments, "{}");
        assert!(sent.calls[0].id.starts_with("call_") && sent.calls[0].id.len() == 29);
        assert_ne!(sent.calls[0].id, sent.calls[1].id);
        assert_eq!(f.tool_calls(), 2);
    }

    #[test]
    fn arguments_stream_as_they_are_generated() {
        let args = r#"{"city": "Paris", "days": [1, 2, {"x": "}"}]}"#;
        let call = format!(
            "<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {args}}}\n</tool_call>"
        );
        let mut f = OutputFilter::new(&[], &tools(&["get_weather"]));
        let pieces = chunks(&call, 3);
        let mut started_at = None;
        let mut sent = Sent::default();
        for (i, p) in pieces.iter().enumerate() {
            sent.take(f.push(p));
            if started_at.is_none() && !sent.calls.is_empty() {
                started_at = Some(i);
            }
        }
        sent.take(f.finish());
        // The call starts as soon as `"arguments": {` is read, long before
        // the arguments end, and the fragments add up to them.
        let header = call.find("{\"city\"").unwrap();
        assert_eq!(started_at, Some(header / 3));
        assert!(sent.fragments.len() > 5, "{:?}", sent.fragments);
        assert_eq!(sent.calls.len(), 1);
        assert_eq!(sent.calls[0].arguments, args);
        assert_eq!(sent.text, "");
    }

    #[test]
    fn a_closing_tag_inside_an_argument_string_is_argument_text() {
        // Every piece of the wrapper inside strings: the call ends where its
        // JSON does, whatever the split.
        let code =
            r#"<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call> } </tool_call"#;
        let args = format!("{{\"code\": \"{code}\"}}");
        let streamed =
            format!("<tool_call>\n{{\"name\": \"f\", \"arguments\": {args}}}\n</tool_call>");
        // Keys in the other order: held whole, parsed at its end.
        let held = format!("<tool_call>\n{{\"arguments\": {args}, \"name\": \"f\"}}\n</tool_call>");
        for call in [&streamed, &held] {
            for n in [1, 2, 5, 64] {
                let sent = run_chunked(&mut OutputFilter::new(&[], &tools(&["f"])), call, n);
                assert_eq!(sent.text, "", "{call} by {n}");
                assert_eq!(sent.calls.len(), 1, "{call} by {n}");
                let parsed: serde_json::Value =
                    serde_json::from_str(&sent.calls[0].arguments).unwrap();
                let want: serde_json::Value = serde_json::from_str(&args).unwrap();
                assert_eq!(parsed, want, "{call} by {n}");
            }
        }
    }

    #[test]
    fn a_call_without_a_closing_tag_is_parsed_at_the_end() {
        let sent = run(
            &mut OutputFilter::new(&[], &tools(&["get_weather", "now", "f"])),
            &["<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}"],
        );
        assert_eq!(sent.text, "");
        // String-encoded arguments are sent decoded.
        assert_eq!(sent.calls[0].arguments, "{\"a\": 1}");
    }

    #[test]
    fn text_after_a_call_without_its_closing_tag_is_kept() {
        let sent = run(
            &mut OutputFilter::new(&[], &tools(&["now"])),
            &[
                "<tool_call>{\"name\": \"now\", \"arguments\": {}",
                "} Done.",
            ],
        );
        assert_eq!(sent.calls.len(), 1);
        assert_eq!(sent.text, "Done.");
    }

    #[test]
    fn malformed_calls_and_lookalike_text_stay_text() {
        let sent = run(
            &mut OutputFilter::new(&[], &tools(&["get_weather", "now", "f"])),
            &["a <tool", "_cal", "l>not json</tool_call> b <to"],
        );
        assert!(sent.calls.is_empty());
        assert_eq!(sent.text, "a <tool_call>not json</tool_call> b <to");
    }

    #[test]
    fn calls_of_functions_not_offered_stay_text() {
        let call = "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>";
        let sent = run(&mut OutputFilter::new(&[], &tools(&["now"])), &[call]);
        assert!(sent.calls.is_empty());
        assert_eq!(sent.text, call);
        let sent = run(
            &mut OutputFilter::new(&[], &tools(&["now", "rm_rf"])),
            &[call],
        );
        assert_eq!((sent.text.as_str(), sent.calls.len()), ("", 1));
    }

    #[test]
    fn without_tool_parsing_tags_are_plain_text() {
        let sent = run(
            &mut OutputFilter::new(&[], &[]),
            &["<tool_call>{\"name\": \"f\"}</tool_call>"],
        );
        assert!(sent.calls.is_empty());
        assert_eq!(sent.text, "<tool_call>{\"name\": \"f\"}</tool_call>");
    }

    #[test]
    fn a_named_forced_call_is_its_generated_arguments() {
        let prefix = forced_call_prefix(Some("get_weather"));
        assert_eq!(
            prefix,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        );
        let names = tools(&["get_weather", "now"]);
        // Complete: the grammar ends the choice after the arguments.
        let mut f = OutputFilter::forced(&[], &names, &prefix);
        let sent = run(&mut f, &["{\"city\"", ": \"Pa", "ris\"}"]);
        assert_eq!(sent.text, "");
        assert_eq!(sent.calls.len(), 1);
        assert_eq!(sent.calls[0].name, "get_weather");
        assert_eq!(sent.calls[0].arguments, "{\"city\": \"Paris\"}");
        assert_eq!(sent.fragments.len(), 3);
        // Cut by max_tokens: the call stands, with the arguments as
        // generated; no wrapper text.
        let mut f = OutputFilter::forced(&[], &names, &prefix);
        let sent = run(&mut f, &["{\"city\"", ": \"Pa"]);
        assert_eq!(sent.text, "");
        assert_eq!(sent.calls[0].arguments, "{\"city\": \"Pa");
        assert_eq!(f.tool_calls(), 1);
    }

    #[test]
    fn required_calls_continue_the_prefix_and_never_leave_wrapper_text() {
        let prefix = forced_call_prefix(None);
        let names = tools(&["get_weather", "now"]);
        let reply = "now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"</tool_call>\"}}\n</tool_call>\n";
        for n in [1, 3, 200] {
            let sent = run_chunked(&mut OutputFilter::forced(&[], &names, &prefix), reply, n);
            assert_eq!(sent.text, "", "by {n}");
            let got: Vec<(&str, &str)> = sent
                .calls
                .iter()
                .map(|c| (c.name.as_str(), c.arguments.as_str()))
                .collect();
            assert_eq!(
                got,
                [
                    ("now", "{}"),
                    ("get_weather", "{\"city\": \"</tool_call>\"}")
                ],
                "by {n}"
            );
        }
        // Cut inside the closing tag: the calls, and no text.
        let cut = &reply[..reply.find("</tool_call>\n<tool_call>").unwrap() + 6];
        let sent = run_chunked(&mut OutputFilter::forced(&[], &names, &prefix), cut, 4);
        assert_eq!((sent.text.as_str(), sent.calls.len()), ("", 1));
        let sent = run_chunked(
            &mut OutputFilter::new(&[], &names),
            &format!("{prefix}{cut}"),
            4,
        );
        assert_eq!((sent.text.as_str(), sent.calls.len()), ("", 1));
        // Cut inside the name: no call, and no text either.
        let mut f = OutputFilter::forced(&[], &names, &prefix);
        let sent = run(&mut f, &["get_wea"]);
        assert_eq!((sent.text.as_str(), sent.calls.len()), ("", 0));
    }

    #[test]
    fn headers_are_read_incrementally() {
        let full = "{\"name\": \"f\", \"arguments\": {";
        for end in 0..full.len() {
            assert_eq!(
                parse_header(&full[..end]),
                Header::Incomplete,
                "{:?}",
                &full[..end]
            );
        }
        assert_eq!(
            parse_header(full),
            Header::Arguments {
                name: "f".into(),
                at: full.len() - 1,
                encoded: false
            }
        );
        assert_eq!(
            parse_header(" {\n\"name\" : \"a\\\"b\" ,\"parameters\":\"x"),
            Header::Arguments {
                name: "a\"b".into(),
                at: 33,
                encoded: true
            }
        );
        for other in [
            "x",
            "{\"arguments\"",
            "{\"name\": 1",
            "{\"name\": \"f\", \"arguments\": 3",
        ] {
            assert_eq!(parse_header(other), Header::Other, "{other}");
        }
    }
}
