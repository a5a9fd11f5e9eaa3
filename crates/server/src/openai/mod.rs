//! The wire types, with OpenAI's field names: request bodies in [`request`]
//! and [`message`]; response bodies: what every answer shares here, the
//! chat and text completion objects in [`chat`] and [`completion`]; the
//! Responses API's request in [`responses`] and its `response` object and
//! stream events in [`response_object`]; `/tokenize` and `/detokenize` in
//! [`tokenize`].

pub mod chat;
pub mod completion;
pub mod embeddings;
pub mod infill;
pub mod message;
pub mod request;
pub mod response_object;
pub mod responses;
pub mod tokenize;

use mlxcel_engine_api::Usage;
use serde::Serialize;
use std::time::{SystemTime, UNIX_EPOCH};
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Type};
use utoipa::openapi::{Ref, RefOr, Schema};
use utoipa::ToSchema;

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Which endpoint a completion answers, which names its objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionKind {
    /// `/v1/chat/completions`: `chat.completion`, streamed as
    /// `chat.completion.chunk`.
    Chat,
    /// `/v1/completions`: `text_completion`, whole or streamed.
    Text,
}

impl CompletionKind {
    /// `object` of a whole answer.
    pub fn object(self) -> &'static str {
        match self {
            Self::Chat => "chat.completion",
            Self::Text => "text_completion",
        }
    }

    /// `object` of a stream's chunks.
    pub fn chunk_object(self) -> &'static str {
        match self {
            Self::Chat => "chat.completion.chunk",
            Self::Text => "text_completion",
        }
    }

    /// The start of the completion's id.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Self::Chat => "chatcmpl-",
            Self::Text => "cmpl-",
        }
    }
}

/// What every object of one completion shares: its id, creation time and
/// model name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletionMeta {
    /// Chat or text.
    pub kind: CompletionKind,
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
        Self::new(CompletionKind::Chat, model)
    }

    /// A fresh `cmpl-` id, stamped now.
    pub fn text(model: &str) -> Self {
        Self::new(CompletionKind::Text, model)
    }

    fn new(kind: CompletionKind, model: &str) -> Self {
        Self {
            kind,
            id: format!("{}{}", kind.id_prefix(), uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model: model.to_owned(),
        }
    }
}

/// The envelope of every completion object, chat or text, whole or a chunk
/// of a stream: `id`, `object`, `created`, `model`, `choices` of the
/// endpoint's choice type `C`, and `usage`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion<'a, C> {
    /// The completion's id, the same on every chunk.
    pub id: &'a str,
    /// `chat.completion`, `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
    /// Unix seconds, the same on every chunk.
    pub created: u64,
    /// The model that answers.
    pub model: &'a str,
    /// Every choice (whole answer), one (chunk), or none (usage chunk).
    pub choices: Vec<C>,
    /// Whole answer: always set. Chunks: absent unless
    /// `stream_options.include_usage`, then `null` but on the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageBody>>,
}

impl<'a, C> Completion<'a, C> {
    /// The whole answer of `meta`.
    pub fn answer(meta: &'a CompletionMeta, choices: Vec<C>, usage: Usage) -> Self {
        Self {
            object: meta.kind.object(),
            usage: Some(Some(usage.into())),
            ..Self::chunk(meta, choices, false)
        }
    }

    /// A chunk of `meta`'s stream with `choices`; `include_usage` adds
    /// `usage: null`.
    pub fn chunk(meta: &'a CompletionMeta, choices: Vec<C>, include_usage: bool) -> Self {
        Self {
            id: &meta.id,
            object: meta.kind.chunk_object(),
            created: meta.created,
            model: &meta.model,
            choices,
            usage: include_usage.then_some(None),
        }
    }

    /// The usage chunk that ends `meta`'s stream: no choices.
    pub fn usage_chunk(meta: &'a CompletionMeta, usage: Usage) -> Self {
        Self {
            usage: Some(Some(usage.into())),
            ..Self::chunk(meta, Vec::new(), false)
        }
    }
}

impl<C: ToSchema> Completion<'_, C> {
    /// The schema of `kind`'s whole answer (`chunk` false) or of its
    /// chunks, whose choices are `C`s (`choice` overrides `C`'s schema).
    pub fn schema(
        kind: CompletionKind,
        chunk: bool,
        choice: Option<RefOr<Schema>>,
        description: &str,
    ) -> Schema {
        let string = || ObjectBuilder::new().schema_type(Type::String);
        let choice = choice.unwrap_or_else(|| Ref::from_schema_name(C::name()).into());
        let usage = Ref::from_schema_name(UsageBody::name());
        let (object, usage, min_choices): (_, RefOr<Schema>, _) = if chunk {
            let nullable = OneOfBuilder::new()
                .item(usage)
                .item(ObjectBuilder::new().schema_type(Type::Null));
            (kind.chunk_object(), nullable.into(), None)
        } else {
            (kind.object(), usage.into(), Some(1))
        };
        let mut envelope = ObjectBuilder::new()
            .description(Some(description))
            .property(
                "id",
                string().pattern(Some(format!("^{}", kind.id_prefix()))),
            )
            .property("object", string().enum_values(Some([object])))
            .property(
                "created",
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(0))
                    .description(Some("Unix seconds.")),
            )
            .property("model", string())
            .property(
                "choices",
                ArrayBuilder::new().items(choice).min_items(min_choices),
            )
            .property("usage", usage);
        for field in ["id", "object", "created", "model", "choices"] {
            envelope = envelope.required(field);
        }
        if !chunk {
            envelope = envelope.required("usage");
        }
        envelope.into()
    }
}

/// `usage` of a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[schema(as = Usage)]
pub struct UsageBody {
    /// Tokens in the rendered prompt.
    pub prompt_tokens: usize,
    /// Tokens generated, summed over the choices.
    pub completion_tokens: usize,
    /// `prompt_tokens + completion_tokens`.
    pub total_tokens: usize,
    /// Breakdown of the prompt tokens.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
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
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ModelList<'a> {
    /// Always `list`.
    #[schema(schema_with = list_object)]
    pub object: &'static str,
    /// The served models (one).
    pub data: Vec<ModelCard<'a>>,
}

/// One model of `GET /v1/models`, and the body of `GET /v1/models/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = Model)]
pub struct ModelCard<'a> {
    /// The model's name.
    pub id: &'a str,
    /// Always `model`.
    #[schema(schema_with = model_object)]
    pub object: &'static str,
    /// Unix seconds at which the server started.
    pub created: u64,
    /// Always `mlxcel`.
    pub owned_by: &'static str,
    /// The model's context length in tokens: prompt and completion
    /// together (vLLM's field).
    pub max_model_len: usize,
}

impl<'a> ModelCard<'a> {
    /// The card of `id`, served since `created`, with a context of
    /// `max_model_len` tokens.
    pub fn new(id: &'a str, created: u64, max_model_len: usize) -> Self {
        Self {
            id,
            object: "model",
            created,
            owned_by: "mlxcel",
            max_model_len,
        }
    }
}

/// The schema of a `finish_reason` of `values`, `null` too when
/// `nullable`.
pub(crate) fn finish_reason_schema(values: &[&str], nullable: bool) -> RefOr<Schema> {
    use utoipa::openapi::schema::SchemaType;
    let mut enum_values: Vec<serde_json::Value> = values.iter().map(|v| (*v).into()).collect();
    let schema_type = if nullable {
        enum_values.push(serde_json::Value::Null);
        SchemaType::from_iter([Type::String, Type::Null])
    } else {
        SchemaType::Type(Type::String)
    };
    ObjectBuilder::new()
        .schema_type(schema_type)
        .enum_values(Some(enum_values))
        .into()
}

/// The schema of a string that is always `value`.
pub(crate) fn constant(value: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some([value]))
        .into()
}

fn list_object() -> RefOr<Schema> {
    constant("list")
}

fn model_object() -> RefOr<Schema> {
    constant("model")
}

fn cache_stats_object() -> RefOr<Schema> {
    constant("cache.stats")
}

fn cache_reset_object() -> RefOr<Schema> {
    constant("cache.reset")
}

/// The body of `GET /v1/cache/stats`: the prefix cache and the KV pool
/// (sizes in blocks, tokens and bytes).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct CacheStats {
    /// Always `cache.stats`.
    #[schema(schema_with = cache_stats_object)]
    pub object: &'static str,
    /// Whether the prefix cache is on.
    pub enabled: bool,
    /// Where KV blocks live.
    pub storage_backend: String,
    /// How K/V are stored: `float32`, `float16`, `bfloat16` (the compute
    /// dtype or `--kv-cache-dtype`), `int8` or `int4` (quantized).
    pub kv_cache_dtype: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Bytes per KV block.
    pub block_bytes: usize,
    /// Tokens the KV pools hold (`blocks.total * block_size`).
    pub capacity_tokens: usize,
    /// The pool's blocks by state.
    pub blocks: BlockCounts,
    /// Cached blocks.
    pub entries: usize,
    /// Bytes of the cached blocks.
    pub bytes: usize,
    /// Most blocks the prefix cache may hold.
    pub capacity: usize,
    /// `capacity` in bytes.
    pub capacity_bytes: usize,
    /// Prefix cache lookups.
    pub lookups: u64,
    /// Lookups that reused blocks.
    pub hits: u64,
    /// Lookups that reused none.
    pub misses: u64,
    /// `hits / lookups` (0 before any lookup).
    #[schema(minimum = 0, maximum = 1)]
    pub hit_rate: f64,
    /// Prompt tokens looked up.
    pub tokens_queried: u64,
    /// Prompt tokens served from the cache.
    pub tokens_reused: u64,
    /// Blocks added to the cache.
    pub inserts: u64,
    /// Blocks evicted from the cache.
    pub evictions: u64,
    /// Requests generating now.
    pub running: usize,
    /// Requests queued.
    pub waiting: usize,
    /// The disk tier (`--prompt-cache-dir`); `null` when it is off.
    pub disk: Option<DiskCacheStats>,
    /// A hybrid model's recurrent-state snapshots (a prefix hit resumes
    /// only at a block boundary whose snapshot is kept); `null` for a model
    /// without recurrent layers.
    pub recurrent: Option<RecurrentStateStats>,
}

/// `recurrent` of [`CacheStats`]: the recurrent layers' state of a hybrid
/// model (Gated DeltaNet layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct RecurrentStateStats {
    /// Layers that keep a recurrent state instead of K/V.
    pub layers: usize,
    /// Bytes of state one sequence holds (upper bound).
    pub bytes_per_sequence: usize,
    /// State snapshots kept now for the prefix cache.
    pub snapshots: usize,
    /// The most snapshots kept (least recently used dropped first).
    pub snapshot_capacity: usize,
    /// Snapshots taken since start.
    pub snapshots_taken: u64,
    /// Snapshots dropped for room since start.
    pub snapshots_evicted: u64,
}

impl From<&mlxcel_engine_api::RecurrentStateStats> for RecurrentStateStats {
    fn from(r: &mlxcel_engine_api::RecurrentStateStats) -> Self {
        Self {
            layers: r.layers,
            bytes_per_sequence: r.bytes_per_sequence,
            snapshots: r.snapshots,
            snapshot_capacity: r.snapshot_capacity,
            snapshots_taken: r.snapshots_taken,
            snapshots_evicted: r.snapshots_evicted,
        }
    }
}

/// `disk` of [`CacheStats`]: the prefix cache's disk tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct DiskCacheStats {
    /// KV block files of this model and configuration on disk.
    pub blocks: u64,
    /// The size of block and snapshot files, in bytes.
    pub bytes: u64,
    /// The size bound (`--prompt-cache-disk-size`), in bytes.
    pub capacity_bytes: u64,
    /// Blocks read back from disk into the KV pool.
    pub hits: u64,
    /// Recurrent-state snapshot files on disk (hybrid models).
    pub snapshots: u64,
    /// Snapshots read back from disk.
    pub snapshot_hits: u64,
    /// Files written to disk (blocks and snapshots).
    pub writes: u64,
    /// Bytes written to disk.
    pub write_bytes: u64,
    /// Files removed to stay within the size bound.
    pub evictions: u64,
    /// Files skipped (and deleted): corrupt, truncated, foreign header or
    /// unreadable.
    pub skipped: u64,
    /// Files of another model or configuration in the directory at start
    /// (left alone).
    pub foreign: u64,
    /// Writes that failed; the first one turns writes off (RAM only).
    pub write_errors: u64,
    /// Whether writes are on.
    pub writable: bool,
}

impl From<&mlxcel_engine_api::DiskCacheStats> for DiskCacheStats {
    fn from(d: &mlxcel_engine_api::DiskCacheStats) -> Self {
        Self {
            blocks: d.blocks,
            bytes: d.bytes,
            capacity_bytes: d.capacity_bytes,
            hits: d.hits,
            snapshots: d.snapshots,
            snapshot_hits: d.snapshot_hits,
            writes: d.writes,
            write_bytes: d.write_bytes,
            evictions: d.evictions,
            skipped: d.skipped,
            foreign: d.foreign,
            write_errors: d.write_errors,
            writable: d.writable,
        }
    }
}

/// `blocks` of [`CacheStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct BlockCounts {
    /// Blocks in the pool.
    pub total: usize,
    /// Held by requests or the cache.
    pub used: usize,
    /// Free.
    pub free: usize,
    /// Held by the prefix cache.
    pub cached: usize,
    /// Held by requests.
    pub active: usize,
}

impl From<&mlxcel_engine_api::EngineStats> for CacheStats {
    fn from(s: &mlxcel_engine_api::EngineStats) -> Self {
        let hit_rate = if s.prefix_cache_lookups == 0 {
            0.0
        } else {
            s.prefix_cache_hits as f64 / s.prefix_cache_lookups as f64
        };
        Self {
            object: "cache.stats",
            enabled: s.prefix_cache_enabled,
            storage_backend: s.kv_storage_backend.clone(),
            kv_cache_dtype: s.kv_cache_dtype.clone(),
            block_size: s.kv_block_size,
            block_bytes: s.kv_block_bytes,
            capacity_tokens: s.kv_blocks_total * s.kv_block_size,
            blocks: BlockCounts {
                total: s.kv_blocks_total,
                used: s.kv_blocks_used,
                free: s.kv_blocks_free,
                cached: s.kv_blocks_cached,
                active: s.kv_blocks_active,
            },
            entries: s.kv_blocks_cached,
            bytes: s.kv_blocks_cached * s.kv_block_bytes,
            capacity: s.prefix_cache_capacity_blocks,
            capacity_bytes: s.prefix_cache_capacity_blocks * s.kv_block_bytes,
            lookups: s.prefix_cache_lookups,
            hits: s.prefix_cache_hits,
            misses: s.prefix_cache_misses,
            hit_rate,
            tokens_queried: s.prefix_cache_tokens_queried,
            tokens_reused: s.prefix_cache_tokens_reused,
            inserts: s.prefix_cache_inserts,
            evictions: s.prefix_cache_evictions,
            running: s.running,
            waiting: s.waiting,
            disk: s.disk.as_ref().map(DiskCacheStats::from),
            recurrent: s.recurrent.as_ref().map(RecurrentStateStats::from),
        }
    }
}

/// The body of `POST /v1/cache/reset`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct CacheReset {
    /// Always `cache.reset`.
    #[schema(schema_with = cache_reset_object)]
    pub object: &'static str,
    /// Blocks freed.
    pub blocks_freed: usize,
    /// Bytes freed.
    pub bytes_freed: usize,
    /// Block files deleted from the disk tier (0 when it is off or kept).
    pub disk_blocks_freed: u64,
    /// Their size in bytes.
    pub disk_bytes_freed: u64,
    /// The statistics after the reset.
    pub stats: CacheStats,
}

/// The optional body of `POST /v1/cache/reset` (other fields are
/// ignored, as the route took no body before).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, ToSchema)]
pub struct CacheResetRequest {
    /// Keep the disk tier's block files (default false: they are deleted
    /// too).
    #[serde(default)]
    pub keep_disk: bool,
}

impl CacheResetRequest {
    /// Reads an optional body: empty (or only whitespace) is the default.
    ///
    /// # Errors
    /// A body that is not such a JSON object ([`crate::error::ApiError::MalformedJson`]).
    pub fn parse(body: &[u8]) -> Result<Self, crate::error::ApiError> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        serde_json::from_slice(body)
            .map_err(|e| crate::error::ApiError::MalformedJson(e.to_string()))
    }
}

/// The body of `GET /health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct Health {
    /// `ok` once the engine serves, `starting` before, `unhealthy` when it
    /// can no longer serve (a tensor-parallel rank died).
    pub status: HealthStatus,
}

/// [`Health`]'s `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum HealthStatus {
    /// The engine serves requests.
    Ok,
    /// The model is loading or warming up.
    Starting,
    /// The engine can no longer serve: e.g. a rank of a tensor-parallel
    /// group died or stopped answering (docs/distributed.md).
    Unhealthy,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// One envelope, four objects: whole and chunked, chat and text.
    #[test]
    fn the_envelope_of_each_object() {
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_tokens: 1,
        };
        let usage_body = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                "prompt_tokens_details": {"cached_tokens": 1}});
        for (meta, whole, chunk) in [
            (
                CompletionMeta::chat("m"),
                "chat.completion",
                "chat.completion.chunk",
            ),
            (
                CompletionMeta::text("m"),
                "text_completion",
                "text_completion",
            ),
        ] {
            assert!(meta.id.starts_with(meta.kind.id_prefix()));
            let envelope = |value: serde_json::Value| {
                let mut expected = json!({"id": meta.id, "created": meta.created, "model": "m"});
                for (k, v) in value.as_object().unwrap() {
                    expected[k] = v.clone();
                }
                expected
            };
            let value = |c: &Completion<'_, u8>| serde_json::to_value(c).unwrap();
            assert_eq!(
                value(&Completion::answer(&meta, vec![7], usage)),
                envelope(json!({"object": whole, "choices": [7], "usage": usage_body}))
            );
            assert_eq!(
                value(&Completion::chunk(&meta, vec![7], true)),
                envelope(json!({"object": chunk, "choices": [7], "usage": null}))
            );
            assert_eq!(
                value(&Completion::chunk(&meta, vec![7], false)),
                envelope(json!({"object": chunk, "choices": [7]}))
            );
            assert_eq!(
                value(&Completion::usage_chunk(&meta, usage)),
                envelope(json!({"object": chunk, "choices": [], "usage": usage_body}))
            );
        }
    }
}
