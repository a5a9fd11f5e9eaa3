//! Qwen3-Coder's XML tool-call format, as its chat template teaches it:
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! <parameter=days>
//! 3
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Several calls may follow one another. A call's arguments become one
//! JSON object, `{"city": "Paris", "days": 3}`: a parameter's value is a
//! JSON string, unless the offered tool's JSON schema gives the parameter
//! a non-string `type` (`number`, `integer`, `boolean`, `object`, `array`,
//! `null`, or a list of types without `string`); then the value's text is
//! read as JSON, and kept as a string when it is not JSON (what users of
//! Qwen3-Coder get from vLLM's parser). One newline at the start and one
//! at the end of a value are trimmed (the template writes them).
//!
//! **Where a value ends.** A value may contain the format's own markup
//! (code that writes `<parameter=x>` or `</function>`): it ends only at a
//! `</parameter>` that is followed, after optional whitespace, by
//! `<parameter=` or `</function>` (or by the end of the reply). Any other
//! `</parameter>` is text of the value. The one value this cannot carry is
//! text with `</parameter>` directly followed by `<parameter=` or
//! `</function>`.
//!
//! **Streaming.** The call is committed when `<tool_call>` and
//! `<function=NAME>` have been read and `NAME` is an offered function:
//! [`OutputPiece::CallStart`] goes out, then the arguments object as
//! [`OutputPiece::CallArguments`] fragments. A string value streams as
//! escaped JSON string text, as generated (held back only where it may be
//! its end); a typed value is sent when it ends. A `<tool_call>` that is
//! not followed by `<function=` and an offered name is sent as text,
//! unchanged. Once committed, anything between parameters other than the
//! next `<parameter=` or `</function>` closes the arguments object, and the
//! rest is text. A reply cut inside a call leaves its arguments as far as
//! they came. Whitespace between calls is dropped.

use mlxcel_engine_api::ToolDefinition;

use super::{emit_outside_text, new_call_id, release_outside, ToolCallParser};
use crate::output::stop::partial_suffix;
use crate::output::{Filtered, OutputPiece};

/// Opening tag of a Qwen3-Coder call (the same as Hermes').
pub const XML_CALL_OPEN: &str = "<tool_call>";
/// Closing tag of a Qwen3-Coder call.
pub const XML_CALL_CLOSE: &str = "</tool_call>";
/// Opens a function: `<function=NAME>`.
pub const FUNCTION_OPEN: &str = "<function=";
/// Closes a function.
pub const FUNCTION_CLOSE: &str = "</function>";
/// Opens a parameter: `<parameter=NAME>`.
pub const PARAMETER_OPEN: &str = "<parameter=";
/// Closes a parameter (see the module docs for when it ends a value).
pub const PARAMETER_CLOSE: &str = "</parameter>";

/// The start of a forced reply in this format, put after the prompt's
/// generation prompt: `<tool_call>\n<function=NAME>\n` for a call to
/// `name` (`tool_choice` naming a function: the model then writes the
/// parameters), or `<tool_call>\n<function=` for a call to any function
/// (`tool_choice: "required"`: the model writes the name on).
pub fn xml_forced_call_prefix(name: Option<&str>) -> String {
    match name {
        Some(name) => format!("{XML_CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n"),
        None => format!("{XML_CALL_OPEN}\n{FUNCTION_OPEN}"),
    }
}

/// An offered function: its name and the parameters whose values are read
/// as JSON rather than as strings.
#[derive(Debug, Clone)]
struct Function {
    name: String,
    typed: Vec<String>,
}

/// Whether a parameter's JSON schema gives it a type other than string:
/// `"type": "integer"` or `["integer", "null"]` is typed, `"string"`,
/// `["string", "null"]` or no `type` at all is a string.
pub(crate) fn typed_schema(schema: &serde_json::Value) -> bool {
    const TYPED: [&str; 6] = ["number", "integer", "boolean", "object", "array", "null"];
    match schema.get("type") {
        Some(serde_json::Value::String(t)) => TYPED.contains(&t.as_str()),
        Some(serde_json::Value::Array(ts)) => {
            let ts: Vec<&str> = ts.iter().filter_map(|t| t.as_str()).collect();
            !ts.is_empty() && !ts.contains(&"string") && ts.iter().all(|t| TYPED.contains(t))
        }
        _ => false,
    }
}

/// Where the parser is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Outside any call.
    Outside,
    /// After `<tool_call>`, before the function's name is known: held.
    Open,
    /// Committed; before a parameter or the function's end. `params`:
    /// parameters sent so far.
    Between { params: usize },
    /// Committed; inside a value (`typed`: held whole and read as JSON;
    /// `fresh`: its leading newline not yet decided).
    Value {
        params: usize,
        typed: bool,
        fresh: bool,
    },
    /// After `</function>`, before `</tool_call>`.
    AfterFunction,
}

/// The Qwen3-Coder XML tool-call parser; see the module docs.
#[derive(Debug)]
pub struct Qwen3CoderParser {
    functions: Vec<Function>,
    /// Under a forced `tool_choice`: text outside calls is never sent.
    forced: bool,
    /// Text read but not decided yet.
    held: String,
    state: State,
    /// The function of the open call.
    function: usize,
    calls: usize,
}

impl ToolCallParser for Qwen3CoderParser {
    /// Every parameter's value is a string (no schemas).
    fn new(tool_names: &[String]) -> Self {
        Self::from_functions(
            tool_names
                .iter()
                .map(|name| Function {
                    name: name.clone(),
                    typed: Vec::new(),
                })
                .collect(),
        )
    }

    /// `prefix` is from [`xml_forced_call_prefix`].
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

impl Qwen3CoderParser {
    /// A parser of calls to `tools`, whose parameter schemas say which
    /// values are read as JSON (see the module docs).
    pub fn with_tools(tools: &[ToolDefinition]) -> Self {
        Self::from_functions(
            tools
                .iter()
                .map(|tool| Function {
                    name: tool.name.clone(),
                    typed: tool
                        .parameters
                        .get("properties")
                        .and_then(|p| p.as_object())
                        .map(|properties| {
                            properties
                                .iter()
                                .filter(|(_, schema)| typed_schema(schema))
                                .map(|(name, _)| name.clone())
                                .collect()
                        })
                        .unwrap_or_default(),
                })
                .collect(),
        )
    }

    /// The parser of a forced reply to `tools` whose first text, `prefix`
    /// (from [`xml_forced_call_prefix`]), is in the prompt rather than
    /// generated: text outside calls is never sent.
    pub fn forced_with_tools(tools: &[ToolDefinition], prefix: &str) -> Self {
        let mut parser = Self::with_tools(tools);
        parser.forced = true;
        parser.held = prefix.to_owned();
        parser
    }

    fn from_functions(functions: Vec<Function>) -> Self {
        Self {
            functions,
            forced: false,
            held: String::new(),
            state: State::Outside,
            function: 0,
            calls: 0,
        }
    }

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
                if release_outside(&mut self.held, XML_CALL_OPEN, out, seen, last) {
                    self.state = State::Open;
                    return true;
                }
                false
            }
            State::Open => match self.read_function() {
                Tag::Incomplete if !last => false,
                Tag::Found { name, end } => {
                    match self.functions.iter().position(|f| f.name == name) {
                        Some(function) => {
                            self.function = function;
                            self.calls += 1;
                            out.push(OutputPiece::CallStart {
                                id: new_call_id(),
                                name,
                            });
                            self.held.drain(..end);
                            self.state = State::Between { params: 0 };
                            true
                        }
                        None => self.not_a_call(out),
                    }
                }
                Tag::Incomplete | Tag::Other => self.not_a_call(out),
            },
            State::Between { params } => {
                let ws = self.held.len() - self.held.trim_start().len();
                self.held.drain(..ws);
                if self.held.starts_with(PARAMETER_OPEN) {
                    let rest = &self.held[PARAMETER_OPEN.len()..];
                    let Some(close) = rest.find('>') else {
                        if last || rest.contains(['\n', '<']) {
                            return self.malformed(out, params);
                        }
                        return false;
                    };
                    let name = rest[..close].to_owned();
                    if name.contains(['\n', '<']) {
                        return self.malformed(out, params);
                    }
                    self.held.drain(..PARAMETER_OPEN.len() + close + 1);
                    let typed = self.functions[self.function].typed.contains(&name);
                    let key = serde_json::Value::from(name).to_string();
                    let lead = if params == 0 { "{" } else { ", " };
                    let quote = if typed { "" } else { "\"" };
                    out.arguments(&format!("{lead}{key}: {quote}"));
                    self.state = State::Value {
                        params: params + 1,
                        typed,
                        fresh: true,
                    };
                    return true;
                }
                if self.held.starts_with(FUNCTION_CLOSE) {
                    self.held.drain(..FUNCTION_CLOSE.len());
                    out.arguments(if params == 0 { "{}" } else { "}" });
                    self.state = State::AfterFunction;
                    return true;
                }
                if self.held.is_empty() && last {
                    // Cut between parameters: the arguments as they came.
                    self.state = State::Outside;
                    return false;
                }
                let undecided = PARAMETER_OPEN.starts_with(self.held.as_str())
                    || FUNCTION_CLOSE.starts_with(self.held.as_str());
                if undecided && !last {
                    return false;
                }
                self.malformed(out, params)
            }
            State::Value {
                params,
                typed,
                fresh,
            } => {
                if fresh {
                    if self.held.is_empty() {
                        return false;
                    }
                    if self.held.starts_with('\n') {
                        self.held.drain(..1);
                    }
                    self.state = State::Value {
                        params,
                        typed,
                        fresh: false,
                    };
                    return true;
                }
                match value_end(&self.held, last) {
                    ValueEnd::At { value, next } => {
                        let text = &self.held[..value];
                        let text = text.strip_suffix('\n').unwrap_or(text);
                        if typed {
                            out.arguments(&typed_value(text));
                        } else {
                            out.arguments(&escape(text));
                            out.arguments("\"");
                        }
                        self.held.drain(..next);
                        self.state = State::Between { params };
                        true
                    }
                    ValueEnd::Undecided { from } => {
                        if !typed {
                            let text: String = self.held.drain(..from).collect();
                            out.arguments(&escape(&text));
                        }
                        false
                    }
                }
            }
            State::AfterFunction => {
                let ws = self.held.len() - self.held.trim_start().len();
                self.held.drain(..ws);
                if self.held.starts_with(XML_CALL_CLOSE) {
                    self.held.drain(..XML_CALL_CLOSE.len());
                    self.state = State::Outside;
                    return true;
                }
                if XML_CALL_CLOSE.starts_with(self.held.as_str()) {
                    if !last {
                        return false;
                    }
                    // A partial closing tag at the end is wrapper.
                    self.held.clear();
                }
                // No closing tag: what follows is decided outside.
                self.state = State::Outside;
                true
            }
        }
    }

    /// Reads `<function=NAME>` (after whitespace) at the start of `held`.
    fn read_function(&self) -> Tag {
        let body = self.held.trim_start();
        let skipped = self.held.len() - body.len();
        if body.len() < FUNCTION_OPEN.len() {
            return if FUNCTION_OPEN.starts_with(body) {
                Tag::Incomplete
            } else {
                Tag::Other
            };
        }
        let Some(rest) = body.strip_prefix(FUNCTION_OPEN) else {
            return Tag::Other;
        };
        match rest.find('>') {
            Some(close) if rest[..close].contains(['\n', '<']) => Tag::Other,
            Some(close) => Tag::Found {
                name: rest[..close].to_owned(),
                end: skipped + FUNCTION_OPEN.len() + close + 1,
            },
            // A name does not hold a line break or markup.
            None if rest.contains(['\n', '<']) => Tag::Other,
            None => Tag::Incomplete,
        }
    }

    /// The `<tool_call>` just read does not open a call of an offered
    /// function: it is text, and so is what follows, read again outside.
    fn not_a_call(&mut self, out: &mut Filtered) -> bool {
        self.emit_text(out, XML_CALL_OPEN);
        self.state = State::Outside;
        true
    }

    /// Committed, and the markup broke: the arguments object is closed and
    /// what follows is read as outside text.
    fn malformed(&mut self, out: &mut Filtered, params: usize) -> bool {
        out.arguments(if params == 0 { "{}" } else { "}" });
        self.state = State::Outside;
        true
    }

    /// The choice ended: whatever is held goes out as what it was.
    fn end(&mut self, out: &mut Filtered) {
        match std::mem::replace(&mut self.state, State::Outside) {
            State::Outside | State::AfterFunction | State::Between { .. } => {}
            State::Open => {
                // Never reached with `last` (the step decides it); kept total.
                self.emit_text(out, XML_CALL_OPEN);
                let held = std::mem::take(&mut self.held);
                self.emit_text(out, &held);
            }
            State::Value { typed, .. } => {
                // Cut inside a value: its text as far as it came.
                let held = std::mem::take(&mut self.held);
                out.arguments(&if typed { held } else { escape(&held) });
            }
        }
        self.held.clear();
    }

    /// Sends text outside any call: never under a forced choice, and not
    /// whitespace after a call.
    fn emit_text(&self, out: &mut Filtered, text: &str) {
        emit_outside_text(out, text, self.forced, self.calls);
    }
}

/// What `held` says about a function tag.
enum Tag {
    Incomplete,
    Found { name: String, end: usize },
    Other,
}

/// Where a value in `held` ends.
#[derive(Debug, PartialEq)]
enum ValueEnd {
    /// The value is `held[..value]` (its trailing newline still on), and
    /// the text after its `</parameter>` starts at `next`.
    At { value: usize, next: usize },
    /// No end yet: `held[..from]` is value text for sure, the rest may
    /// still be (or end) the value.
    Undecided { from: usize },
}

/// Finds the end of a value in `held` (the module docs' rule); `last`: no
/// more text comes.
fn value_end(held: &str, last: bool) -> ValueEnd {
    let mut search = 0;
    while let Some(found) = held[search..].find(PARAMETER_CLOSE) {
        let at = search + found;
        let next = at + PARAMETER_CLOSE.len();
        let after = held[next..].trim_start();
        if after.starts_with(PARAMETER_OPEN)
            || after.starts_with(FUNCTION_CLOSE)
            || (last && after.is_empty())
        {
            return ValueEnd::At { value: at, next };
        }
        let undecided = PARAMETER_OPEN.starts_with(after) || FUNCTION_CLOSE.starts_with(after);
        if undecided && !last {
            return ValueEnd::Undecided {
                from: held_from(held, at),
            };
        }
        search = next;
    }
    if last {
        return ValueEnd::Undecided { from: held.len() };
    }
    let partial = partial_suffix(held, PARAMETER_CLOSE);
    ValueEnd::Undecided {
        from: held_from(held, held.len() - partial),
    }
}

/// `at` moved before the newline that precedes it (held: it may be the
/// value's trailing newline).
fn held_from(held: &str, at: usize) -> usize {
    if held[..at].ends_with('\n') {
        at - 1
    } else {
        at
    }
}

/// `text` as the inside of a JSON string (no quotes).
fn escape(text: &str) -> String {
    let quoted = serde_json::Value::from(text).to_string();
    quoted[1..quoted.len() - 1].to_owned()
}

/// A typed value: its text when it is JSON, else a JSON string of it.
fn typed_value(text: &str) -> String {
    let trimmed = text.trim();
    if serde_json::from_str::<serde_json::Value>(trimmed).is_ok() {
        trimmed.to_owned()
    } else {
        serde_json::Value::from(text).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_ends_follow_the_rule() {
        let end = |held: &str, last| value_end(held, last);
        assert_eq!(
            end("a\n</parameter>\n<parameter=", false),
            ValueEnd::At { value: 2, next: 14 }
        );
        assert_eq!(
            end("a\n</parameter>\n</function>", false),
            ValueEnd::At { value: 2, next: 14 }
        );
        // Followed by something else: value text.
        assert_eq!(
            end("a</parameter> b", false),
            ValueEnd::Undecided { from: 15 }
        );
        // Not decided yet: held from the newline before it.
        assert_eq!(
            end("a\n</parameter>\n", false),
            ValueEnd::Undecided { from: 1 }
        );
        assert_eq!(end("ab\n</para", false), ValueEnd::Undecided { from: 2 });
        assert_eq!(end("ab\n", false), ValueEnd::Undecided { from: 2 });
        assert_eq!(
            end("ab\n</parameter>\n", true),
            ValueEnd::At { value: 3, next: 15 }
        );
    }

    #[test]
    fn schema_types_decide_typed_values() {
        use serde_json::json;
        for (schema, typed) in [
            (json!({"type": "integer"}), true),
            (json!({"type": "object"}), true),
            (json!({"type": ["integer", "null"]}), true),
            (json!({"type": "string"}), false),
            (json!({"type": ["string", "null"]}), false),
            (json!({"enum": ["a", "b"]}), false),
        ] {
            assert_eq!(typed_schema(&schema), typed, "{schema}");
        }
        assert_eq!(typed_value("\n[1, 2]"), "[1, 2]");
        assert_eq!(typed_value("three"), "\"three\"");
    }
}
