//! Tool calls read out of a reply's text, as the text comes.
//!
//! A [`ToolCallParser`] reads the text that passed the stop-string check
//! and sends on what it has decided: plain text, a call's start (id and
//! name), fragments of the call's arguments. Each model family's format is
//! one parser; today the Hermes / Qwen2.5 `<tool_call>` JSON format
//! ([`hermes`]).

use super::OutputPiece;

pub mod hermes;

pub use hermes::HermesParser;

/// Reads tool calls of one format out of a choice's text.
///
/// Text in ([`Self::push`], then [`Self::finish`] with the last of it),
/// [`OutputPiece`]s out: [`OutputPiece::Text`] for what is not a call,
/// [`OutputPiece::CallStart`] (a fresh id and an offered function's name)
/// when a call is committed, then its arguments as
/// [`OutputPiece::CallArguments`] fragments. A call of a function that was
/// not offered, or one that does not parse, is text. A parser can also
/// start in forced mode, seeded with the reply's start that the engine put
/// in the prompt (a forced `tool_choice`): then no wrapper text is ever
/// sent.
pub trait ToolCallParser: std::fmt::Debug + Send {
    /// A parser extracting calls of the functions named in `tool_names`.
    fn new(tool_names: &[String]) -> Self
    where
        Self: Sized;

    /// The parser of a forced reply whose first text, `prefix`, is in the
    /// prompt rather than generated: the generated text continues it. Text
    /// that never became a call is dropped.
    fn forced(tool_names: &[String], prefix: &str) -> Self
    where
        Self: Sized;

    /// Reads `text`, which continues the text read before; returns what it
    /// decides (text that may still become a call is held).
    fn push(&mut self, text: &str) -> Vec<OutputPiece>;

    /// Reads the last `text` of the choice: everything held is decided.
    fn finish(&mut self, text: &str) -> Vec<OutputPiece>;

    /// Tool calls found so far.
    fn calls(&self) -> usize;
}

/// `call_` and 24 random hex digits.
pub(crate) fn new_call_id() -> String {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::try_from_os_rng()
        .unwrap_or_else(|_| rand_chacha::ChaCha8Rng::seed_from_u64(std::process::id().into()));
    format!("call_{:016x}{:08x}", rng.next_u64(), rng.next_u32())
}
