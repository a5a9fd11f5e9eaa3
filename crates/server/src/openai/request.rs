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

use std::collections::BTreeMap;
use std::fmt;

use serde::de::value::{SeqAccessDeserializer, StrDeserializer};
use serde::de::{self, DeserializeOwned, DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};
use utoipa::openapi::{RefOr, Schema};
use utoipa::ToSchema;

use super::message::{ChatMessage, ResponseFormat, Tool, ToolChoice};

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

/// A schema written as JSON, for the few constraints the derives cannot
/// express (`propertyNames`, `not`, a constraint on one branch of a union).
/// Keywords utoipa's schema types lack (`not`) are carried as extensions,
/// which are written out as they are.
pub(crate) fn json_schema(value: Value) -> Schema {
    // The literals of this crate are valid schemas; a test writes every one
    // back and compares.
    let mut schema: Schema = serde_json::from_value(value.clone()).unwrap_or_default();
    if let (Schema::Object(object), Value::Object(keywords)) = (&mut schema, &value) {
        if !keywords.contains_key("type") {
            object.schema_type = utoipa::openapi::schema::SchemaType::AnyValue;
        }
        let kept = serde_json::to_value(&*object).unwrap_or_default();
        let lacking: utoipa::openapi::extensions::Extensions = keywords
            .iter()
            .filter(|(key, _)| kept.get(key.as_str()).is_none())
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        if !lacking.is_empty() {
            object.extensions = Some(lacking);
        }
    }
    schema
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
    /// Generate past end-of-sequence.
    pub ignore_eos: Option<bool>,
    /// Tokens before end-of-sequence may be sampled.
    pub min_tokens: Option<i128>,
}

generation_request! {
    /// The body of `POST /v1/chat/completions`. `stream_options` only with
    /// `stream` true; `top_logprobs` only with `logprobs` true. OpenAI fields
    /// mlxcel lacks (audio, function_call, functions, modalities,
    /// prediction, reasoning_effort, safety_identifier, service_tier,
    /// verbosity, web_search_options) are accepted only with their default
    /// value.
    #[schema(as = CreateChatCompletionRequest)]
    pub struct ChatCompletionRequest {
        /// Must be the served model's id (see GET /v1/models); another name
        /// is a 404.
        pub model: Option<String>,
        /// The conversation so far.
        #[schema(min_items = 1)]
        pub messages: Vec<ChatMessage>,
        /// Most tokens to generate per choice (default: the server's
        /// --default-max-tokens).
        #[schema(minimum = 1)]
        pub max_tokens: Option<i128>,
        /// Same as max_tokens; when both are given they must agree.
        #[schema(minimum = 1)]
        pub max_completion_tokens: Option<i128>,
        /// Return the log probability of each generated token.
        #[schema(default = false)]
        pub logprobs: Option<bool>,
        /// Alternatives per token; only with logprobs true.
        #[schema(minimum = 0, maximum = 20)]
        pub top_logprobs: Option<i128>,
        /// A grammar the answer must follow.
        pub response_format: Option<ResponseFormat>,
        /// Functions the model may call.
        pub tools: Option<Vec<Tool>>,
        /// Whether and which tool the model must call.
        pub tool_choice: Option<ToolChoice>,
        /// false: only the first tool call is returned.
        #[schema(default = true)]
        pub parallel_tool_calls: Option<bool>,
        /// Extra chat template variables, e.g. {"enable_thinking": false}
        /// (vLLM extension); not messages, tools, add_generation_prompt,
        /// documents, bos_token or eos_token.
        #[schema(schema_with = chat_template_kwargs_schema)]
        pub chat_template_kwargs: Option<Map<String, Value>>,
        /// Accepted and not stored.
        #[schema(schema_with = metadata_schema)]
        pub metadata: Option<BTreeMap<String, String>>,
        /// Accepted either way; nothing is stored.
        pub store: Option<bool>,
        /// Accepted and logged; the prefix cache finds shared prefixes by
        /// content.
        pub prompt_cache_key: Option<String>,
    }
}

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

/// A schema built from a JSON literal, for `schema_with`.
fn with_json(value: Value) -> RefOr<Schema> {
    RefOr::T(json_schema(value))
}

fn stop_schema() -> RefOr<Schema> {
    with_json(stop_json())
}

fn stop_json() -> Value {
    serde_json::json!({
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 0, "maxItems": 4, "items": {"type": "string", "minLength": 1}},
        ],
        "description": "Up to 4 sequences that end generation; they are not part of the text. [] means none.",
    })
}

fn logit_bias_schema() -> RefOr<Schema> {
    with_json(logit_bias_json())
}

fn logit_bias_json() -> Value {
    serde_json::json!({
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "Token id (as a string) to a bias added to its logit. Ids must be below the vocabulary size (400 otherwise).",
    })
}

fn metadata_schema() -> RefOr<Schema> {
    with_json(metadata_json())
}

fn metadata_json() -> Value {
    serde_json::json!({
        "type": "object",
        "maxProperties": 16,
        "propertyNames": {"maxLength": 64},
        "additionalProperties": {"type": "string", "maxLength": 512},
        "description": "Accepted and not stored.",
    })
}

fn chat_template_kwargs_schema() -> RefOr<Schema> {
    with_json(chat_template_kwargs_json())
}

fn chat_template_kwargs_json() -> Value {
    let reserved: Vec<Value> = mlxcel_engine_api::RESERVED_TEMPLATE_VARIABLES
        .iter()
        .map(|key| serde_json::json!({"required": [key]}))
        .collect();
    serde_json::json!({
        "type": "object",
        "not": {"anyOf": reserved},
        "description": "Extra chat template variables, e.g. {\"enable_thinking\": false} (vLLM extension); not messages, tools, add_generation_prompt, documents, bos_token or eos_token.",
    })
}

fn prompt_schema() -> RefOr<Schema> {
    with_json(prompt_json())
}

fn prompt_json() -> Value {
    let ids = serde_json::json!({"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}});
    serde_json::json!({
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            ids,
            {"type": "array", "minItems": 1, "items": ids},
        ],
        "description": "One prompt (text or token ids) or a list of them; each prompt is a group of n choices.",
    })
}

fn suffix_schema() -> RefOr<Schema> {
    with_json(suffix_json())
}

fn suffix_json() -> Value {
    serde_json::json!({
        "enum": ["", null],
        "description": "Not supported: only null or empty.",
    })
}

fn continuous_usage_stats_schema() -> RefOr<Schema> {
    with_json(continuous_usage_stats_json())
}

fn continuous_usage_stats_json() -> Value {
    serde_json::json!({
        "enum": [false, null],
        "description": "Only false (vLLM extension; usage per chunk is not sent).",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each literal comes out of the document as it was written: no keyword
    /// is lost on the way through utoipa's types.
    #[test]
    fn json_schemas_keep_every_keyword() {
        for literal in [
            stop_json(),
            logit_bias_json(),
            metadata_json(),
            chat_template_kwargs_json(),
            prompt_json(),
            suffix_json(),
            continuous_usage_stats_json(),
        ] {
            let written = serde_json::to_value(json_schema(literal.clone())).unwrap();
            assert_eq!(written, literal);
        }
    }
}
