//! What a choice's text becomes on its stream: stop strings and tool calls.
//!
//! The detokenizer turns tokens into text; [`OutputFilter`] decides which of
//! that text the client sees and when:
//!
//! - **Stop strings.** Text that might be the start of a stop string is held
//!   back until the next text decides it; the first complete stop string
//!   ends the choice, and neither it nor anything after it is sent (OpenAI's
//!   `stop`). The search runs over everything not yet sent, so a stop string
//!   split across any number of tokens is found.
//! - **Tool calls** (Hermes / Qwen2.5 format:
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`). From
//!   the opening tag on, text is held; at the closing tag its JSON becomes a
//!   [`ToolCall`] and none of it is sent as text. A call whose JSON does not
//!   parse is sent as text, unchanged. Whitespace between calls is dropped.

use crate::api::ToolCall;

/// Opening tag of a Hermes-style tool call.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// Closing tag of a Hermes-style tool call.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// What one push of text produced.
#[derive(Debug, Default, PartialEq)]
pub struct Filtered {
    /// Text to send now.
    pub text: String,
    /// Tool calls completed by this text, in order.
    pub tool_calls: Vec<ToolCall>,
    /// A stop string appeared: the choice ends here.
    pub stopped: bool,
}

/// Per-choice output filter; see the module docs.
#[derive(Debug)]
pub struct OutputFilter {
    stop: Vec<String>,
    /// Functions whose calls are parsed out of the text (empty: no parsing).
    tool_names: Vec<String>,
    /// Text not yet past the stop-string check.
    pending: String,
    /// Text past the stop check but held by the tool-call parser.
    held: String,
    in_call: bool,
    calls: usize,
    stopped: bool,
}

impl OutputFilter {
    /// A filter ending at any of `stop` (empty strings are ignored) and
    /// extracting calls of the functions named in `tool_names` (a call of
    /// any other name stays text: it is not a call the client can answer).
    pub fn new(stop: &[String], tool_names: &[String]) -> Self {
        Self {
            stop: stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
            tool_names: tool_names.to_vec(),
            pending: String::new(),
            held: String::new(),
            in_call: false,
            calls: 0,
            stopped: false,
        }
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
        let rest = std::mem::take(&mut self.pending);
        self.parse(&rest, true)
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
            out.text = released.to_owned();
            return out;
        }
        self.held.push_str(released);
        loop {
            if self.in_call {
                let Some(end) = self.held.find(TOOL_CALL_CLOSE) else {
                    break;
                };
                let body = self.held[..end].to_owned();
                self.held.drain(..end + TOOL_CALL_CLOSE.len());
                self.close_call(&mut out, &body, true);
            } else if let Some(start) = self.held.find(TOOL_CALL_OPEN) {
                let before: String = self.held.drain(..start).collect();
                self.emit_text(&mut out, &before);
                self.held.drain(..TOOL_CALL_OPEN.len());
                self.in_call = true;
            } else {
                let keep = if last {
                    0
                } else {
                    partial_suffix(&self.held, TOOL_CALL_OPEN)
                };
                let cut = self.held.len() - keep;
                // Whitespace after a call waits: it is dropped unless text
                // follows.
                if self.calls > 0 && !last && self.held[..cut].trim().is_empty() {
                    break;
                }
                let text: String = self.held.drain(..cut).collect();
                self.emit_text(&mut out, &text);
                break;
            }
        }
        if last && self.in_call {
            // The choice ended inside a call (no closing tag): its JSON may
            // still be complete.
            let body = std::mem::take(&mut self.held);
            self.close_call(&mut out, &body, false);
        }
        out
    }

    /// Ends the call whose JSON is `body` (`closed`: by its closing tag):
    /// a [`ToolCall`] when it parses and names a known function, else its
    /// text, unchanged.
    fn close_call(&mut self, out: &mut Filtered, body: &str, closed: bool) {
        self.in_call = false;
        let known = parse_tool_call(body).filter(|c| self.tool_names.contains(&c.name));
        match known {
            Some(call) => {
                self.calls += 1;
                out.tool_calls.push(call);
            }
            None => {
                out.text.push_str(TOOL_CALL_OPEN);
                out.text.push_str(body);
                if closed {
                    out.text.push_str(TOOL_CALL_CLOSE);
                }
            }
        }
    }

    fn emit_text(&self, out: &mut Filtered, text: &str) {
        if self.calls > 0 && text.trim().is_empty() {
            return;
        }
        out.text.push_str(text);
    }
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

    /// Feeds `pieces` one by one, then finishes; (text, calls, stopped).
    fn run(filter: &mut OutputFilter, pieces: &[&str]) -> (String, Vec<ToolCall>, bool) {
        let mut text = String::new();
        let mut calls = Vec::new();
        let mut stopped = false;
        for p in pieces {
            let f = filter.push(p);
            text += &f.text;
            calls.extend(f.tool_calls);
            if f.stopped {
                stopped = true;
                break;
            }
        }
        if !stopped {
            let f = filter.finish();
            text += &f.text;
            calls.extend(f.tool_calls);
        }
        (text, calls, stopped)
    }

    #[test]
    fn a_stop_string_split_across_pieces_ends_the_text_before_it() {
        let mut f = OutputFilter::new(&["END".into()], &[]);
        assert_eq!(f.push("Hello E").text, "Hello ");
        assert_eq!(f.push("N").text, "");
        let last = f.push("D and more");
        assert_eq!(last.text, "");
        assert!(last.stopped);
        assert_eq!(f.push("ignored"), Filtered::default());
    }

    #[test]
    fn held_text_that_turns_out_not_to_stop_is_sent() {
        let mut f = OutputFilter::new(&["\n\n".into(), "###".into()], &[]);
        assert_eq!(f.push("a\n").text, "a");
        assert_eq!(f.push("b#").text, "\nb");
        assert_eq!(f.push("#x").text, "##x");
        assert_eq!(f.finish().text, "");
        let (text, _, stopped) = run(&mut OutputFilter::new(&["##".into()], &[]), &["1#", "2#"]);
        assert_eq!((text.as_str(), stopped), ("1#2#", false));
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let stops = ["world".to_string(), "lo w".to_string()];
        let (text, _, stopped) = run(&mut OutputFilter::new(&stops, &[]), &["hello world"]);
        assert_eq!((text.as_str(), stopped), ("hel", true));
    }

    #[test]
    fn multibyte_text_is_cut_on_character_boundaries() {
        let mut f = OutputFilter::new(&["éa".into()], &[]);
        assert_eq!(f.push("xyé").text, "xy");
        assert_eq!(f.push("b").text, "éb");
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
        let (text, calls, _) = run(&mut f, &pieces);
        assert_eq!(text, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(calls[1].name, "now");
        assert_eq!(calls[1].arguments, "{}");
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 29);
        assert_ne!(calls[0].id, calls[1].id);
    }

    #[test]
    fn a_call_without_a_closing_tag_is_parsed_at_the_end() {
        let (text, calls, _) = run(
            &mut OutputFilter::new(&[], &tools(&["get_weather", "now", "f"])),
            &["<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}"],
        );
        assert_eq!(text, "");
        assert_eq!(calls[0].arguments, "{\"a\": 1}");
    }

    #[test]
    fn malformed_calls_and_lookalike_text_stay_text() {
        let (text, calls, _) = run(
            &mut OutputFilter::new(&[], &tools(&["get_weather", "now", "f"])),
            &["a <tool", "_cal", "l>not json</tool_call> b <to"],
        );
        assert!(calls.is_empty());
        assert_eq!(text, "a <tool_call>not json</tool_call> b <to");
    }

    fn tools(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn calls_of_functions_not_offered_stay_text() {
        let call = "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>";
        let (text, calls, _) = run(&mut OutputFilter::new(&[], &tools(&["now"])), &[call]);
        assert!(calls.is_empty());
        assert_eq!(text, call);
        let (text, calls, _) = run(
            &mut OutputFilter::new(&[], &tools(&["now", "rm_rf"])),
            &[call],
        );
        assert_eq!((text.as_str(), calls.len()), ("", 1));
    }

    #[test]
    fn without_tool_parsing_tags_are_plain_text() {
        let (text, calls, _) = run(
            &mut OutputFilter::new(&[], &[]),
            &["<tool_call>{\"name\": \"f\"}</tool_call>"],
        );
        assert!(calls.is_empty());
        assert_eq!(text, "<tool_call>{\"name\": \"f\"}</tool_call>");
    }
}
