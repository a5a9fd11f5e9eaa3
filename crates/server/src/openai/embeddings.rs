//! `POST /v1/embeddings` (OpenAI's shape): request and response bodies.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::request::schemas::prompt_schema;
use super::request::{Prompt, Unknown};

/// The body of `POST /v1/embeddings`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[schema(as = CreateEmbeddingRequest)]
pub struct EmbeddingsBody {
    /// Must be the served model's id when given; another name is a 404.
    pub model: Option<String>,
    /// What to embed: a string, a list of strings, a list of token ids or
    /// a list of lists of token ids (at most 2048 inputs, none empty).
    /// Each input is one vector, `data[i]`.
    #[schema(schema_with = prompt_schema)]
    pub input: Prompt,
    /// `float` (default): each vector as a list of numbers; `base64`: the
    /// little-endian float32 bytes of each, base64-encoded.
    #[schema(default = "float")]
    pub encoding_format: Option<String>,
    /// Keep the first this many numbers of each vector and scale them back
    /// to unit length (Matryoshka truncation: meaningful for models trained
    /// for it, such as Qwen3-Embedding); at most the model's hidden size.
    #[schema(minimum = 1)]
    pub dimensions: Option<i128>,
    /// Ignored (OpenAI's end-user id).
    pub user: Option<String>,
    /// Keys that are not fields.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: Unknown,
}

/// The answer of `POST /v1/embeddings`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = CreateEmbeddingResponse)]
pub struct EmbeddingList {
    /// Always `list`.
    #[schema(value_type = String, example = "list")]
    pub object: &'static str,
    /// One vector per input, in input order.
    pub data: Vec<EmbeddingObject>,
    /// The served model's id.
    pub model: String,
    /// Tokens embedded.
    pub usage: EmbeddingUsage,
}

/// One input's vector.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = Embedding)]
pub struct EmbeddingObject {
    /// Always `embedding`.
    #[schema(value_type = String, example = "embedding")]
    pub object: &'static str,
    /// The input's position in `input`.
    pub index: usize,
    /// The unit-length vector (`float`), or its little-endian float32 bytes
    /// in base64 (`base64`).
    pub embedding: EmbeddingVector,
}

/// A vector as `encoding_format` asks.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingVector {
    /// The numbers.
    Float(Vec<f32>),
    /// Base64 of the little-endian float32 bytes.
    Base64(String),
}

/// `usage` of an embeddings answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct EmbeddingUsage {
    /// Tokens of every input together.
    pub prompt_tokens: usize,
    /// Equal to `prompt_tokens` (nothing is generated).
    pub total_tokens: usize,
}
