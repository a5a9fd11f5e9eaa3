//! Splits a reasoning model's reply into its reasoning and its answer: the
//! text between `<think>` and `</think>` (Qwen3, QwQ, DeepSeek-R1 and the
//! models distilled from it), or Gemma 4's thought channel between
//! `<|channel>thought` and `<channel|>` (both markers special tokens of its
//! vocabulary; mlx_lm's `tokenizer_utils.py` reads the same pair), is
//! reasoning, the rest content ([`ReasoningMarkers`]). Clients read the
//! reasoning as `reasoning_content` beside `content`, as vLLM's and
//! llama-server's reasoning parsers return it.
//!
//! Rules (streaming: text arrives in arbitrary pieces, and a tag may be cut
//! anywhere), with `<think>`/`</think>` standing for either pair:
//! - A reply opens a reasoning block when its first non-blank text is
//!   `<think>`, or when the prompt already ended with `<think>` (templates
//!   that open the block for the model). Any other start is all content.
//! - The block ends at `</think>`; what follows is content.
//! - Blanks around each part are trimmed (the newlines models write after
//!   `<think>`, before `</think>` and after it).
//! - A reply that ends inside the block (cut by `max_tokens`) is all
//!   reasoning.

/// One part of the split text, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyPart {
    /// Reasoning, from inside the `<think>` block.
    Reasoning(String),
    /// The answer.
    Content(String),
}

/// The markers that open and close a reasoning block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasoningMarkers {
    /// Opens the block (`<think>`).
    pub open: &'static str,
    /// Closes it (`</think>`).
    pub close: &'static str,
    /// The special tokens among the markers' text: the detokenizer leaves
    /// special tokens out of a reply, so the output filter reads these as
    /// text ([`crate::output::OutputFilter::with_reasoning`]).
    pub special_tokens: &'static [&'static str],
}

impl ReasoningMarkers {
    /// `<think>` … `</think>` (Qwen3, QwQ, DeepSeek-R1), plain text in
    /// those vocabularies.
    pub const THINK: ReasoningMarkers = ReasoningMarkers {
        open: "<think>",
        close: "</think>",
        special_tokens: &[],
    };

    /// Gemma 4's thought channel: `<|channel>thought` … `<channel|>`,
    /// `<|channel>` and `<channel|>` special tokens.
    pub const GEMMA4_CHANNEL: ReasoningMarkers = ReasoningMarkers {
        open: "<|channel>thought",
        close: "<channel|>",
        special_tokens: &["<|channel>", "<channel|>"],
    };

    /// Whether `prompt`'s end opens a reasoning block (the opening marker
    /// then only blanks).
    pub fn prompt_opens_block(&self, prompt: &str) -> bool {
        prompt.trim_end().ends_with(self.open)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Nothing but blanks and a prefix of `<think>` yet (held).
    Start,
    /// Inside the block; `fresh` until its first non-blank character.
    Inside { fresh: bool },
    /// After `</think>`, before the content's first non-blank character.
    AfterBlock,
    /// Content: passed through.
    Content,
}

/// The splitter of one choice; see the module docs.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    markers: ReasoningMarkers,
    /// The tool-call format's opening marker when it is a special token
    /// (Gemma 4's `<|tool_call>`): a call written inside an unclosed block
    /// ends the block there (mlx_lm's reply state machine does the same).
    call_open: Option<&'static str>,
    state: State,
    /// Text not yet decided (a partial tag, trailing blanks in the block).
    held: String,
}

impl ReasoningSplitter {
    /// A splitter of blocks between `markers`, for a reply whose prompt
    /// ended inside an opened block (`open`), or that may open one itself.
    ///
    /// Markers that are special tokens ([`ReasoningMarkers::special_tokens`])
    /// cannot occur in the text of a reply: with them, the content may open
    /// another block, and their tokens are left out of the content (as the
    /// detokenizer leaves out special tokens).
    pub fn new(markers: ReasoningMarkers, open: bool) -> Self {
        ReasoningSplitter {
            markers,
            call_open: None,
            state: if open {
                State::Inside { fresh: true }
            } else {
                State::Start
            },
            held: String::new(),
        }
    }

    /// The same splitter, ending a block at `call_open` (a tool-call
    /// format's opening marker, a special token) as at its closing marker.
    pub fn with_call_marker(mut self, call_open: Option<&'static str>) -> Self {
        self.call_open = call_open;
        self
    }

    /// The markers this splitter reads.
    pub fn markers(&self) -> ReasoningMarkers {
        self.markers
    }

    /// Whether the markers are special tokens (see [`ReasoningSplitter::new`]).
    fn special(&self) -> bool {
        !self.markers.special_tokens.is_empty()
    }

    /// `text` without the markers' special tokens (none to remove for
    /// text markers).
    fn content(&self, text: &str) -> String {
        let mut t = text.to_owned();
        for token in self.markers.special_tokens {
            t = t.replace(token, "");
        }
        t
    }

    /// Feeds newly decoded text; returns the parts it decided.
    pub fn push(&mut self, text: &str) -> Vec<ReplyPart> {
        let ReasoningMarkers {
            open: open_tag,
            close: close_tag,
            ..
        } = self.markers;
        let mut out = Vec::new();
        self.held.push_str(text);
        loop {
            let buf = std::mem::take(&mut self.held);
            match self.state {
                State::Start => {
                    let t = buf.trim_start();
                    if let Some(rest) = t.strip_prefix(open_tag) {
                        self.state = State::Inside { fresh: true };
                        self.held = rest.to_owned();
                        continue;
                    }
                    if open_tag.starts_with(t) {
                        self.held = buf;
                    } else {
                        self.state = State::Content;
                        self.held = buf;
                        continue;
                    }
                }
                State::Inside { fresh } => {
                    let buf = if fresh {
                        let t = buf.trim_start();
                        // A model may write `<think>` again after a prompt
                        // that opened the block: it is not reasoning.
                        if let Some(rest) = t.strip_prefix(open_tag) {
                            self.held = rest.to_owned();
                            continue;
                        }
                        if t.is_empty() || open_tag.starts_with(t) {
                            self.held = t.to_owned();
                            return out;
                        }
                        self.state = State::Inside { fresh: false };
                        t.to_owned()
                    } else {
                        buf
                    };
                    let close_at = buf.find(close_tag);
                    let call_at = self.call_open.and_then(|m| buf.find(m));
                    match (close_at, call_at) {
                        (Some(at), call) if call.is_none_or(|c| at < c) => {
                            push(
                                &mut out,
                                ReplyPart::Reasoning(buf[..at].trim_end().to_owned()),
                            );
                            self.state = State::AfterBlock;
                            self.held = buf[at + close_tag.len()..].to_owned();
                            continue;
                        }
                        (_, Some(at)) => {
                            // A call: the block ends there, the call is
                            // content.
                            push(
                                &mut out,
                                ReplyPart::Reasoning(buf[..at].trim_end().to_owned()),
                            );
                            self.state = State::Content;
                            self.held = buf[at..].to_owned();
                            continue;
                        }
                        _ => {}
                    }
                    // Hold trailing blanks and a partial `</think>`.
                    let keep = held_tail(&buf, close_tag);
                    let cut = buf.len() - keep;
                    push(&mut out, ReplyPart::Reasoning(buf[..cut].to_owned()));
                    self.held = buf[cut..].to_owned();
                }
                State::AfterBlock => {
                    let t = buf.trim_start();
                    if !t.is_empty() {
                        self.state = State::Content;
                        self.held = t.to_owned();
                        continue;
                    }
                }
                State::Content if self.special() => {
                    if let Some(at) = buf.find(open_tag) {
                        push(&mut out, ReplyPart::Content(self.content(&buf[..at])));
                        self.state = State::Inside { fresh: true };
                        self.held = buf[at + open_tag.len()..].to_owned();
                        continue;
                    }
                    // Hold what may be the start of another block or of
                    // a marker token.
                    let keep = std::iter::once(open_tag)
                        .chain(self.markers.special_tokens.iter().copied())
                        .filter_map(|m| {
                            (1..m.len())
                                .rev()
                                .filter(|&k| m.is_char_boundary(k))
                                .find(|&k| buf.ends_with(&m[..k]))
                        })
                        .max()
                        .unwrap_or(0);
                    let cut = buf.len() - keep;
                    push(&mut out, ReplyPart::Content(self.content(&buf[..cut])));
                    self.held = buf[cut..].to_owned();
                }
                State::Content => push(&mut out, ReplyPart::Content(buf)),
            }
            return out;
        }
    }

    /// Ends the reply: what was held is decided now.
    pub fn finish(&mut self) -> Vec<ReplyPart> {
        let buf = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match self.state {
            State::Start | State::Content => push(&mut out, ReplyPart::Content(self.content(&buf))),
            State::Inside { .. } => push(&mut out, ReplyPart::Reasoning(buf.trim_end().to_owned())),
            State::AfterBlock => {}
        }
        out
    }
}

/// Appends `part` unless it is empty, merging it with a last part of the
/// same kind.
fn push(out: &mut Vec<ReplyPart>, part: ReplyPart) {
    match (out.last_mut(), part) {
        (_, ReplyPart::Reasoning(t) | ReplyPart::Content(t)) if t.is_empty() => {}
        (Some(ReplyPart::Reasoning(a)), ReplyPart::Reasoning(b))
        | (Some(ReplyPart::Content(a)), ReplyPart::Content(b)) => a.push_str(&b),
        (_, part) => out.push(part),
    }
}

/// Bytes at the end of `buf` to hold inside the block: a partial `close`
/// and the blanks before it (trimmed if the tag follows).
fn held_tail(buf: &str, close: &str) -> usize {
    let partial = (1..close.len())
        .rev()
        .filter(|&k| close.is_char_boundary(k))
        .find(|&k| buf.ends_with(&close[..k]))
        .unwrap_or(0);
    let before = &buf[..buf.len() - partial];
    let blanks = before.len() - before.trim_end().len();
    partial + blanks
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts of `text` fed in pieces cut at `cuts` (byte offsets on
    /// character boundaries), merged.
    fn split_with(
        markers: ReasoningMarkers,
        open: bool,
        text: &str,
        cuts: &[usize],
    ) -> (String, String) {
        let mut s = ReasoningSplitter::new(markers, open);
        let mut parts = Vec::new();
        let mut last = 0;
        for &c in cuts.iter().chain(std::iter::once(&text.len())) {
            parts.extend(s.push(&text[last..c]));
            last = c;
        }
        parts.extend(s.finish());
        let (mut reasoning, mut content) = (String::new(), String::new());
        for p in parts {
            match p {
                ReplyPart::Reasoning(t) => reasoning.push_str(&t),
                ReplyPart::Content(t) => content.push_str(&t),
            }
        }
        (reasoning, content)
    }

    /// `text` split whole, then cut at every position and at every pair of
    /// positions: the same parts every time.
    fn check(open: bool, text: &str, reasoning: &str, content: &str) {
        check_with(ReasoningMarkers::THINK, open, text, reasoning, content);
    }

    fn check_with(
        markers: ReasoningMarkers,
        open: bool,
        text: &str,
        reasoning: &str,
        content: &str,
    ) {
        let want = (reasoning.to_owned(), content.to_owned());
        let split = |cuts: &[usize]| split_with(markers, open, text, cuts);
        assert_eq!(split(&[]), want, "whole: {text:?}");
        let cuts: Vec<usize> = (1..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &a in &cuts {
            assert_eq!(split(&[a]), want, "cut at {a}: {text:?}");
            for &b in cuts.iter().filter(|&&b| b > a) {
                assert_eq!(split(&[a, b]), want, "cuts {a},{b}: {text:?}");
            }
        }
    }

    #[test]
    fn a_block_then_an_answer() {
        check(
            false,
            "<think>\nLet me add 2 and 2.\n</think>\n\n4.",
            "Let me add 2 and 2.",
            "4.",
        );
        check(
            false,
            "  <think>a < b </thin k></think>yes",
            "a < b </thin k>",
            "yes",
        );
    }

    #[test]
    fn a_prompt_that_opened_the_block() {
        check(true, "\nHmm, é.\n</think>\n\nDone", "Hmm, é.", "Done");
        // The model opens it again: the tag is not reasoning.
        check(true, "<think>\nHmm.</think>Done", "Hmm.", "Done");
        check(true, "<thin", "<thin", "");
        assert!(ReasoningMarkers::THINK.prompt_opens_block("<|im_start|>assistant\n<think>\n"));
        assert!(!ReasoningMarkers::THINK
            .prompt_opens_block("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    }

    #[test]
    fn a_reply_without_a_block_is_all_content() {
        check(
            false,
            "Plain answer, <think> later.",
            "",
            "Plain answer, <think> later.",
        );
        check(false, "<thin", "", "<thin");
        check(false, "  \n", "", "  \n");
    }

    #[test]
    fn a_reply_cut_inside_the_block_is_all_reasoning() {
        check(
            false,
            "<think>still thinking </th",
            "still thinking </th",
            "",
        );
        check(true, "partial", "partial", "");
    }

    #[test]
    fn an_empty_block_gives_no_reasoning() {
        check(false, "<think>\n\n</think>\n\nHi", "", "Hi");
    }

    /// Gemma 4's thought channel: the same rules with its markers; `<think>`
    /// is plain text there, and a channel that is not `thought` is content.
    #[test]
    fn gemma4_thought_channel() {
        let g = ReasoningMarkers::GEMMA4_CHANNEL;
        check_with(
            g,
            false,
            "<|channel>thought\nAdd 2 and 2 <think>.\n<channel|>4, <channel|>.",
            "Add 2 and 2 <think>.",
            "4, .",
        );
        check_with(g, false, "<|channel>thought<channel|>Hi", "", "Hi");
        // A stray channel token is left out of the content (as the
        // detokenizer leaves special tokens out); a later block is
        // reasoning again.
        check_with(g, false, "<|channel>final Hi", "", "final Hi");
        check_with(
            g,
            false,
            "<|channel>thought A<channel|>x <|channel>thought B<channel|>y",
            "AB",
            "x y",
        );
        check_with(g, false, "Hi <|chan", "", "Hi <|chan");
        check_with(g, true, "Hmm <channel|", "Hmm <channel|", "");
        check_with(g, false, "<think>x</think>y", "", "<think>x</think>y");
        assert!(g.prompt_opens_block("<start_of_turn>model\n<|channel>thought\n"));
        assert!(!g.prompt_opens_block("<|channel>thought<channel|>"));
    }
}
