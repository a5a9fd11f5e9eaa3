//! `text_completion`, streamed or not, with the legacy `logprobs` object.

use std::collections::BTreeMap;

use mlxcel_engine_api::{FinishReason, SampledLogprobs, TokenLogprob, Usage};
use serde::Serialize;

use super::{CompletionMeta, UsageBody};

/// The `text_completion` object: a whole answer, or one chunk of a stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TextCompletion<'a> {
    /// The completion's id (`cmpl-...`), the same on every chunk.
    pub id: &'a str,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model that answered.
    pub model: &'a str,
    /// Every choice (whole answer), one (chunk), or none (usage chunk).
    pub choices: Vec<TextChoice>,
    /// Whole answer: always set. Chunks: absent unless
    /// `stream_options.include_usage`, then `null` but on the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageBody>>,
}

impl<'a> TextCompletion<'a> {
    /// The whole answer.
    pub fn new(meta: &'a CompletionMeta, choices: Vec<TextChoice>, usage: Usage) -> Self {
        Self {
            usage: Some(Some(usage.into())),
            ..Self::chunk(meta, choices, false)
        }
    }

    /// A chunk with `choices`; `include_usage` adds `usage: null`.
    pub fn chunk(meta: &'a CompletionMeta, choices: Vec<TextChoice>, include_usage: bool) -> Self {
        Self {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices,
            usage: include_usage.then_some(None),
        }
    }

    /// The usage chunk that ends a stream.
    pub fn usage_chunk(meta: &'a CompletionMeta, usage: Usage) -> Self {
        Self::new(meta, Vec::new(), usage)
    }
}

/// One choice (or a choice's new part, in a chunk).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TextChoice {
    /// `prompt_index * n + i`.
    pub index: usize,
    /// The text (new text, in a chunk).
    pub text: String,
    /// `null` unless the request asked for logprobs (and, in a chunk,
    /// tokens completed this text).
    pub logprobs: Option<LegacyLogprobs>,
    /// `null` until the choice's last chunk.
    pub finish_reason: Option<FinishReason>,
}

/// The legacy `logprobs` object: parallel arrays, one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
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
