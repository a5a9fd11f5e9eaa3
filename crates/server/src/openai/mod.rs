//! The wire types, with OpenAI's field names: request bodies in [`request`]
//! and [`message`]; response bodies: what every answer shares here, the
//! chat and text completion objects in [`chat`] and [`completion`].

pub mod chat;
pub mod completion;
pub mod message;
pub mod request;

use mlxcel_engine_api::Usage;
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
    /// `chatcmpl-` or `cmpl-` followed by a random UUID.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
}

impl CompletionMeta {
    /// A fresh `chatcmpl-` id, stamped now.
    pub fn chat(model: &str) -> Self {
        Self::with_prefix("chatcmpl-", model)
    }

    /// A fresh `cmpl-` id, stamped now.
    pub fn text(model: &str) -> Self {
        Self::with_prefix("cmpl-", model)
    }

    fn with_prefix(prefix: &str, model: &str) -> Self {
        Self {
            id: format!("{prefix}{}", uuid::Uuid::new_v4().simple()),
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
