//! Gemma 4's tool-call format, as its chat template writes calls back:
//!
//! ```text
//! <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{deg:<|"|>C<|"|>}}<tool_call|>
//! ```
//!
//! One call per `<|tool_call>` … `<tool_call|>` block; several blocks may
//! follow one another. Inside, `call:NAME` and the arguments in the
//! template's own notation: keys unquoted, strings between two `<|"|>`
//! markers (no escapes inside), objects `{k:v,..}`, arrays `[v,..]`,
//! numbers and `true`/`false`/`null` bare. The three markers are special
//! tokens of Gemma 4's tokenizer; they reach the parser as text either way
//! ([`super::ToolCallFormat::special_markers`]).
//!
//! **JSON.** The arguments are rewritten as JSON as they come: keys quoted,
//! a `<|"|>` string becomes a JSON string with its quotes, backslashes and
//! control characters escaped, so braces, colons, commas, quotes or
//! `call:` inside a string are text of the string. A bare value that is
//! not JSON is kept as a string (`True`, `False` and `None` are read as
//! Python writes them); a key may also be a `<|"|>` string or a JSON
//! string, a value a JSON string. `call:NAME{{..}}`, a JSON object inside
//! the braces (what the template writes back for arguments given as a JSON
//! string, which models then copy), is read as that object.
//!
//! **Streaming.** The call is committed when `<|tool_call>call:NAME{` has
//! been read and `NAME` is an offered function: [`OutputPiece::CallStart`]
//! goes out, then the arguments as [`OutputPiece::CallArguments`]
//! fragments (a string's text as it comes, held back only where it may be
//! the start of its closing marker; a bare value when it ends). A block
//! that does not open that way is text, unchanged. Once committed, text
//! that breaks the notation closes the open strings, arrays and objects,
//! and is read again as text. A reply cut inside a call leaves its
//! arguments as far as they came. Whitespace between calls is dropped.
//!
//! **Forced.** Under a forced `tool_choice` the prompt ends with
//! [`gemma4_forced_call_prefix`] and the grammar
//! ([`crate::constraint::Grammar::Gemma4Calls`]) writes the rest of the
//! call in this notation; the forced parser is seeded with the prefix, so
//! the call is read from it and the generated text as any other, and no
//! text outside calls is sent.

use super::{emit_outside_text, new_call_id, release_outside, ToolCallParser};
use crate::output::stop::partial_suffix;
use crate::output::tool_calls::hermes::JsonScan;
use crate::output::{Filtered, OutputPiece};

/// Opens a Gemma 4 call (a special token).
pub const GEMMA4_CALL_OPEN: &str = "<|tool_call>";
/// Closes a Gemma 4 call (a special token).
pub const GEMMA4_CALL_CLOSE: &str = "<tool_call|>";
/// Opens and closes a string in Gemma 4's notation (a special token).
pub const GEMMA4_QUOTE: &str = "<|\"|>";
/// Starts a call's body: `call:NAME{`.
const CALL_PREFIX: &str = "call:";

/// The start of a forced reply in this format, put after the prompt's
/// generation prompt: `<|tool_call>call:NAME{` for a call to `name`
/// (`tool_choice` naming a function: the model then writes the arguments'
/// members, `}` and `<tool_call|>`), or `<|tool_call>call:` for a call to
/// any function (`tool_choice: "required"`: the model writes the name on,
/// [`crate::constraint::Grammar::Gemma4Calls`]). The tokenizer reads the
/// marker in the prompt as its special token. [`Gemma4Parser`]'s forced
/// mode (`ToolCallParser::forced`) reads the call from this prefix and the
/// generated text.
pub fn gemma4_forced_call_prefix(name: Option<&str>) -> String {
    match name {
        Some(name) => format!("{GEMMA4_CALL_OPEN}{CALL_PREFIX}{name}{{"),
        None => format!("{GEMMA4_CALL_OPEN}{CALL_PREFIX}"),
    }
}

/// An open array or object of the arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Frame {
    object: bool,
    /// Members (or elements) sent so far.
    members: usize,
}

/// What the arguments' reader expects next.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// A key (in an object) or a value (in an array), or the container's end.
    Member,
    /// A value, after `key:`.
    Value,
    /// Inside a `<|"|>` string value: its text streams.
    Text,
    /// After a value: `,` or the container's end.
    Next,
}

/// Where the parser is.
#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Outside any call.
    Outside,
    /// After `<|tool_call>`, before `call:NAME{` is read: held.
    Open,
    /// Committed; the arguments are being rewritten as JSON.
    Arguments { frames: Vec<Frame>, expect: Expect },
    /// The arguments ended; `<tool_call|>` may follow.
    AfterCall,
}

/// What one move of the arguments' reader did.
enum Move {
    /// Read something; go on.
    Go,
    /// Needs more text.
    Wait,
    /// The notation broke here: close what is open, read the rest as text.
    Broken,
}

/// The Gemma 4 tool-call parser; see the module docs.
#[derive(Debug)]
pub struct Gemma4Parser {
    tool_names: Vec<String>,
    /// Under a forced `tool_choice`: text outside calls is never sent.
    forced: bool,
    /// Text read but not decided yet.
    held: String,
    state: State,
    calls: usize,
    /// After `call:NAME{{..}`: the outer `}` is still to come (dropped).
    owed_brace: bool,
}

impl ToolCallParser for Gemma4Parser {
    fn new(tool_names: &[String]) -> Self {
        Self {
            tool_names: tool_names.to_vec(),
            forced: false,
            held: String::new(),
            state: State::Outside,
            calls: 0,
            owed_brace: false,
        }
    }

    /// `prefix`: the start of the call in the prompt (`<|tool_call>call:`
    /// and perhaps a name and `{`).
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

impl Gemma4Parser {
    /// Runs `text` through the parser; `last` decides whatever is held.
    fn parse(&mut self, text: &str, last: bool) -> Filtered {
        let mut out = Filtered::default();
        self.held.push_str(text);
        while self.step(&mut out, last) {}
        if last {
            self.end(&mut out);
        }
        out
    }

    /// One move over `held`; false when it needs more text.
    fn step(&mut self, out: &mut Filtered, last: bool) -> bool {
        match std::mem::replace(&mut self.state, State::Outside) {
            State::Outside => {
                let seen = (self.forced, self.calls);
                if release_outside(&mut self.held, GEMMA4_CALL_OPEN, out, seen, last) {
                    self.state = State::Open;
                    return true;
                }
                false
            }
            State::Open => match read_head(&self.held) {
                Head::Incomplete if !last => {
                    self.state = State::Open;
                    false
                }
                Head::Call { name, end } if self.tool_names.contains(&name) => {
                    self.calls += 1;
                    out.push(OutputPiece::CallStart {
                        id: new_call_id(),
                        name,
                    });
                    out.arguments("{");
                    self.held.drain(..end);
                    self.state = State::Arguments {
                        frames: vec![Frame {
                            object: true,
                            members: 0,
                        }],
                        expect: Expect::Member,
                    };
                    true
                }
                // Not a call: the marker is text, and what follows is read
                // again outside.
                Head::Incomplete | Head::Call { .. } | Head::Other => {
                    self.emit_text(out, GEMMA4_CALL_OPEN);
                    true
                }
            },
            State::Arguments {
                mut frames,
                mut expect,
            } => match self.read_arguments(out, &mut frames, &mut expect, last) {
                Move::Go if frames.is_empty() => {
                    self.state = State::AfterCall;
                    true
                }
                Move::Go => {
                    self.state = State::Arguments { frames, expect };
                    true
                }
                Move::Wait => {
                    self.state = State::Arguments { frames, expect };
                    false
                }
                Move::Broken => {
                    close_all(out, &frames, expect);
                    true
                }
            },
            State::AfterCall => {
                let ws = self.held.len() - self.held.trim_start().len();
                self.held.drain(..ws);
                if self.owed_brace && self.held.starts_with('}') {
                    self.held.drain(..1);
                    self.owed_brace = false;
                    self.state = State::AfterCall;
                    return true;
                }
                if self.held.starts_with(GEMMA4_CALL_CLOSE) {
                    self.held.drain(..GEMMA4_CALL_CLOSE.len());
                    self.owed_brace = false;
                    return true;
                }
                if GEMMA4_CALL_CLOSE.starts_with(self.held.as_str()) {
                    if !last {
                        self.state = State::AfterCall;
                        return false;
                    }
                    // A partial closing marker at the end is wrapper.
                    self.held.clear();
                }
                // No closing marker: what follows is read outside.
                self.owed_brace = false;
                true
            }
        }
    }

    /// One move of the arguments' reader over `held`, sending JSON.
    fn read_arguments(
        &mut self,
        out: &mut Filtered,
        frames: &mut Vec<Frame>,
        expect: &mut Expect,
        last: bool,
    ) -> Move {
        if *expect == Expect::Text {
            return self.read_text(out, expect, last);
        }
        let ws = self.held.len() - self.held.trim_start().len();
        self.held.drain(..ws);
        let Some(top) = frames.last().copied() else {
            return Move::Broken;
        };
        if self.held.starts_with(GEMMA4_CALL_CLOSE) {
            // The call's end before its arguments closed: close them.
            close_all(out, frames, *expect);
            frames.clear();
            return Move::Go;
        }
        let Some(first) = self.held.chars().next() else {
            // Empty: wait, or at the end leave the arguments as they came.
            return Move::Wait;
        };
        if first == '<' && GEMMA4_CALL_CLOSE.starts_with(self.held.as_str()) {
            // Wait; at the end, a partial marker is dropped with the call.
            return Move::Wait;
        }
        match *expect {
            Expect::Next => match first {
                ',' => {
                    self.held.drain(..1);
                    *expect = Expect::Member;
                    Move::Go
                }
                '}' | ']' => close_one(out, frames, expect, first, &mut self.held),
                _ => Move::Broken,
            },
            Expect::Member if first == '{' && frames.len() == 1 && top.members == 0 => {
                self.read_doubled(out, frames, last)
            }
            Expect::Member if matches!(first, '}' | ']') => {
                // An empty container, or a trailing comma.
                close_one(out, frames, expect, first, &mut self.held)
            }
            Expect::Member if top.object => {
                let (key, end) = match read_key(&self.held) {
                    Key::Found { key, end } => (key, end),
                    // At the end, a partial key is dropped with the call.
                    Key::Incomplete => return Move::Wait,
                    Key::Other => return Move::Broken,
                };
                self.held.drain(..end);
                separate(out, frames);
                out.arguments(&serde_json::Value::from(key).to_string());
                out.arguments(": ");
                *expect = Expect::Value;
                Move::Go
            }
            Expect::Member => {
                separate(out, frames);
                *expect = Expect::Value;
                Move::Go
            }
            Expect::Value => self.read_value(out, frames, expect, last),
            Expect::Text => Move::Broken,
        }
    }

    /// `call:NAME{{..}}`: the arguments as a JSON object inside the braces
    /// (what the template writes back for arguments given as a JSON
    /// string, and models then imitate). Sent when the object ends; the
    /// outer `}` is dropped after it.
    fn read_doubled(&mut self, out: &mut Filtered, frames: &mut Vec<Frame>, last: bool) -> Move {
        let Some(end) = JsonScan::default().feed(&self.held) else {
            if last {
                // Cut inside the object: as far as it came.
                let held = std::mem::take(&mut self.held);
                out.arguments(held.get(1..).unwrap_or_default());
            }
            return Move::Wait;
        };
        if !serde_json::from_str::<serde_json::Value>(&self.held[..end])
            .is_ok_and(|v| v.is_object())
        {
            return Move::Broken;
        }
        let object: String = self.held.drain(..end).collect();
        // The object's own `{` is the one already sent.
        out.arguments(object.get(1..).unwrap_or_default());
        frames.clear();
        self.owed_brace = true;
        Move::Go
    }

    /// A value starts at `held` (whitespace skipped).
    fn read_value(
        &mut self,
        out: &mut Filtered,
        frames: &mut Vec<Frame>,
        expect: &mut Expect,
        last: bool,
    ) -> Move {
        if self.held.starts_with(GEMMA4_QUOTE) {
            self.held.drain(..GEMMA4_QUOTE.len());
            out.arguments("\"");
            *expect = Expect::Text;
            return Move::Go;
        }
        if GEMMA4_QUOTE.starts_with(self.held.as_str()) {
            // Wait; at the end, a partial marker is dropped with the call.
            return Move::Wait;
        }
        let first = self.held.chars().next();
        match first {
            Some(open @ ('{' | '[')) => {
                self.held.drain(..1);
                out.arguments(&open.to_string());
                frames.push(Frame {
                    object: open == '{',
                    members: 0,
                });
                *expect = Expect::Member;
                Move::Go
            }
            Some('"') => {
                // A JSON string, as some replies write one: sent when it
                // ends, if it is one.
                let Some(end) = JsonScan::default().feed(&self.held) else {
                    if last {
                        // Cut inside the string: as far as it came.
                        out.arguments(&std::mem::take(&mut self.held));
                    }
                    return Move::Wait;
                };
                if serde_json::from_str::<String>(&self.held[..end]).is_err() {
                    return Move::Broken;
                }
                let string: String = self.held.drain(..end).collect();
                out.arguments(&string);
                value_done(frames, expect);
                Move::Go
            }
            _ => {
                let end = self.held.find([',', '}', ']', '<', '\n']);
                let Some(end) = end.or(last.then_some(self.held.len())) else {
                    return Move::Wait;
                };
                let raw = self.held[..end].trim();
                if raw.is_empty() {
                    return Move::Broken;
                }
                out.arguments(&bare_value(raw));
                self.held.drain(..end);
                value_done(frames, expect);
                Move::Go
            }
        }
    }

    /// Inside a `<|"|>` string: its text goes out escaped, up to its
    /// closing marker.
    fn read_text(&mut self, out: &mut Filtered, expect: &mut Expect, last: bool) -> Move {
        if let Some(at) = self.held.find(GEMMA4_QUOTE) {
            let text: String = self.held.drain(..at).collect();
            out.arguments(&escape(&text));
            out.arguments("\"");
            self.held.drain(..GEMMA4_QUOTE.len());
            *expect = Expect::Next;
            // `frames` is unchanged: a string is a value of the top frame.
            return Move::Go;
        }
        let keep = if last {
            0
        } else {
            partial_suffix(&self.held, GEMMA4_QUOTE)
        };
        let text: String = self.held.drain(..self.held.len() - keep).collect();
        out.arguments(&escape(&text));
        Move::Wait
    }

    /// The choice ended: whatever is held goes out as what it was.
    fn end(&mut self, out: &mut Filtered) {
        match std::mem::replace(&mut self.state, State::Outside) {
            State::Outside | State::AfterCall | State::Arguments { .. } => {}
            State::Open => {
                // Never reached with `last` (the step decides it); kept total.
                self.emit_text(out, GEMMA4_CALL_OPEN);
                let held = std::mem::take(&mut self.held);
                self.emit_text(out, &held);
            }
        }
        self.held.clear();
        self.owed_brace = false;
    }

    /// Sends text outside any call: never under a forced choice, and not
    /// whitespace after a call.
    fn emit_text(&self, out: &mut Filtered, text: &str) {
        emit_outside_text(out, text, self.forced, self.calls);
    }
}

/// What the text after `<|tool_call>` says so far.
#[derive(Debug, PartialEq)]
enum Head {
    Incomplete,
    /// `call:NAME{`, ending at byte `end`.
    Call {
        name: String,
        end: usize,
    },
    Other,
}

/// Reads `call:NAME{` (after whitespace) at the start of `held`.
fn read_head(held: &str) -> Head {
    let body = held.trim_start();
    let skipped = held.len() - body.len();
    let Some(rest) = body.strip_prefix(CALL_PREFIX) else {
        return if CALL_PREFIX.starts_with(body) {
            Head::Incomplete
        } else {
            Head::Other
        };
    };
    let name_len = rest.find(|c: char| !is_name_char(c)).unwrap_or(rest.len());
    match rest[name_len..].chars().next() {
        None => Head::Incomplete,
        Some('{') if name_len > 0 => Head::Call {
            name: rest[..name_len].to_owned(),
            end: skipped + CALL_PREFIX.len() + name_len + 1,
        },
        Some(_) => Head::Other,
    }
}

/// A character of a function's name.
fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

/// What `held` says about an object's key.
enum Key {
    Incomplete,
    /// The key, and the byte just past its `:`.
    Found {
        key: String,
        end: usize,
    },
    Other,
}

/// Reads `key:` or `<|"|>key<|"|>:` at the start of `held`.
fn read_key(held: &str) -> Key {
    if let Some(rest) = held.strip_prefix(GEMMA4_QUOTE) {
        let Some(close) = rest.find(GEMMA4_QUOTE) else {
            return Key::Incomplete;
        };
        let after = &rest[close + GEMMA4_QUOTE.len()..];
        let colon = after.trim_start();
        return match colon.chars().next() {
            None => Key::Incomplete,
            Some(':') => Key::Found {
                key: rest[..close].to_owned(),
                end: held.len() - colon.len() + 1,
            },
            Some(_) => Key::Other,
        };
    }
    if GEMMA4_QUOTE.starts_with(held) {
        return Key::Incomplete;
    }
    match held.find([':', ',', '{', '}', '[', ']', '<', '\n']) {
        Some(at) if held[at..].starts_with(':') && !held[..at].trim().is_empty() => {
            let key = held[..at].trim();
            // A JSON-quoted key, as some replies write one, is unquoted.
            let key = match key.starts_with('"') {
                true => serde_json::from_str::<String>(key).unwrap_or_else(|_| key.to_owned()),
                false => key.to_owned(),
            };
            Key::Found { key, end: at + 1 }
        }
        Some(_) => Key::Other,
        None => Key::Incomplete,
    }
}

/// A bare value as JSON: numbers, `true`, `false` and `null` as they are,
/// Python's spellings of the last three read as them, anything else a
/// string.
fn bare_value(raw: &str) -> String {
    match raw {
        "True" => return "true".into(),
        "False" => return "false".into(),
        "None" => return "null".into(),
        _ => {}
    }
    match serde_json::from_str::<serde_json::Value>(raw) {
        Ok(v) if !v.is_object() && !v.is_array() && !v.is_string() => raw.to_owned(),
        _ => serde_json::Value::from(raw).to_string(),
    }
}

/// `, ` before a container's second and later members.
fn separate(out: &mut Filtered, frames: &mut [Frame]) {
    if let Some(top) = frames.last_mut() {
        if top.members > 0 {
            out.arguments(", ");
        }
        top.members += 1;
    }
}

/// A value ended in the top frame.
fn value_done(frames: &[Frame], expect: &mut Expect) {
    *expect = if frames.is_empty() {
        Expect::Member
    } else {
        Expect::Next
    };
}

/// Closes the top frame at `close` (`}` or `]`), which must match it.
fn close_one(
    out: &mut Filtered,
    frames: &mut Vec<Frame>,
    expect: &mut Expect,
    close: char,
    held: &mut String,
) -> Move {
    match frames.last() {
        Some(top) if top.object == (close == '}') => {
            held.drain(..1);
            out.arguments(&close.to_string());
            frames.pop();
            *expect = Expect::Next;
            Move::Go
        }
        _ => Move::Broken,
    }
}

/// The notation broke: the open string and every open container are closed.
fn close_all(out: &mut Filtered, frames: &[Frame], expect: Expect) {
    if expect == Expect::Text {
        out.arguments("\"");
    } else if expect == Expect::Value {
        // After `"key": `: a value is owed.
        out.arguments("null");
    }
    for frame in frames.iter().rev() {
        out.arguments(if frame.object { "}" } else { "]" });
    }
}

/// `text` as the inside of a JSON string (no quotes).
fn escape(text: &str) -> String {
    let quoted = serde_json::Value::from(text).to_string();
    quoted[1..quoted.len() - 1].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_read_incrementally() {
        let full = " call:get_weather{";
        for end in 0..full.len() {
            assert_eq!(read_head(&full[..end]), Head::Incomplete, "{end}");
        }
        assert_eq!(
            read_head(full),
            Head::Call {
                name: "get_weather".into(),
                end: full.len()
            }
        );
        for other in ["x", "call:{", "call:a b{", "cal{", "call:a(x)"] {
            assert_eq!(read_head(other), Head::Other, "{other}");
        }
    }

    #[test]
    fn bare_values_become_json() {
        assert_eq!(bare_value("3"), "3");
        assert_eq!(bare_value("-1.5e3"), "-1.5e3");
        assert_eq!(bare_value("true"), "true");
        assert_eq!(bare_value("None"), "null");
        assert_eq!(bare_value("Paris"), "\"Paris\"");
        assert_eq!(bare_value("\"x\""), "\"\\\"x\\\"\"");
    }
}
