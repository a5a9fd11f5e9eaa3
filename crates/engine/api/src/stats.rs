//! The engine's counters and gauges ([`EngineStats`]) and what a
//! prefix-cache reset freed ([`CacheReset`]).

/// What `/v1/cache/reset` freed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheReset {
    /// Cached blocks nobody held, now empty.
    pub blocks_freed: usize,
    /// Their K/V size in bytes.
    pub bytes_freed: usize,
    /// Files deleted from the disk tier, blocks and recurrent-state
    /// snapshots (0 when it is off or kept).
    pub disk_blocks_freed: u64,
    /// Their size in bytes.
    pub disk_bytes_freed: u64,
}

/// The recurrent layers' state (hybrid models: Gated DeltaNet layers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecurrentStateStats {
    /// Layers that keep a recurrent state instead of K/V.
    pub layers: usize,
    /// Bytes of state one sequence holds (upper bound, float32).
    pub bytes_per_sequence: usize,
    /// Prefix-cache snapshots of the state (at block boundaries) kept now,
    /// and the most kept.
    pub snapshots: usize,
    pub snapshot_capacity: usize,
    /// Snapshots taken, and evicted for room, since start.
    pub snapshots_taken: u64,
    pub snapshots_evicted: u64,
}

/// The prefix cache's disk tier (`--prompt-cache-dir`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskCacheStats {
    /// KV block files of this model and configuration on disk.
    pub blocks: u64,
    /// Recurrent-state snapshot files of this model and configuration on
    /// disk (hybrid models).
    pub snapshots: u64,
    /// The size of both kinds of files, in bytes.
    pub bytes: u64,
    /// The size bound (`--prompt-cache-disk-size`), in bytes.
    pub capacity_bytes: u64,
    /// Blocks read back from disk into the KV pool.
    pub hits: u64,
    /// Snapshots read back from disk.
    pub snapshot_hits: u64,
    /// Files written (blocks and snapshots), and their bytes.
    pub writes: u64,
    pub write_bytes: u64,
    /// Files removed to stay within the size bound.
    pub evictions: u64,
    /// Files skipped and deleted: corrupt, truncated, foreign header,
    /// unreadable.
    pub skipped: u64,
    /// Files of another model or configuration found in the directory at
    /// start (left alone).
    pub foreign: u64,
    /// Writes that failed; the first one turns writes off.
    pub write_errors: u64,
    /// Whether writes are on.
    pub writable: bool,
}

/// A snapshot of the engine's scheduler and KV cache, updated every step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Sequences running (admitted, holding KV).
    pub running: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// `dense` or `paged`.
    pub kv_storage_backend: String,
    /// How K/V are stored (`--kv-cache-dtype`, resolved: `float16`,
    /// `int8`, ...).
    pub kv_cache_dtype: String,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Bytes of K/V per block.
    pub kv_block_bytes: usize,
    /// Blocks in the pool.
    pub kv_blocks_total: usize,
    /// Blocks holding K/V: held by a running request or by the prefix cache.
    pub kv_blocks_used: usize,
    /// Empty blocks.
    pub kv_blocks_free: usize,
    /// Blocks held by running requests.
    pub kv_blocks_active: usize,
    /// Blocks registered in the prefix cache (held or not).
    pub kv_blocks_cached: usize,
    /// Prefix cache on.
    pub prefix_cache_enabled: bool,
    /// Most unreferenced cached blocks kept.
    pub prefix_cache_capacity_blocks: usize,
    /// Prefix-cache lookups, hits (at least one block), misses.
    pub prefix_cache_lookups: u64,
    pub prefix_cache_hits: u64,
    pub prefix_cache_misses: u64,
    /// Prompt tokens looked up, and those served from the cache.
    pub prefix_cache_tokens_queried: u64,
    pub prefix_cache_tokens_reused: u64,
    /// Blocks newly cached; cached blocks evicted to reuse them.
    pub prefix_cache_inserts: u64,
    pub prefix_cache_evictions: u64,
    /// Forwards run.
    pub steps: u64,
    /// Forwards that failed (their requests failed; the engine went on).
    pub failed_steps: u64,
    /// Steps with at least one prefill row / one decode row.
    pub prefill_steps: u64,
    pub decode_steps: u64,
    /// Real prompt tokens prefilled, pad tokens run and rewound, decode
    /// tokens run.
    pub prefill_tokens: u64,
    pub pad_tokens: u64,
    pub decode_tokens: u64,
    /// Decode-row attentions by path: together over the paged pool (the
    /// paged-attention kernel, or a padded batch), or one row at a time.
    pub attention_batched_rows: u64,
    pub attention_per_row_rows: u64,
    /// Decode steps queued before the previous step's tokens were read
    /// (pipelined decode).
    pub pipelined_steps: u64,
    /// Pipelined steps with verification rows (prompt lookup verifying
    /// inside the decode pipeline), queued from the host or behind
    /// another step.
    pub pipelined_verify_steps: u64,
    /// Queued steps rolled back unread: a verification before them
    /// rejected a draft they took as kept.
    pub discarded_steps: u64,
    /// How decode rows propose draft tokens (`--speculative`: "off",
    /// "ngram", "draft").
    pub speculative_method: String,
    /// Rows that verified draft tokens (one per row and step).
    pub speculative_verifications: u64,
    /// Draft tokens proposed, and those the model agreed with (each
    /// accepted draft is one decode token more from the same forward).
    pub speculative_proposed_tokens: u64,
    pub speculative_accepted_tokens: u64,
    /// The KV cache per KV group (the layers sharing one attention
    /// window, each with its own pool), in group order; the `kv_blocks_*`
    /// fields above are their sums.
    pub kv_groups: Vec<KvGroupStats>,
    /// The prefix cache's disk tier; `None` when it is off.
    pub disk: Option<DiskCacheStats>,
    /// The recurrent layers' state; `None` for a model without.
    pub recurrent: Option<RecurrentStateStats>,
}

/// One KV group's pool ([`EngineStats::kv_groups`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvGroupStats {
    /// Model layers whose K/V the group holds.
    pub layers: usize,
    /// Their attention window in keys; `None`: full attention.
    pub window: Option<usize>,
    /// Bytes of K/V per block of this group (its layers only).
    pub block_bytes: usize,
    /// Blocks in the group's pool.
    pub blocks_total: usize,
    /// Blocks holding K/V (held by a running request or by the prefix
    /// cache).
    pub blocks_used: usize,
    /// Empty blocks.
    pub blocks_free: usize,
    /// Blocks held by running requests.
    pub blocks_active: usize,
    /// Blocks registered in the prefix cache (held or not).
    pub blocks_cached: usize,
}
