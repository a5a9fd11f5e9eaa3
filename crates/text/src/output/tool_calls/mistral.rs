//! Mistral's v11 tool-call format (the tokenizers of Mistral Small 3.1 and
//! 3.2, Devstral, Magistral), as their chat templates write calls back:
//!
//! ```text
//! [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
//! ```
//!
//! Each call is `[TOOL_CALLS]`, the function's name, `[ARGS]` and the
//! arguments as a JSON object; some variants write `[CALL_ID]` and an id
//! between the name and `[ARGS]` (the id is dropped: the call gets a fresh
//! one, as every call mlxcel reads). The markers are special tokens of
//! these tokenizers; they reach the parser as text either way
//! ([`super::ToolCallFormat::special_markers`]). There is no closing
//! marker: the arguments end where their JSON object ends, so a
//! `[TOOL_CALLS]` or `[ARGS]` inside an argument string is text of the
//! string.
//!
//! **Streaming.** The call is committed when `[TOOL_CALLS]NAME[ARGS]{` has
//! been read and `NAME` is an offered function: [`OutputPiece::CallStart`]
//! goes out, then the arguments object as [`OutputPiece::CallArguments`]
//! fragments, exactly as generated. A `[TOOL_CALLS]` not followed that way
//! is text, unchanged, and so is what follows it. Text before the first
//! call is content; whitespace between calls is dropped. A reply cut inside
//! a call leaves its arguments as far as they came.

use super::{emit_outside_text, new_call_id, release_outside, ToolCallParser};
use crate::output::tool_calls::hermes::JsonScan;
use crate::output::{Filtered, OutputPiece};

/// Opens a Mistral v11 call (a special token).
pub const MISTRAL_TOOL_CALLS: &str = "[TOOL_CALLS]";
/// Ends a call's name (and id) before its arguments (a special token).
pub const MISTRAL_ARGS: &str = "[ARGS]";
/// Opens a call's id, in the variants that write one (a special token).
pub const MISTRAL_CALL_ID: &str = "[CALL_ID]";

/// The start of a forced reply in this format, put after the prompt's
/// generation prompt: `[TOOL_CALLS]NAME[ARGS]` for a call to `name`
/// (`tool_choice` naming a function: the model then writes the arguments
/// object), or `[TOOL_CALLS]` for a call to any function (`tool_choice:
/// "required"`: the model writes the name on,
/// [`crate::constraint::Grammar::MistralCalls`]). The tokenizer reads the
/// markers in the prompt as its special tokens.
pub fn mistral_forced_call_prefix(name: Option<&str>) -> String {
    match name {
        Some(name) => format!("{MISTRAL_TOOL_CALLS}{name}{MISTRAL_ARGS}"),
        None => MISTRAL_TOOL_CALLS.to_owned(),
    }
}

/// Where the parser is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Outside any call.
    Outside,
    /// After `[TOOL_CALLS]`, before `NAME[ARGS]{` is read: held.
    Head,
    /// Committed; the arguments object streams.
    Arguments(JsonScan),
}

/// The Mistral v11 tool-call parser; see the module docs.
#[derive(Debug)]
pub struct MistralParser {
    tool_names: Vec<String>,
    /// Under a forced `tool_choice`: text outside calls is never sent.
    forced: bool,
    /// Text read but not decided yet.
    held: String,
    state: State,
    calls: usize,
}

impl ToolCallParser for MistralParser {
    fn new(tool_names: &[String]) -> Self {
        Self {
            tool_names: tool_names.to_vec(),
            forced: false,
            held: String::new(),
            state: State::Outside,
            calls: 0,
        }
    }

    /// `prefix`: the start of the call in the prompt (`[TOOL_CALLS]` and
    /// perhaps a name and `[ARGS]`).
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

impl MistralParser {
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
        match self.state {
            State::Outside => {
                let seen = (self.forced, self.calls);
                if release_outside(&mut self.held, MISTRAL_TOOL_CALLS, out, seen, last) {
                    self.state = State::Head;
                    return true;
                }
                false
            }
            State::Head => match read_head(&self.held) {
                Head::Incomplete if !last => false,
                Head::Call { name, end } if self.tool_names.contains(&name) => {
                    self.calls += 1;
                    out.push(OutputPiece::CallStart {
                        id: new_call_id(),
                        name,
                    });
                    self.held.drain(..end);
                    self.state = State::Arguments(JsonScan::default());
                    true
                }
                // Not a call: the marker is text, and what follows is read
                // again outside.
                Head::Incomplete | Head::Call { .. } | Head::Other => {
                    self.emit_text(out, MISTRAL_TOOL_CALLS);
                    self.state = State::Outside;
                    true
                }
            },
            State::Arguments(mut scan) => match scan.feed(&self.held) {
                Some(end) => {
                    let arguments: String = self.held.drain(..end).collect();
                    out.arguments(&arguments);
                    self.state = State::Outside;
                    true
                }
                None => {
                    out.arguments(&std::mem::take(&mut self.held));
                    self.state = State::Arguments(scan);
                    false
                }
            },
        }
    }

    /// The choice ended: whatever is held goes out as what it was.
    fn end(&mut self, out: &mut Filtered) {
        if self.state == State::Head {
            // Never reached with `last` (the step decides it); kept total.
            self.emit_text(out, MISTRAL_TOOL_CALLS);
            let held = std::mem::take(&mut self.held);
            self.emit_text(out, &held);
        }
        self.state = State::Outside;
        self.held.clear();
    }

    /// Sends text outside any call: never under a forced choice, and not
    /// whitespace after a call.
    fn emit_text(&self, out: &mut Filtered, text: &str) {
        emit_outside_text(out, text, self.forced, self.calls);
    }
}

/// What the text after `[TOOL_CALLS]` says so far.
#[derive(Debug, PartialEq)]
enum Head {
    Incomplete,
    /// `NAME[ARGS]` (or `NAME[CALL_ID]ID[ARGS]`), the arguments' `{`
    /// at byte `end`.
    Call {
        name: String,
        end: usize,
    },
    Other,
}

/// Reads `NAME[ARGS]{` or `NAME[CALL_ID]ID[ARGS]{` (whitespace allowed
/// around the name, the id and before `{`) at the start of `held`.
fn read_head(held: &str) -> Head {
    let body = held.trim_start();
    let name_len = body.find(|c: char| !is_name_char(c)).unwrap_or(body.len());
    let name = &body[..name_len];
    let mut rest = body[name_len..].trim_start();
    if let Some(after) = rest.strip_prefix(MISTRAL_CALL_ID) {
        let after = after.trim_start();
        let id_len = after
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_' && c != '-')
            .unwrap_or(after.len());
        rest = after[id_len..].trim_start();
    } else if MISTRAL_CALL_ID.starts_with(rest) && MISTRAL_CALL_ID != rest && !rest.is_empty() {
        return Head::Incomplete;
    }
    let Some(args) = rest.strip_prefix(MISTRAL_ARGS) else {
        return if MISTRAL_ARGS.starts_with(rest) {
            Head::Incomplete
        } else {
            Head::Other
        };
    };
    let json = args.trim_start();
    match json.chars().next() {
        None => Head::Incomplete,
        Some('{') if !name.is_empty() => Head::Call {
            name: name.to_owned(),
            end: held.len() - json.len(),
        },
        Some(_) => Head::Other,
    }
}

/// A character of a function's name.
fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_read_incrementally() {
        for full in ["get_weather[ARGS]{", "f [CALL_ID]a1B2c3[ARGS] {"] {
            for end in 0..full.len() {
                assert_eq!(
                    read_head(&full[..end]),
                    Head::Incomplete,
                    "{:?}",
                    &full[..end]
                );
            }
            let Head::Call { end, .. } = read_head(full) else {
                panic!("{full}");
            };
            assert_eq!(end, full.len() - 1);
        }
        for other in [
            "get weather[ARGS]{",
            "f[ARGS]x",
            "f(x)",
            "f[CALL_ID]a b[ARGS]{",
        ] {
            assert_eq!(read_head(other), Head::Other, "{other}");
        }
    }
}
