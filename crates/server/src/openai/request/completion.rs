//! The body of `POST /v1/completions` and its `prompt`, read as sent
//! (text, token ids, or a list of either; a list's items all of its first
//! item's kind).

use std::collections::BTreeMap;
use std::fmt;

use serde::de::value::SeqAccessDeserializer;
use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use utoipa::ToSchema;

use super::schemas::{logit_bias_schema, prompt_schema, stop_schema, suffix_schema};
use super::{SharedFields, Stop, StreamOptions, Unknown};

generation_request! {
    /// The body of `POST /v1/completions`. `stream_options` only with
    /// `stream` true.
    #[schema(as = CreateCompletionRequest)]
    pub struct CompletionRequest {
        /// Must be the served model's id (see GET /v1/models); another name
        /// is a 404.
        pub model: Option<String>,
        /// One prompt (text or token ids) or a list of them; each prompt is
        /// a group of n choices.
        #[schema(schema_with = prompt_schema)]
        pub prompt: Prompt,
        /// Not supported: only null or empty.
        #[schema(schema_with = suffix_schema)]
        pub suffix: Option<String>,
        /// Most tokens to generate per choice.
        #[schema(minimum = 1, default = 16)]
        pub max_tokens: Option<i128>,
        /// Return the log probabilities of each token and of this many
        /// alternatives; null is off.
        #[schema(minimum = 0, maximum = 5)]
        pub logprobs: Option<i128>,
        /// Prepend the prompt to the text. With logprobs, the prompt's tokens
        /// come first in logprobs, each with its log probability given the
        /// tokens before it (the first token's is null); the whole prompt is
        /// then computed, without the prompt cache.
        #[schema(default = false)]
        pub echo: Option<bool>,
        /// Only null or equal to n.
        #[schema(minimum = 1, maximum = 16)]
        pub best_of: Option<i128>,
    }
}

/// `prompt`, as sent. Token ids are kept as sent (any integer);
/// validation checks that each is a token id.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// Several text prompts (also an empty list).
    Texts(Vec<String>),
    /// One prompt of token ids.
    Tokens(Vec<i128>),
    /// Several prompts of token ids.
    TokenLists(Vec<Vec<i128>>),
}

/// What [`Prompt`] expects.
pub const PROMPT_TYPES: &str =
    "a string, an array of strings, an array of token ids or an array of arrays of token ids";

/// What the first item of a prompt list may be.
pub const PROMPT_ITEM_TYPES: &str = "a string, a token id or an array of token ids";

/// The kind of a prompt list's items, set by its first item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ItemKind {
    Text,
    Token,
    Tokens,
}

/// One item of a prompt list; after the first, items must be of the first
/// one's kind.
enum PromptItem {
    Text(String),
    Token(i128),
    Tokens(Vec<i128>),
}

impl PromptItem {
    fn kind(&self) -> ItemKind {
        match self {
            Self::Text(_) => ItemKind::Text,
            Self::Token(_) => ItemKind::Token,
            Self::Tokens(_) => ItemKind::Tokens,
        }
    }
}

/// Reads one prompt list item, of `kind` when set.
struct PromptItemSeed(Option<ItemKind>);

impl<'de> DeserializeSeed<'de> for PromptItemSeed {
    type Value = PromptItem;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<PromptItem, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptItemSeed {
    type Value = PromptItem;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self.0 {
            None => PROMPT_ITEM_TYPES,
            Some(ItemKind::Text) => "a string",
            Some(ItemKind::Token) => "an integer",
            Some(ItemKind::Tokens) => TOKEN_IDS,
        })
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<PromptItem, E> {
        self.accept(
            PromptItem::Text(value.to_owned()),
            de::Unexpected::Str(value),
        )
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<PromptItem, E> {
        self.accept(
            PromptItem::Token(value.into()),
            de::Unexpected::Signed(value),
        )
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<PromptItem, E> {
        self.accept(
            PromptItem::Token(value.into()),
            de::Unexpected::Unsigned(value),
        )
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<PromptItem, A::Error> {
        if !matches!(self.0, None | Some(ItemKind::Tokens)) {
            return Err(de::Error::invalid_type(de::Unexpected::Seq, &self));
        }
        let ids = Vec::<TokenId>::deserialize(SeqAccessDeserializer::new(seq))?;
        Ok(PromptItem::Tokens(ids.into_iter().map(|t| t.0).collect()))
    }
}

impl PromptItemSeed {
    fn accept<E: de::Error>(self, item: PromptItem, sent: de::Unexpected) -> Result<PromptItem, E> {
        match self.0 {
            Some(kind) if kind != item.kind() => Err(E::invalid_type(sent, &self)),
            _ => Ok(item),
        }
    }
}

/// What a list of token ids expects.
pub const TOKEN_IDS: &str = "an array of token ids";

/// An integer of a token-id list, any size (validation checks the range).
struct TokenId(i128);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        i128::deserialize(deserializer).map(TokenId)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PromptVisitor;
        impl<'de> Visitor<'de> for PromptVisitor {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(PROMPT_TYPES)
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(value.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let Some(first) = seq.next_element_seed(PromptItemSeed(None))? else {
                    return Ok(Prompt::Texts(Vec::new()));
                };
                let kind = first.kind();
                let mut items = vec![first];
                while let Some(item) = seq.next_element_seed(PromptItemSeed(Some(kind)))? {
                    items.push(item);
                }
                let mut prompt = match kind {
                    ItemKind::Text => Prompt::Texts(Vec::with_capacity(items.len())),
                    ItemKind::Token => Prompt::Tokens(Vec::with_capacity(items.len())),
                    ItemKind::Tokens => Prompt::TokenLists(Vec::with_capacity(items.len())),
                };
                for item in items {
                    match (&mut prompt, item) {
                        (Prompt::Texts(all), PromptItem::Text(text)) => all.push(text),
                        (Prompt::Tokens(all), PromptItem::Token(id)) => all.push(id),
                        (Prompt::TokenLists(all), PromptItem::Tokens(ids)) => all.push(ids),
                        // The seed refused every item of another kind.
                        _ => return Err(de::Error::custom("mixed prompt list")),
                    }
                }
                Ok(prompt)
            }
        }
        deserializer.deserialize_any(PromptVisitor)
    }
}
