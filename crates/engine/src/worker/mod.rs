//! The engine thread's loop: admit, plan, run one forward, sample, stream.
//!
//! A step (docs/architecture.md, crates/engine): take new requests off the queue,
//! drop the ones whose client went away, give released blocks back, admit
//! waiting requests the pool can hold to completion, plan the rows
//! ([`crate::scheduler`]), reserve their positions, run the forward, rewind
//! pad tokens, sample, stream deltas, and finish requests. A failing or
//! panicking step fails only its rows' requests; their blocks return.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use mlxcel_kv::{GroupAdmission, KvCache};
use mlxcel_model::AttentionPath;
use mlxcel_text::constraint::ConstrainedDecoder;
use mlxcel_text::Text;
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{CacheReset, EngineStats, GenerationEvent, GenerationRequest};
use crate::draft::Drafter;
use crate::runner::{InFlight, StepRunner};

mod admit;
mod embed;
mod emit;
mod pipeline;
mod sequence;
mod speculate;
mod step;

use crate::scheduler::SchedulerConfig;
use sequence::{NextToken, Sequence};

/// One queued request, tokenized and validated by the handle.
pub(crate) struct Job {
    pub(crate) prompt: Vec<u32>,
    pub(crate) request: GenerationRequest,
    pub(crate) submitted: Instant,
    pub(crate) events: UnboundedSender<GenerationEvent>,
    /// One grammar matcher per choice when the output is constrained
    /// (`response_format`, a required tool call), else empty.
    pub(crate) constraints: Vec<ConstrainedDecoder>,
    /// How tool calls are read out of the text.
    pub(crate) tool_calls: ToolCallOutput,
    /// `Some((markers, open))`: the reply's reasoning block between
    /// `markers` is split off as reasoning; `open` when the prompt already
    /// opened it.
    pub(crate) reasoning: Option<(mlxcel_text::reasoning::ReasoningMarkers, bool)>,
    /// Token ids that end a choice besides the model's EOS ids (a
    /// fill-in-the-middle prompt's control tokens), handled as EOS.
    pub(crate) stop_ids: Vec<u32>,
    /// `Some`: an embedding request (prefill only, its final hidden states
    /// pooled this way into one `Embedding` event; see `worker/embed.rs`).
    pub(crate) embedding: Option<mlxcel_model::pooling::Pooling>,
}

/// How a job's output filter reads tool calls.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolCallOutput {
    /// No tools offered (or `tool_choice: "none"`): text only.
    Off,
    /// Calls of the offered functions are parsed out of free text, in the
    /// format of the model's chat template.
    Parsed(mlxcel_text::output::ToolCallFormat),
    /// A harmony reply (gpt-oss) without tools: its channels are read
    /// (reasoning, content) from its text and special tokens.
    Harmony,
    /// A forced reply whose start, `prefix` (the forced prefix of
    /// `format`: [`mlxcel_text::output::forced_call_prefix`], or harmony's),
    /// ends the prompt.
    Forced {
        format: mlxcel_text::output::ToolCallFormat,
        prefix: String,
    },
}

/// What the handle sends the engine thread.
pub(crate) enum Message {
    /// A request to run.
    Job(Box<Job>),
    /// Free unreferenced prefix-cache blocks and, unless `keep_disk`, the
    /// disk tier's files; the outcome goes back.
    ResetPrefixCache {
        reply: mpsc::Sender<CacheReset>,
        keep_disk: bool,
    },
}

/// The worker's options.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkerConfig {
    pub(crate) scheduler: SchedulerConfig,
    /// Sequences running at once.
    pub(crate) parallel: usize,
    /// How decode rows read the cache (batched needs the paged backend).
    pub(crate) attention_path: AttentionPath,
    /// Check every row's KV invariants after every step (debug builds and
    /// tests).
    pub(crate) check_invariants: bool,
    /// Most K/V tokens a sequence keeps in every KV group
    /// (`--max-kv-size`); a window group keeps at most its window's (the
    /// cache trims: `KvCache::trim`).
    pub(crate) max_kv_size: Option<usize>,
    /// Queue decode steps of device-sampled rows before reading the
    /// previous step's tokens (see `worker/pipeline.rs`).
    pub(crate) pipeline: bool,
    /// Verification rows run inside the decode pipeline (see
    /// `worker/pipeline.rs`).
    pub(crate) pipelined_verification: bool,
    /// Speculative decoding ([`crate::speculative`]).
    pub(crate) speculative: crate::speculative::SpeculativeConfig,
    /// Batch-invariant execution (`--deterministic`,
    /// [`mlxcel_model::invariant`]): how matmuls chunk their rows; `None`
    /// when off.
    pub(crate) batch_invariant: Option<mlxcel_model::invariant::Chunking>,
    /// Test-only: make chosen forwards fail.
    #[cfg(feature = "fault-injection")]
    pub(crate) fault: crate::fault::FaultInjection,
}

impl WorkerConfig {
    /// How requests are charged against `kv`'s KV groups under this
    /// configuration (`mlxcel_kv::GroupAdmission`): the engine thread
    /// admits a request when its worst case is free in every group; the
    /// handle refuses or clamps requests that could never fit.
    pub(crate) fn admission(&self, kv: &KvCache) -> GroupAdmission {
        kv.admission(
            self.scheduler.prefill_tile,
            self.scheduler.prefill_chunk_size,
        )
    }
}

/// What happened to a sequence after its token was emitted.
enum Emitted {
    Continue,
    Finished,
    Cancelled,
}

/// The engine thread's state.
pub(crate) struct Worker<'m> {
    /// Runs each step's forward (`crate::runner`).
    runner: Box<dyn StepRunner + 'm>,
    /// The draft model (`--speculative draft`).
    drafter: Option<Drafter<'m>>,
    text: &'m Text,
    kv: KvCache,
    config: WorkerConfig,
    waiting: VecDeque<Job>,
    running: Vec<Sequence>,
    next_id: u64,
    /// Ids of the sequences that ended during the step being run.
    done: Vec<u64>,
    /// A pipelined decode step whose tokens are not read yet.
    inflight: Option<pipeline::Queued>,
    /// A discarded pipelined step (`worker/pipeline.rs`), kept until the
    /// step after it is built: dropping it waits for its evaluation.
    retired: Option<crate::runner::Pending>,
    /// The last pipelined step failed: the next step runs synchronously.
    pipeline_paused: bool,
    counters: EngineStats,
    published: Arc<Mutex<EngineStats>>,
}

/// The event streams of every request the engine holds (for a runner that
/// fails them itself when a step never returns).
pub(crate) struct Streams<'a> {
    running: &'a [Sequence],
    waiting: &'a VecDeque<Job>,
}

impl InFlight for Streams<'_> {
    fn streams(&self) -> Vec<UnboundedSender<GenerationEvent>> {
        self.running
            .iter()
            .map(|s| s.job.events.clone())
            .chain(self.waiting.iter().map(|j| j.events.clone()))
            .collect()
    }
}

impl<'m> Worker<'m> {
    pub(crate) fn new(
        runner: Box<dyn StepRunner + 'm>,
        drafter: Option<Drafter<'m>>,
        text: &'m Text,
        kv: KvCache,
        config: WorkerConfig,
        published: Arc<Mutex<EngineStats>>,
    ) -> Self {
        let mut config = config;
        if kv.has_recurrent_layers() && config.speculative.method.proposes() {
            tracing::warn!(
                method = %config.speculative.method,
                "speculative decoding is off: this model's recurrent layers cannot rewind \
                 rejected drafts"
            );
            config.speculative.method = crate::speculative::SpeculativeMethod::Off;
        }
        if kv.has_recurrent_layers() && kv.prefix_cache_enabled() {
            config.scheduler.snapshot_block = kv.config().block_size;
        }
        let counters = EngineStats {
            kv_storage_backend: kv.config().backend.to_string(),
            kv_cache_dtype: kv.config().layout.kv_dtype_name(),
            kv_block_size: kv.config().block_size,
            speculative_method: config.speculative.method.to_string(),
            ..EngineStats::default()
        };
        let mut w = Worker {
            runner,
            drafter,
            text,
            kv,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            done: Vec::new(),
            inflight: None,
            retired: None,
            pipeline_paused: false,
            counters,
            published,
        };
        w.publish();
        w
    }

    /// Once the runner can run no step any more (a broken tensor-parallel
    /// group), every request still here fails; returns whether it can't.
    fn fail_all_if_broken(&mut self) -> bool {
        let Err(e) = self.runner.health() else {
            return false;
        };
        let failed = e.event();
        for job in self.waiting.drain(..) {
            let _ = job.events.send(failed.clone());
        }
        for s in self.running.drain(..) {
            let _ = s.job.events.send(failed.clone());
        }
        self.inflight = None;
        self.retired = None;
        true
    }

    /// Serves `queue` until every sender is gone and no request is left.
    pub(crate) fn run(mut self, queue: &mpsc::Receiver<Message>) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match queue.recv() {
                    Ok(message) => self.handle(message),
                    Err(_) => break,
                }
            }
            while let Ok(message) = queue.try_recv() {
                self.handle(message);
            }
            self.drop_cancelled();
            if self.running.is_empty() {
                // Every sequence of a queued step left: nothing to read.
                self.inflight = None;
                self.retired = None;
            }
            if self.fail_all_if_broken() {
                self.reclaim();
                self.publish();
                continue;
            }
            self.reclaim();
            self.admit();
            if !self.running.is_empty() {
                self.guarded_step();
            }
            self.fail_all_if_broken();
            self.reclaim();
            self.publish();
        }
        // A clean stop: every cached block not on disk yet goes there, so
        // the next start is warm.
        if self.kv.disk_stats().is_some() {
            let started = Instant::now();
            let saved = self.kv.save_to_disk();
            tracing::info!(
                files = saved,
                seconds = started.elapsed().as_secs_f64(),
                "prompt cache saved to disk"
            );
        }
        // Dropping the runner tells a tensor-parallel group's other ranks
        // to stop.
        tracing::info!("engine thread stopping");
    }

    fn handle(&mut self, message: Message) {
        match message {
            Message::Job(job) => self.waiting.push_back(*job),
            Message::ResetPrefixCache { reply, keep_disk } => {
                self.reclaim();
                let r = self.kv.reset_prefix_cache();
                if let Some(d) = &mut self.drafter {
                    d.kv.reset_prefix_cache();
                }
                let (disk_blocks, disk_bytes) = if keep_disk {
                    (0, 0)
                } else {
                    self.kv.reset_disk_tier()
                };
                tracing::info!(
                    blocks_freed = r.blocks_freed,
                    disk_blocks_freed = disk_blocks,
                    "prefix cache reset"
                );
                // Stats first: whoever gets the reply reads them next.
                self.publish();
                let _ = reply.send(CacheReset {
                    blocks_freed: r.blocks_freed,
                    bytes_freed: r.bytes_freed,
                    disk_blocks_freed: disk_blocks,
                    disk_bytes_freed: disk_bytes,
                });
            }
        }
    }

    fn drop_cancelled(&mut self) {
        self.waiting.retain(|j| !j.events.is_closed());
        self.running.retain(|s| {
            let open = !s.job.events.is_closed();
            if !open {
                s.span
                    .in_scope(|| tracing::info!("client went away; request cancelled"));
            }
            open
        });
    }

    fn reclaim(&mut self) {
        if let Err(e) = self.kv.reclaim() {
            tracing::error!(error = %e, "KV reclaim failed");
        }
        if let Some(Err(e)) = self.drafter.as_mut().map(|d| d.kv.reclaim()) {
            tracing::error!(error = %e, "draft KV reclaim failed");
        }
    }

    fn publish(&mut self) {
        // Summed over KV groups (docs/architecture.md, "KV groups").
        let counts = self.kv.counts();
        let prefix = self.kv.prefix_stats();
        let c = &mut self.counters;
        c.running = self.running.len();
        c.waiting = self.waiting.len();
        c.kv_block_bytes = self.kv.block_bytes();
        c.kv_blocks_total = counts.total;
        c.kv_blocks_used = counts.used + counts.evictable;
        c.kv_blocks_free = counts.free - counts.evictable;
        c.kv_blocks_active = counts.used;
        c.kv_blocks_cached = counts.cached;
        c.prefix_cache_enabled = self.kv.prefix_cache_enabled();
        c.prefix_cache_capacity_blocks = self.kv.prefix_capacity_blocks();
        c.prefix_cache_lookups = prefix.lookups;
        c.prefix_cache_hits = prefix.hits;
        c.prefix_cache_misses = prefix.misses;
        c.prefix_cache_tokens_queried = prefix.tokens_queried;
        c.prefix_cache_tokens_reused = prefix.tokens_reused;
        c.prefix_cache_inserts = prefix.inserts;
        c.prefix_cache_evictions = prefix.evictions;
        c.disk = self.kv.disk_stats().map(|d| crate::api::DiskCacheStats {
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
        });
        let recurrent = self.kv.recurrent();
        c.recurrent = (!recurrent.layers.is_empty()).then(|| {
            let (taken, evicted) = self.kv.snapshot_counts();
            crate::api::RecurrentStateStats {
                layers: recurrent.layers.len(),
                bytes_per_sequence: recurrent.bytes_per_sequence,
                snapshots: self.kv.snapshots(),
                snapshot_capacity: recurrent.snapshots,
                snapshots_taken: taken,
                snapshots_evicted: evicted,
            }
        });
        c.kv_groups = self
            .kv
            .groups()
            .enumerate()
            .map(|(g, group)| {
                let n = self
                    .kv
                    .group_pool(g)
                    .map(|p| p.counts())
                    .unwrap_or_default();
                crate::api::KvGroupStats {
                    layers: group.layers.len(),
                    window: group.window,
                    block_bytes: self.kv.group_block_bytes(g),
                    blocks_total: n.total,
                    blocks_used: n.used + n.evictable,
                    blocks_free: n.free - n.evictable,
                    blocks_active: n.used,
                    blocks_cached: n.cached,
                }
            })
            .collect();
        let mut out = self.published.lock().unwrap_or_else(|p| p.into_inner());
        out.clone_from(&self.counters);
    }
}
