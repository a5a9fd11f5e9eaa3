//! The Hermes / Qwen2.5 tool-call format:
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
//!
//! After the opening tag the call's JSON is read as JSON, not searched for
//! the closing tag, so a `</tool_call>` inside an argument string is just
//! text of the argument. Once `{"name": "<fn>", "arguments": ` has been
//! read and `<fn>` is one of the offered functions, the call is committed:
//! [`OutputPiece::CallStart`] goes out, then the arguments stream as
//! [`OutputPiece::CallArguments`] fragments, exactly as generated, until
//! the arguments object ends (as OpenAI and vLLM stream them). A call whose
//! keys come in another order, or whose arguments are a JSON string, is
//! held whole and sent when it ends. A call that does not parse, or names a
//! function that was not offered, is sent as text, unchanged. Whitespace
//! between calls is dropped. A forced reply starts with
//! [`forced_call_prefix`] in the prompt ([`HermesParser::forced`]).
//!
//! The same reader serves Llama 3.1-3.3's JSON format
//! ([`CallWrapper::Bare`], [`HermesParser::llama3_json`]): a reply that is a
//! call starts (after whitespace, and `<|python_tag|>` when the model
//! writes it) with `{"name": "<fn>", "parameters": {...}}`, with no tags;
//! further calls may follow, separated by `;` or whitespace. A reply that
//! starts with anything else is text, whatever follows (Meta's format puts
//! a call only at the start of a reply). Mistral's v3 format
//! ([`CallWrapper::List`], [`HermesParser::mistral_json`]) is the same
//! objects in a JSON list at the start of the reply,
//! `[{"name": .., "arguments": {..}}, ..]` (its `[TOOL_CALLS]` marker is a
//! special token, not text).

use mlxcel_engine_api::ToolCall;

use super::{emit_outside_text, new_call_id, release_outside, ToolCallParser};
use crate::output::{Filtered, OutputPiece};

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

/// How a call is wrapped in the reply's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallWrapper {
    /// Between `<tool_call>` and `</tool_call>`, anywhere in the reply
    /// (Hermes, Qwen2.5, Qwen3).
    Tagged,
    /// A bare JSON object at the start of the reply (after
    /// `<|python_tag|>` when present), calls separated by `;` or
    /// whitespace (Llama 3.1-3.3).
    Bare,
    /// A JSON list of call objects at the start of the reply (Mistral v3).
    List,
}

/// The marker Llama 3.1+ may write before a call (its `ipython` turn).
pub const PYTHON_TAG: &str = "<|python_tag|>";

/// Where the parser is.
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

/// The Hermes / Qwen2.5 tool-call parser; see the module docs.
#[derive(Debug)]
pub struct HermesParser {
    /// Functions whose calls are parsed out of the text.
    tool_names: Vec<String>,
    /// Under a forced `tool_choice`: wrapper text is never sent.
    forced: bool,
    /// Text past the stop check but not yet decided by the parser.
    held: String,
    /// Bytes of `held` an incremental [`JsonScan`] has already read.
    scanned: usize,
    call: CallState,
    calls: usize,
    wrapper: CallWrapper,
    /// [`CallWrapper::Bare`] and [`CallWrapper::List`]: the reply has
    /// shown it is not calls; all of it is text.
    text_only: bool,
    /// The reply's text before its first call's `{` (whitespace, the list's
    /// `[`), sent as text if that call turns out not to be one.
    lead: String,
}

impl ToolCallParser for HermesParser {
    fn new(tool_names: &[String]) -> Self {
        Self {
            tool_names: tool_names.to_vec(),
            forced: false,
            held: String::new(),
            scanned: 0,
            call: CallState::Outside,
            calls: 0,
            wrapper: CallWrapper::Tagged,
            text_only: false,
            lead: String::new(),
        }
    }

    /// `prefix` is from [`forced_call_prefix`].
    fn forced(tool_names: &[String], prefix: &str) -> Self {
        let mut parser = Self::new(tool_names);
        parser.forced = true;
        parser.held = prefix.to_owned();
        parser
    }

    fn push(&mut self, text: &str) -> Vec<OutputPiece> {
        self.parse(text, false).pieces
    }

    fn finish(&mut self, text: &str) -> Vec<OutputPiece> {
        self.parse(text, true).pieces
    }

    fn calls(&self) -> usize {
        self.calls
    }
}

impl HermesParser {
    /// The parser of Llama 3.1-3.3's bare JSON calls ([`CallWrapper::Bare`]).
    pub fn llama3_json(tool_names: &[String]) -> Self {
        let mut parser = Self::new(tool_names);
        parser.wrapper = CallWrapper::Bare;
        parser
    }

    /// The parser of Mistral's v3 JSON list of calls ([`CallWrapper::List`]).
    pub fn mistral_json(tool_names: &[String]) -> Self {
        let mut parser = Self::new(tool_names);
        parser.wrapper = CallWrapper::List;
        parser
    }

    /// Calls are bare objects or a list of them at the reply's start.
    fn bare(&self) -> bool {
        self.wrapper != CallWrapper::Tagged
    }

    /// Bare or listed calls, outside a call: a call starts here when the
    /// held text (past whitespace, a separator after a call, Llama's
    /// `<|python_tag|>`, the list's `[` before the first call) opens a JSON
    /// object; `None` while that is still undecided.
    fn bare_call_starts(&mut self, last: bool) -> Option<bool> {
        if self.text_only {
            return Some(false);
        }
        let after_call = self.calls > 0;
        let list = self.wrapper == CallWrapper::List;
        let skip = |c: char| {
            c.is_whitespace() || (after_call && (c == ';' || (list && (c == ',' || c == ']'))))
        };
        let mut rest = self.held.trim_start_matches(skip);
        if let Some(after) = rest.strip_prefix(PYTHON_TAG) {
            let at = self.held.len() - after.len();
            self.held.drain(..at);
            return self.bare_call_starts(last);
        }
        if list && !after_call {
            // The first call opens the list.
            match rest.strip_prefix('[') {
                Some(after) => rest = after.trim_start(),
                None if !last && rest.is_empty() => return None,
                None => {
                    self.text_only = true;
                    return Some(false);
                }
            }
            if rest.is_empty() && !last {
                return None;
            }
        }
        if rest.starts_with('{') {
            let at = self.held.len() - rest.len();
            let lead: String = self.held.drain(..at).collect();
            if !after_call {
                self.lead = lead;
            }
            return Some(true);
        }
        if !last && (rest.is_empty() || PYTHON_TAG.starts_with(rest)) {
            return None;
        }
        self.text_only = true;
        Some(false)
    }

    /// Runs released text through the parser; `last` decides whatever is
    /// still held.
    fn parse(&mut self, released: &str, last: bool) -> Filtered {
        let mut out = Filtered::default();
        self.held.push_str(released);
        while self.step(&mut out, last) {}
        if last {
            self.end(&mut out);
        }
        out
    }

    /// One move of the parser over `held`; false when it needs more text.
    fn step(&mut self, out: &mut Filtered, last: bool) -> bool {
        match self.call {
            CallState::Outside if self.bare() => {
                match self.bare_call_starts(last) {
                    None => false,
                    Some(true) => {
                        self.call = CallState::Header;
                        true
                    }
                    Some(false) => {
                        let text = std::mem::take(&mut self.held);
                        // After a call, whatever is not one is dropped only
                        // when it is whitespace (and `;`).
                        let separators = |c: char| {
                            c.is_whitespace()
                                || c == ';'
                                || (self.wrapper == CallWrapper::List && (c == ',' || c == ']'))
                        };
                        let text = if self.calls > 0 && text.trim_matches(separators).is_empty() {
                            String::new()
                        } else {
                            text
                        };
                        self.emit_text(out, &text);
                        false
                    }
                }
            }
            CallState::Outside => {
                let seen = (self.forced, self.calls);
                if release_outside(&mut self.held, TOOL_CALL_OPEN, out, seen, last) {
                    self.call = CallState::Header;
                    return true;
                }
                false
            }
            CallState::Header => match parse_header(&self.held) {
                Header::Incomplete => false,
                Header::Arguments { name, at, encoded } if self.tool_names.contains(&name) => {
                    self.calls += 1;
                    self.lead.clear();
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
                    self.call = match self.wrapper {
                        CallWrapper::Tagged => CallState::Tail { brace: true },
                        CallWrapper::Bare | CallWrapper::List => CallState::Outside,
                    };
                    return true;
                }
                if self.bare() {
                    if self.held.is_empty() && !last {
                        return false;
                    }
                    // No closing brace: what follows is decided outside.
                    self.call = CallState::Outside;
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
                let close = match self.wrapper {
                    CallWrapper::Tagged => TOOL_CALL_CLOSE.len(),
                    CallWrapper::Bare | CallWrapper::List => 0,
                };
                self.held.drain(..end + close);
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
        if self.bare() {
            // The object is the call (a bare call opens with `{`).
            let mut scan = JsonScan::default();
            return scan
                .feed(&self.held[body_start..])
                .map(|end| body_start + end);
        }
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
        // A bare object is a call only with its arguments key: a JSON
        // answer that happens to have a "name" is text.
        let bare_ok = self.wrapper == CallWrapper::Tagged || has_arguments_key(body);
        match parse_tool_call(body).filter(|c| bare_ok && self.tool_names.contains(&c.name)) {
            Some(call) => {
                self.calls += 1;
                self.lead.clear();
                out.push(OutputPiece::CallStart {
                    id: call.id,
                    name: call.name,
                });
                out.arguments(&call.arguments);
            }
            None if self.forced => {}
            None if self.bare() => {
                // Not a call: the reply is text from here on (with what
                // came before the object when it was the first).
                self.text_only = true;
                out.text_piece(&std::mem::take(&mut self.lead));
                out.text_piece(body);
            }
            None => {
                out.text_piece(TOOL_CALL_OPEN);
                out.text_piece(body);
                if closed {
                    out.text_piece(TOOL_CALL_CLOSE);
                }
            }
        }
    }

    /// Sends text outside any call: never under a forced choice (the
    /// grammar allows only calls there, so whatever is outside one is
    /// wrapper text, such as the start of a next call cut by `max_tokens`),
    /// and not whitespace after a call.
    fn emit_text(&self, out: &mut Filtered, text: &str) {
        emit_outside_text(out, text, self.forced, self.calls);
    }
}

/// An incremental scan for the end of one JSON object, array or string:
/// tracks nesting and string state only (the grammar, or the final parse,
/// checks the rest).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct JsonScan {
    depth: u32,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    /// Reads `text`, which continues what was read before; the byte
    /// offset just past the value's end when it ends in `text`.
    pub(crate) fn feed(&mut self, text: &str) -> Option<usize> {
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

/// Whether `body` is a JSON object with an `arguments` or `parameters` key.
fn has_arguments_key(body: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(body.trim())
        .is_ok_and(|v| v.get("arguments").is_some() || v.get("parameters").is_some())
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

#[cfg(test)]
mod tests {
    use super::*;

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
