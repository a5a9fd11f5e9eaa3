//! `text_completion`, streamed or not, with the legacy `logprobs` object.

use std::collections::BTreeMap;

use mlxcel_engine_api::{FinishReason, SampledLogprobs, TokenLogprob};
use serde::Serialize;
use utoipa::openapi::{RefOr, Schema};
use utoipa::ToSchema;

use super::{finish_reason_schema, Completion};

/// The `text_completion` object: a whole answer, or one chunk of a stream.
pub type TextCompletion<'a> = Completion<'a, TextChoice>;

/// One choice (or a choice's new part, in a chunk).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct TextChoice {
    /// `prompt_index * n + i`.
    pub index: usize,
    /// The text (new text, in a chunk).
    pub text: String,
    /// `null` unless the request asked for logprobs (and, in a chunk,
    /// tokens completed this text).
    #[schema(required = true)]
    pub logprobs: Option<LegacyLogprobs>,
    /// `null` until the choice's last chunk (always set in a whole answer).
    #[schema(schema_with = maybe_finished, required = true)]
    pub finish_reason: Option<FinishReason>,
}

fn maybe_finished() -> RefOr<Schema> {
    finish_reason_schema(&["stop", "length"], true)
}

/// The schema of a whole answer's choice: a [`TextChoice`] that has
/// finished.
pub fn finished_text_choice() -> RefOr<Schema> {
    let finished = utoipa::openapi::schema::ObjectBuilder::new().property(
        "finish_reason",
        finish_reason_schema(&["stop", "length"], false),
    );
    utoipa::openapi::schema::AllOfBuilder::new()
        .item(utoipa::openapi::Ref::from_schema_name(TextChoice::name()))
        .item(finished)
        .into()
}

/// The legacy `logprobs` object: parallel arrays, one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
#[schema(as = CompletionLogprobs)]
pub struct LegacyLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability; `null` for an echoed prompt's first
    /// token, which has no context.
    pub token_logprobs: Vec<Option<f32>>,
    /// Each position's most likely tokens, text to log-probability; `null`
    /// where `token_logprobs` is.
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    /// Where each token starts in the choice's text, in characters.
    pub text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    /// The entries of `tokens`, the first of which starts at character
    /// `*offset` of the choice's text; `*offset` moves past the last.
    pub fn new(tokens: &[SampledLogprobs], offset: &mut usize) -> Self {
        let mut logprobs = Self::default();
        logprobs.extend(tokens, offset);
        logprobs
    }

    /// The entries of an echoed prompt (`echo` with `logprobs`): its first
    /// token with `null`s, then `rest`; offsets from the text's start.
    pub fn prompt(first: &TokenLogprob, rest: &[SampledLogprobs]) -> Self {
        let mut logprobs = Self {
            tokens: vec![first.text.clone()],
            token_logprobs: vec![None],
            top_logprobs: vec![None],
            text_offset: vec![0],
        };
        let mut offset = first.text.chars().count();
        logprobs.extend(rest, &mut offset);
        logprobs
    }

    /// Appends the entries of `tokens`, the first at character `*offset`.
    pub fn extend(&mut self, tokens: &[SampledLogprobs], offset: &mut usize) {
        for sampled in tokens {
            self.tokens.push(sampled.token.text.clone());
            self.token_logprobs.push(Some(sampled.token.logprob));
            let mut top = BTreeMap::new();
            for alternative in &sampled.top {
                // Distinct tokens can share a text (bytes shown as U+FFFD):
                // keep the likelier, which comes first.
                top.entry(alternative.text.clone())
                    .or_insert(alternative.logprob);
            }
            self.top_logprobs.push(Some(top));
            self.text_offset.push(*offset);
            *offset += sampled.token.text.chars().count();
        }
    }
}
