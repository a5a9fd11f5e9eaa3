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

use mlxcel_kv::{GroupAdmission, KvCache, KvSequence};
use mlxcel_model::AttentionPath;
use mlxcel_text::constraint::ConstrainedDecoder;
use mlxcel_text::detokenizer::IncrementalDetokenizer;
use mlxcel_text::output::OutputFilter;
use mlxcel_text::reasoning::ReasoningSplitter;
use mlxcel_text::Text;
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{CacheReset, EngineStats, GenerationEvent, GenerationRequest, Timings, Usage};
use crate::error::StepError;
use crate::logits::LogitsProcessor;
use crate::runner::{InFlight, StepRunner};

mod emit;
mod pipeline;
mod step;
use crate::sampler::Sampler;
use crate::scheduler::SchedulerConfig;

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
    /// `Some(open)`: the reply's `<think>` block is split off as reasoning;
    /// `open` when the prompt already opened it.
    pub(crate) reasoning: Option<bool>,
}

/// How a job's output filter reads tool calls.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolCallOutput {
    /// No tools offered (or `tool_choice: "none"`): text only.
    Off,
    /// Calls of the offered functions are parsed out of free text.
    Parsed,
    /// A forced reply whose start, this prefix
    /// ([`mlxcel_text::output::forced_call_prefix`]), ends the prompt.
    Forced(String),
}

impl Job {
    /// A fresh output filter for one of its choices.
    fn output_filter(&self) -> OutputFilter {
        let names =
            || -> Vec<String> { self.request.tools.iter().map(|t| t.name.clone()).collect() };
        let filter = match &self.tool_calls {
            ToolCallOutput::Off => OutputFilter::new(&self.request.stop, &[]),
            ToolCallOutput::Parsed => OutputFilter::new(&self.request.stop, &names()),
            ToolCallOutput::Forced(prefix) => {
                OutputFilter::forced(&self.request.stop, &names(), prefix)
            }
        };
        match self.reasoning {
            Some(open) => filter.with_reasoning(ReasoningSplitter::new(open)),
            None => filter,
        }
    }
}

/// What the handle sends the engine thread.
pub(crate) enum Message {
    /// A request to run.
    Job(Box<Job>),
    /// Free unreferenced prefix-cache blocks; the outcome goes back.
    ResetPrefixCache(mpsc::Sender<CacheReset>),
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
    /// previous step's tokens (see `worker/step.rs`).
    pub(crate) pipeline: bool,
    /// Test-only: make chosen forwards fail.
    #[cfg(feature = "fault-injection")]
    pub(crate) fault: crate::fault::FaultInjection,
}

/// One running choice of a request.
struct Sequence {
    id: u64,
    /// Shared by the request's choices.
    job: Arc<Job>,
    /// The choice (0..n).
    index: usize,
    /// Choice 0 before its first token: the other choices, forked from it
    /// once the prompt is computed (they share its blocks).
    forks: Vec<Fork>,
    kv: KvSequence,
    /// Prompt then sampled tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V is cached.
    computed: usize,
    /// Blocks it may need by its last token, per KV group.
    worst_blocks: Vec<usize>,
    sampler: Sampler,
    processor: LogitsProcessor,
    constraint: Option<ConstrainedDecoder>,
    detok: IncrementalDetokenizer,
    filter: OutputFilter,
    usage: Usage,
    timings: Timings,
    first_token_at: Option<Instant>,
    /// Prompt logprobs found so far (requests with `prompt_logprobs`),
    /// sent once the prompt is computed.
    prompt_logprobs: Vec<crate::api::SampledLogprobs>,
    span: tracing::Span,
}

impl Sequence {
    /// How many of the `real` tokens a row runs from `computed` on are
    /// scored (their next token is a prompt token): none unless the
    /// request wants prompt logprobs.
    fn scored_in_row(&self, real: usize) -> usize {
        if self.job.request.prompt_logprobs.is_none() {
            return 0;
        }
        let last_scored = self.job.prompt.len().saturating_sub(1);
        (self.computed + real)
            .min(last_scored)
            .saturating_sub(self.computed)
    }
}

impl Sequence {
    /// Whether its next token can be sampled on the device: a greedy
    /// choice with no logit processors, grammar, logprobs or choices still
    /// to fork (each of those needs the logits row on the host).
    fn samples_on_device(&self) -> bool {
        self.forks.is_empty()
            && self.sampler.is_greedy()
            && self.processor.is_noop()
            && self.constraint.is_none()
            && self.job.request.logprobs.is_none()
    }
}

/// How a sampling row's next token reaches [`Worker::emit`].
#[derive(Debug, Clone, Copy)]
enum NextToken<'a> {
    /// Sampled on the device.
    Sampled(u32),
    /// Float32 logits `[vocab]` to process and sample on the host.
    Logits(&'a [f32]),
}

/// A choice still to fork from choice 0.
struct Fork {
    index: usize,
    constraint: Option<ConstrainedDecoder>,
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
        text: &'m Text,
        kv: KvCache,
        config: WorkerConfig,
        published: Arc<Mutex<EngineStats>>,
    ) -> Self {
        let counters = EngineStats {
            kv_storage_backend: kv.config().backend.to_string(),
            kv_block_size: kv.config().block_size,
            ..EngineStats::default()
        };
        let mut w = Worker {
            runner,
            text,
            kv,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            done: Vec::new(),
            inflight: None,
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
        // Dropping the runner tells a tensor-parallel group's other ranks
        // to stop.
        tracing::info!("engine thread stopping");
    }

    fn handle(&mut self, message: Message) {
        match message {
            Message::Job(job) => self.waiting.push_back(*job),
            Message::ResetPrefixCache(reply) => {
                self.reclaim();
                let r = self.kv.reset_prefix_cache();
                tracing::info!(blocks_freed = r.blocks_freed, "prefix cache reset");
                // Stats first: whoever gets the reply reads them next.
                self.publish();
                let _ = reply.send(CacheReset {
                    blocks_freed: r.blocks_freed,
                    bytes_freed: r.bytes_freed,
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
    }

    /// Admits waiting requests, in order, while a slot is free and the pool
    /// can hold each to its last token on top of what running ones may
    /// still take. A request that doesn't fit waits (and so do later ones).
    fn admit(&mut self) {
        let rule = self.config.admission(&self.kv);
        while let Some(job) = self.waiting.front() {
            // Choices still to fork hold their slots already.
            let slots: usize = self.running.iter().map(|s| 1 + s.forks.len()).sum();
            if slots + job.request.n.max(1) > self.config.parallel {
                break;
            }
            let need: Vec<usize> = rule
                .request(job.prompt.len(), job.request.max_tokens, job.request.n)
                .iter()
                .map(|r| r.total)
                .collect();
            let running = self
                .running
                .iter()
                .map(|s| (&s.kv, s.worst_blocks.as_slice()));
            if !self.kv.fits(&need, running) {
                break;
            }
            let Some(job) = self.waiting.pop_front() else {
                break;
            };
            match self.new_sequence(job, need) {
                Ok(seq) => self.running.push(seq),
                Err((job, e)) => {
                    tracing::error!(error = %e, "prefix lookup failed");
                    let _ = job.events.send(StepError::from(e).event());
                }
            }
        }
    }

    /// Choice 0 of `job`, its prompt prefix taken from the prefix cache
    /// unless the request opted out; the other choices wait in its `forks`.
    /// `worst_blocks` covers every choice.
    #[allow(clippy::result_large_err)]
    fn new_sequence(
        &mut self,
        mut job: Job,
        worst_blocks: Vec<usize>,
    ) -> Result<Sequence, (Job, mlxcel_kv::KvError)> {
        // A scored prompt is computed whole: cached tokens have no logits.
        let (kv, cached) = if job.request.cache_prompt && job.request.prompt_logprobs.is_none() {
            // Each KV group starts where a cold run is at the last chunk
            // boundary (`KvCache::new_sequence_for_prompt_chunked`).
            let chunk = self.config.scheduler.prefill_chunk_size;
            match self.kv.new_sequence_for_prompt_chunked(&job.prompt, chunk) {
                Ok(found) => found,
                Err(e) => return Err((job, e)),
            }
        } else {
            (self.kv.new_sequence(), 0)
        };
        let mut constraints = std::mem::take(&mut job.constraints).into_iter();
        let first = constraints.next();
        let forks = (1..job.request.n.max(1))
            .map(|index| Fork {
                index,
                constraint: constraints.next(),
            })
            .collect();
        let id = self.next_id;
        self.next_id += 1;
        let span = tracing::info_span!(
            "request",
            id,
            prompt_tokens = job.prompt.len(),
            cached_tokens = cached
        );
        Ok(Sequence {
            id,
            kv,
            tokens: job.prompt.clone(),
            computed: cached,
            worst_blocks,
            sampler: Sampler::new(&job.request.sampling),
            processor: LogitsProcessor::new(
                &job.request.sampling,
                &job.request.logit_bias,
                &job.prompt,
            )
            .with_min_tokens(job.request.min_tokens, &self.text.eos),
            constraint: first,
            detok: IncrementalDetokenizer::new(),
            filter: job.output_filter(),
            usage: Usage {
                prompt_tokens: job.prompt.len(),
                completion_tokens: 0,
                cached_tokens: cached,
            },
            timings: Timings::default(),
            first_token_at: None,
            prompt_logprobs: Vec::new(),
            span,
            index: 0,
            forks,
            job: Arc::new(job),
        })
    }

    /// Forks choice 0 (at `seq`, its prompt just computed) into the
    /// request's other choices; returns their indices in `running`. Each
    /// shares its blocks and samples from the same logits with its own
    /// generator (the seed on ChaCha stream `index`).
    fn fork_choices(&mut self, seq: usize) -> Result<Vec<usize>, StepError> {
        let forks = std::mem::take(&mut self.running[seq].forks);
        let mut children = Vec::with_capacity(forks.len());
        let (prompt, max_tokens) = {
            let job = &self.running[seq].job;
            (job.prompt.len(), job.request.max_tokens)
        };
        // Each child may hold `own` blocks beyond the prompt's; choice 0
        // now promises only its own tokens.
        let rule = self
            .config
            .admission(&self.kv)
            .request(prompt, max_tokens, 1);
        let parent_worst: Vec<usize> = rule.iter().map(|r| r.total).collect();
        let own: Vec<usize> = rule.iter().map(|r| r.per_extra_choice).collect();
        for fork in forks {
            let parent = &self.running[seq];
            let kv = self.kv.fork(&parent.kv)?;
            let held = self.kv.group_blocks_held(&kv)?;
            let id = self.next_id;
            self.next_id += 1;
            let span = tracing::info_span!(parent: &parent.span, "choice", index = fork.index);
            let child = Sequence {
                id,
                job: Arc::clone(&parent.job),
                index: fork.index,
                forks: Vec::new(),
                kv,
                tokens: parent.tokens.clone(),
                computed: parent.computed,
                worst_blocks: held.iter().zip(&own).map(|(h, o)| h + o).collect(),
                sampler: Sampler::new(&parent.job.request.sampling).with_stream(fork.index as u64),
                processor: parent.processor.clone(),
                constraint: fork.constraint,
                detok: IncrementalDetokenizer::new(),
                filter: parent.job.output_filter(),
                usage: parent.usage,
                timings: parent.timings,
                first_token_at: None,
                prompt_logprobs: Vec::new(),
                span,
            };
            children.push(child);
        }
        // All or none: a failed fork drops the children made so far.
        let first = self.running.len();
        self.running.extend(children);
        self.running[seq].worst_blocks = parent_worst;
        Ok((first..self.running.len()).collect())
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
