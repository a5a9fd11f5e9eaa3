//! Request bodies, as they come over the wire: `POST /v1/chat/completions`
//! ([`ChatCompletionRequest`]) and `POST /v1/completions`
//! ([`CompletionRequest`]).
//!
//! These types are the one description of a request: serde reads a body into
//! them and their `ToSchema` derives write its schema in `/openapi.json`.
//! They only hold what the body says; [`crate::validate`] applies the range
//! and relation rules and builds the engine's request.
//!
//! Two conventions run through every type:
//!
//! - `null` means absent: every optional field is an `Option`, and keys that
//!   are not fields land in an [`Unknown`] (flattened), which drops null
//!   ones. Validation refuses the others, naming each (`stream_options.foo`);
//!   the schema closes these objects (`additionalProperties: false`, set by
//!   [`crate::openapi`]). serde's `deny_unknown_fields` is not used: it
//!   would refuse a null key, and report an unknown key before the rule of a
//!   known one (a content part of `type: image_url` names its `type`, not
//!   its `image_url`).
//! - A string field with a fixed set of values is a [`Tag`]: any string
//!   parses, and validation refuses one outside the set with its own error.
//!
//! - chat.rs: [`ChatCompletionRequest`].
//! - completion.rs: [`CompletionRequest`] and its [`Prompt`].
//! - schemas.rs: the schemas written as JSON, for what the derives cannot
//!   express.
//! - here: what both share ([`SharedFields`], [`Stop`], [`StreamOptions`])
//!   and the two conventions ([`Unknown`], [`Tag`]).

pub(crate) mod schemas;

use std::collections::BTreeMap;
use std::fmt;

use serde::de::value::{SeqAccessDeserializer, StrDeserializer};
use serde::de::{self, DeserializeOwned, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};
use utoipa::ToSchema;

use schemas::continuous_usage_stats_schema;

pub(crate) use schemas::json_schema;

/// The keys of a request object that are not among its fields, with their
/// values; keys whose value is `null` are left out (absent).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Unknown(pub Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Unknown {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let entries = Map::<String, Value>::deserialize(deserializer)?;
        Ok(Self(
            entries.into_iter().filter(|(_, v)| !v.is_null()).collect(),
        ))
    }
}

/// A string field whose values are `T`'s variants: `Known` for one of them,
/// `Other` (with the string) for any other, which validation refuses with
/// the field's own error. Fields of this type give `T` as their schema's
/// `value_type`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tag<T> {
    /// One of `T`'s values.
    Known(T),
    /// A string that is none of them.
    Other(String),
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Tag<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = String::deserialize(deserializer)?;
        let known = T::deserialize(StrDeserializer::<de::value::Error>::new(&value));
        Ok(known.map_or(Self::Other(value), Self::Known))
    }
}

/// Declares a request struct with the fields both completion endpoints
/// share, after its own fields, and a [`SharedFields`] accessor.
macro_rules! generation_request {
    (
        $(#[$attr:meta])*
        pub struct $name:ident {
            $($own:tt)*
        }
    ) => {
        #[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
        $(#[$attr])*
        pub struct $name {
            $($own)*
            /// Sampling temperature; 0 is greedy.
            #[schema(minimum = 0, maximum = 2)]
            pub temperature: Option<f64>,
            /// Nucleus sampling mass.
            #[schema(exclusive_minimum = 0, maximum = 1)]
            pub top_p: Option<f64>,
            /// Keep the k most likely tokens; 0 disables it (mlxcel extension).
            #[schema(minimum = 0)]
            pub top_k: Option<i128>,
            /// Drop tokens below min_p times the top probability (mlxcel
            /// extension).
            #[schema(minimum = 0, maximum = 1)]
            pub min_p: Option<f64>,
            /// Seed of the sampler, for reproducible sampling.
            pub seed: Option<i128>,
            /// Up to 4 sequences that end generation; they are not part of
            /// the text. `[]` means none.
            #[schema(schema_with = stop_schema)]
            pub stop: Option<Stop>,
            /// Penalty on tokens already present.
            #[schema(minimum = -2, maximum = 2)]
            pub presence_penalty: Option<f64>,
            /// Penalty on tokens by how often they occur.
            #[schema(minimum = -2, maximum = 2)]
            pub frequency_penalty: Option<f64>,
            /// Multiplicative repetition penalty; 1 is off (mlxcel extension).
            #[schema(exclusive_minimum = 0, maximum = 2)]
            pub repetition_penalty: Option<f64>,
            /// Token id (as a string) to a bias added to its logit. Ids must
            /// be below the vocabulary size (400 otherwise).
            #[schema(schema_with = logit_bias_schema)]
            pub logit_bias: Option<BTreeMap<String, f64>>,
            /// Choices to generate. The engine may refuse more than its
            /// --parallel with a 400 on param `n`.
            #[schema(minimum = 1, maximum = 16, default = 1)]
            pub n: Option<i128>,
            /// Answer with server-sent events.
            #[schema(default = false)]
            pub stream: Option<bool>,
            /// Only with `stream: true`.
            pub stream_options: Option<StreamOptions>,
            /// An opaque end-user id (logged only).
            pub user: Option<String>,
            /// Reuse and extend the prefix cache for this prompt (mlxcel
            /// extension).
            #[schema(default = true)]
            pub cache_prompt: Option<bool>,
            /// Let the server verify draft tokens for this request when it
            /// runs with --speculative (mlxcel extension; greedy output is
            /// the same either way; false opts out).
            #[schema(default = true)]
            pub speculative: Option<bool>,
            /// Keep generating past end-of-sequence tokens (vLLM extension).
            #[schema(default = false)]
            pub ignore_eos: Option<bool>,
            /// End-of-sequence tokens cannot be sampled before this many
            /// completion tokens; at most max_tokens (vLLM extension). Stop
            /// strings, the grammar and max_tokens still end a choice.
            #[schema(minimum = 0, default = 0)]
            pub min_tokens: Option<i128>,
            /// Keys that are not fields of the request.
            #[serde(flatten)]
            #[schema(ignore)]
            pub unknown: Unknown,
        }

        impl $name {
            /// Takes out the fields both endpoints share.
            pub fn take_shared(&mut self) -> SharedFields {
                SharedFields {
                    temperature: self.temperature.take(),
                    top_p: self.top_p.take(),
                    top_k: self.top_k.take(),
                    min_p: self.min_p.take(),
                    seed: self.seed.take(),
                    stop: self.stop.take(),
                    presence_penalty: self.presence_penalty.take(),
                    frequency_penalty: self.frequency_penalty.take(),
                    repetition_penalty: self.repetition_penalty.take(),
                    logit_bias: self.logit_bias.take(),
                    n: self.n.take(),
                    stream: self.stream.take(),
                    stream_options: self.stream_options.take(),
                    user: self.user.take(),
                    cache_prompt: self.cache_prompt.take(),
                    speculative: self.speculative.take(),
                    ignore_eos: self.ignore_eos.take(),
                    min_tokens: self.min_tokens.take(),
                }
            }
        }
    };
}

/// The fields [`ChatCompletionRequest`] and [`CompletionRequest`] share, as
/// sent (see either type for what each means).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SharedFields {
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Nucleus sampling mass.
    pub top_p: Option<f64>,
    /// Top-k cut-off.
    pub top_k: Option<i128>,
    /// Min-p cut-off.
    pub min_p: Option<f64>,
    /// Sampler seed.
    pub seed: Option<i128>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Presence penalty.
    pub presence_penalty: Option<f64>,
    /// Frequency penalty.
    pub frequency_penalty: Option<f64>,
    /// Repetition penalty.
    pub repetition_penalty: Option<f64>,
    /// Logit bias by token id.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// Choices to generate.
    pub n: Option<i128>,
    /// Answer with server-sent events.
    pub stream: Option<bool>,
    /// Options of the stream.
    pub stream_options: Option<StreamOptions>,
    /// End-user id.
    pub user: Option<String>,
    /// Use the prefix cache.
    pub cache_prompt: Option<bool>,
    /// Verify draft tokens for this request.
    pub speculative: Option<bool>,
    /// Generate past end-of-sequence.
    pub ignore_eos: Option<bool>,
    /// Tokens before end-of-sequence may be sampled.
    pub min_tokens: Option<i128>,
}

// Declared after `generation_request!`, which they use.
mod chat;
mod completion;

pub use chat::ChatCompletionRequest;
pub use completion::{CompletionRequest, Prompt, PROMPT_ITEM_TYPES, PROMPT_TYPES, TOKEN_IDS};

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with the usage (and `usage: null` on the others).
    #[schema(default = false)]
    pub include_usage: Option<bool>,
    /// Accepted either way; chunks are never padded.
    pub include_obfuscation: Option<bool>,
    /// Only false (vLLM extension; usage per chunk is not sent).
    #[schema(schema_with = continuous_usage_stats_schema)]
    pub continuous_usage_stats: Option<bool>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    /// `"stop": "..."`.
    One(String),
    /// `"stop": [...]`.
    Many(Vec<String>),
}

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StopVisitor;
        impl<'de> Visitor<'de> for StopVisitor {
            type Value = Stop;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(STRING_OR_STRINGS)
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<Stop, E> {
                Ok(Stop::One(value.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Stop, A::Error> {
                Vec::deserialize(SeqAccessDeserializer::new(seq)).map(Stop::Many)
            }
        }
        deserializer.deserialize_any(StopVisitor)
    }
}

/// What [`Stop`] expects.
pub const STRING_OR_STRINGS: &str = "a string or an array of strings";
