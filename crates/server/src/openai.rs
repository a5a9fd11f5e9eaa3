//! Response bodies, with OpenAI's field names.

use mlxcel_engine_api::{FinishReason, Usage};
use serde::Serialize;
use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What every object of one completion shares: its id, creation time and
/// model name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletionMeta {
    /// `chatcmpl-` followed by a random UUID.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
}

impl CompletionMeta {
    /// A fresh id, stamped now.
    pub fn new(model: &str) -> Self {
        Self {
            id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model: model.to_owned(),
        }
    }
}

/// `usage` of a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UsageBody {
    /// Tokens in the rendered prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// `prompt_tokens + completion_tokens`.
    pub total_tokens: usize,
    /// Breakdown of the prompt tokens.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

impl From<Usage> for UsageBody {
    fn from(usage: Usage) -> Self {
        Self {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: usage.cached_tokens,
            },
        }
    }
}

/// A non-streamed answer: the `chat.completion` object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletion<'a> {
    /// The completion's id.
    pub id: &'a str,
    /// Always `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model that answered.
    pub model: &'a str,
    /// The one choice (n = 1).
    pub choices: Vec<Choice>,
    /// Token accounting.
    pub usage: UsageBody,
}

impl<'a> ChatCompletion<'a> {
    /// The answer `content` that ended for `reason`.
    pub fn new(
        meta: &'a CompletionMeta,
        content: String,
        reason: FinishReason,
        usage: Usage,
    ) -> Self {
        Self {
            id: &meta.id,
            object: "chat.completion",
            created: meta.created,
            model: &meta.model,
            choices: vec![Choice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant",
                    content,
                },
                finish_reason: reason,
                logprobs: None,
            }],
            usage: usage.into(),
        }
    }
}

/// One choice of a `chat.completion`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Choice {
    /// Position among the choices.
    pub index: u32,
    /// The generated message.
    pub message: AssistantMessage,
    /// `stop` or `length`.
    pub finish_reason: FinishReason,
    /// Always `null` (log probabilities are not implemented).
    pub logprobs: Option<serde_json::Value>,
}

/// The generated message of a choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text.
    pub content: String,
}

/// One event of a streamed answer: the `chat.completion.chunk` object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletionChunk<'a> {
    /// The completion's id, the same on every chunk.
    pub id: &'a str,
    /// Always `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds, the same on every chunk.
    pub created: u64,
    /// The model that answers.
    pub model: &'a str,
    /// One choice, or none on the usage chunk.
    pub choices: Vec<ChunkChoice<'a>>,
    /// Absent unless `stream_options.include_usage`; then `null` on every
    /// chunk but the last, which carries the usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageBody>>,
}

/// One choice of a chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChunkChoice<'a> {
    /// Position among the choices.
    pub index: u32,
    /// What is new since the previous chunk.
    pub delta: ChunkDelta<'a>,
    /// Always `null`.
    pub logprobs: Option<serde_json::Value>,
    /// Set on the last chunk of the choice only.
    pub finish_reason: Option<FinishReason>,
}

/// The new part of the message; empty (`{}`) on the finishing chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChunkDelta<'a> {
    /// `assistant` on the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
}

impl<'a> ChatCompletionChunk<'a> {
    /// A chunk of `meta` with `choices`; `include_usage` adds `usage: null`.
    pub fn new(
        meta: &'a CompletionMeta,
        choices: Vec<ChunkChoice<'a>>,
        include_usage: bool,
    ) -> Self {
        Self {
            id: &meta.id,
            object: "chat.completion.chunk",
            created: meta.created,
            model: &meta.model,
            choices,
            usage: include_usage.then_some(None),
        }
    }

    /// A chunk carrying `delta` and, on the last one, `finish_reason`.
    pub fn delta(
        meta: &'a CompletionMeta,
        delta: ChunkDelta<'a>,
        finish_reason: Option<FinishReason>,
        include_usage: bool,
    ) -> Self {
        let choice = ChunkChoice {
            index: 0,
            delta,
            logprobs: None,
            finish_reason,
        };
        Self::new(meta, vec![choice], include_usage)
    }

    /// The usage chunk sent after the finishing chunk: no choices.
    pub fn usage(meta: &'a CompletionMeta, usage: Usage) -> Self {
        Self {
            usage: Some(Some(usage.into())),
            ..Self::new(meta, Vec::new(), true)
        }
    }
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelList<'a> {
    /// Always `list`.
    pub object: &'static str,
    /// The served models (one).
    pub data: Vec<ModelCard<'a>>,
}

/// One model of `GET /v1/models`, and the body of `GET /v1/models/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard<'a> {
    /// The model's name.
    pub id: &'a str,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds at which the server started.
    pub created: u64,
    /// Always `mlxcel`.
    pub owned_by: &'static str,
}

impl<'a> ModelCard<'a> {
    /// The card of `id`, served since `created`.
    pub fn new(id: &'a str, created: u64) -> Self {
        Self {
            id,
            object: "model",
            created,
            owned_by: "mlxcel",
        }
    }
}

/// The body of `GET /v1/cache/stats` (sizes in blocks, tokens and bytes).
pub fn cache_stats_body(s: &mlxcel_engine_api::EngineStats) -> serde_json::Value {
    let hit_rate = if s.prefix_cache_lookups == 0 {
        0.0
    } else {
        s.prefix_cache_hits as f64 / s.prefix_cache_lookups as f64
    };
    serde_json::json!({
        "object": "cache.stats",
        "enabled": s.prefix_cache_enabled,
        "storage_backend": s.kv_storage_backend,
        "block_size": s.kv_block_size,
        "block_bytes": s.kv_block_bytes,
        "blocks": {
            "total": s.kv_blocks_total,
            "used": s.kv_blocks_used,
            "free": s.kv_blocks_free,
            "cached": s.kv_blocks_cached,
            "active": s.kv_blocks_active,
        },
        "entries": s.kv_blocks_cached,
        "bytes": s.kv_blocks_cached * s.kv_block_bytes,
        "capacity": s.prefix_cache_capacity_blocks,
        "capacity_bytes": s.prefix_cache_capacity_blocks * s.kv_block_bytes,
        "lookups": s.prefix_cache_lookups,
        "hits": s.prefix_cache_hits,
        "misses": s.prefix_cache_misses,
        "hit_rate": hit_rate,
        "tokens_queried": s.prefix_cache_tokens_queried,
        "tokens_reused": s.prefix_cache_tokens_reused,
        "inserts": s.prefix_cache_inserts,
        "evictions": s.prefix_cache_evictions,
        "running": s.running,
        "waiting": s.waiting,
    })
}
