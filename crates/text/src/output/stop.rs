//! Stop strings (OpenAI's `stop`) over a choice's text.
//!
//! Text that might be the start of a stop string is held back until the
//! next text decides it; the first complete stop string ends the choice,
//! and neither it nor anything after it is released. The search runs over
//! everything not yet released, so a stop string split across any number
//! of tokens is found.

/// The stop strings of one choice and the text not yet past them.
#[derive(Debug)]
pub(crate) struct StopStrings {
    stop: Vec<String>,
    /// Text not yet past the stop-string check.
    pending: String,
    stopped: bool,
    /// The stop string that ended the choice (the earliest in the text;
    /// among those starting there, the first listed).
    matched: Option<String>,
}

impl StopStrings {
    /// Matching any of `stop` (empty strings are ignored).
    pub(crate) fn new(stop: &[String]) -> Self {
        Self {
            stop: stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            stopped: false,
            matched: None,
        }
    }

    /// A stop string appeared: the choice ends.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string that ended the choice, once one did.
    pub(crate) fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Reads `text`, which continues the text read before; returns the
    /// text now known to come before any stop string. When a stop string
    /// is complete, that is all the text before it, and [`Self::stopped`]
    /// turns true.
    pub(crate) fn push(&mut self, text: &str) -> String {
        self.pending.push_str(text);
        match self.earliest_stop() {
            Some((at, stop)) => {
                self.stopped = true;
                self.matched = Some(stop);
                let before = self.pending[..at].to_owned();
                self.pending.clear();
                before
            }
            None => {
                let keep = self.stop_prefix_len();
                let cut = self.pending.len() - keep;
                self.pending.drain(..cut).collect()
            }
        }
    }

    /// The choice ended: the text held back (it is no stop string).
    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Byte offset of the first stop string in `pending`, and that string
    /// (the first listed among those starting at the same offset).
    fn earliest_stop(&self) -> Option<(usize, String)> {
        self.stop
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at)
            .map(|(at, s)| (at, s.clone()))
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
}

/// Length in bytes of the longest proper suffix of `text` that is a prefix
/// of `pattern` (on character boundaries).
pub(crate) fn partial_suffix(text: &str, pattern: &str) -> usize {
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
