//! The engine thread's loop: admit, plan, run one forward, sample, stream.
//!
//! A step (ARCHITECTURE.md, crates/engine): take new requests off the queue,
//! drop the ones whose client went away, give released blocks back, admit
//! waiting requests the pool can hold to completion, plan the rows
//! ([`crate::scheduler`]), reserve their positions, run the forward, rewind
//! pad tokens, sample, stream deltas, and finish requests. A failing or
//! panicking step fails only its rows' requests; their blocks return.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use mlxcel_kv::{KvCache, KvSequence, RowReserve, StorageBackend};
use mlxcel_model::{AttentionPath, Model, StepRow};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{
    CacheReset, EngineStats, FinishReason, GenerationEvent, GenerationRequest, Timings, Usage,
};
use crate::detokenizer::IncrementalDetokenizer;
use crate::sampler::Sampler;
use crate::scheduler::{
    plan_step, worst_case_blocks, PlannedRow, SchedulerConfig, SeqProgress, StepPlan,
};
use crate::Text;

/// One queued request, tokenized and validated by the handle.
pub(crate) struct Job {
    pub(crate) prompt: Vec<u32>,
    pub(crate) request: GenerationRequest,
    pub(crate) submitted: Instant,
    pub(crate) events: UnboundedSender<GenerationEvent>,
}

/// What the handle sends the engine thread.
pub(crate) enum Message {
    /// A request to run.
    Job(Job),
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
    /// Most K/V tokens a sequence keeps (`--max-kv-size`, or the model's
    /// sliding window): older ones are dropped from the front.
    pub(crate) max_kv_size: Option<usize>,
    /// Test-only: make chosen forwards fail.
    #[cfg(feature = "fault-injection")]
    pub(crate) fault: crate::fault::FaultInjection,
}

/// A running request.
struct Sequence {
    id: u64,
    job: Job,
    kv: KvSequence,
    /// Prompt then sampled tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V is cached.
    computed: usize,
    /// Blocks it may need by its last token.
    worst_blocks: usize,
    sampler: Sampler,
    detok: IncrementalDetokenizer,
    usage: Usage,
    timings: Timings,
    first_token_at: Option<Instant>,
    span: tracing::Span,
}

/// What happened to a sequence after its token was emitted.
enum Emitted {
    Continue,
    Finished,
    Cancelled,
}

/// The engine thread's state.
pub(crate) struct Worker<'m> {
    model: &'m dyn Model,
    text: &'m Text,
    kv: KvCache,
    config: WorkerConfig,
    waiting: VecDeque<Job>,
    running: Vec<Sequence>,
    next_id: u64,
    /// Ids of the sequences that ended during the step being run.
    done: Vec<u64>,
    counters: EngineStats,
    published: Arc<Mutex<EngineStats>>,
}

impl<'m> Worker<'m> {
    pub(crate) fn new(
        model: &'m dyn Model,
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
            model,
            text,
            kv,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            done: Vec::new(),
            counters,
            published,
        };
        w.publish();
        w
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
            self.reclaim();
            self.admit();
            if !self.running.is_empty() {
                self.guarded_step();
            }
            self.reclaim();
            self.publish();
        }
        tracing::info!("engine thread stopping");
    }

    fn handle(&mut self, message: Message) {
        match message {
            Message::Job(job) => self.waiting.push_back(job),
            Message::ResetPrefixCache(reply) => {
                self.reclaim();
                let r = self.kv.reset_prefix_cache();
                tracing::info!(blocks_freed = r.blocks_freed, "prefix cache reset");
                let _ = reply.send(CacheReset {
                    blocks_freed: r.blocks_freed,
                    bytes_freed: r.bytes_freed,
                });
                self.publish();
            }
        }
    }

    /// Plans and runs one step. A forward that fails (an error or a panic)
    /// over several rows is retried row by row, so only the rows that also
    /// fail alone fail: a poisoned request can't take its batch-mates down.
    fn guarded_step(&mut self) {
        let plan = self.plan();
        if plan.rows.is_empty() {
            return;
        }
        match self.guarded_forward(&plan) {
            Ok(logits) => self.after_forward(&plan, &logits),
            Err(message) => {
                self.counters.failed_steps += 1;
                tracing::error!(error = %message, rows = plan.rows.len(), "step failed");
                if let [row] = plan.rows[..] {
                    self.fail(row.seq, &message);
                } else {
                    self.isolate(&plan);
                }
            }
        }
        self.remove_done();
    }

    /// Re-runs each row of a failed step alone.
    fn isolate(&mut self, plan: &StepPlan) {
        for row in &plan.rows {
            let single = StepPlan { rows: vec![*row] };
            match self.guarded_forward(&single) {
                Ok(logits) => self.after_forward(&single, &logits),
                Err(message) => {
                    self.counters.failed_steps += 1;
                    tracing::error!(error = %message, "row failed alone");
                    self.fail(row.seq, &message);
                }
            }
        }
    }

    fn plan(&self) -> StepPlan {
        let progress: Vec<SeqProgress> = self
            .running
            .iter()
            .map(|s| SeqProgress {
                known: s.tokens.len(),
                computed: s.computed,
            })
            .collect();
        plan_step(&progress, self.config.scheduler)
    }

    /// [`Worker::forward`] with panics caught; on any failure every row's
    /// cache is rewound to where it was before the step.
    fn guarded_forward(&mut self, plan: &StepPlan) -> Result<Vec<f32>, String> {
        let ends: Vec<usize> = plan
            .rows
            .iter()
            .map(|r| self.running[r.seq].computed)
            .collect();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.forward(plan)));
        let result =
            outcome.unwrap_or_else(|p| Err(format!("internal error: {}", panic_message(&p))));
        if result.is_err() {
            for (r, &end) in plan.rows.iter().zip(&ends) {
                let kv = &self.running[r.seq].kv;
                if self.kv.end(kv).is_ok_and(|e| e > end) {
                    if let Err(e) = self.kv.truncate_tail(kv, end) {
                        tracing::error!(error = %e, "rewinding a failed step");
                    }
                }
            }
        }
        result
    }

    /// Marks `seq` failed: its client gets the error; it leaves at the end of
    /// the step (its blocks return).
    fn fail(&mut self, seq: usize, message: &str) {
        let s = &self.running[seq];
        let _ = s.job.events.send(GenerationEvent::Failed {
            message: message.to_owned(),
        });
        self.done.push(s.id);
    }

    fn remove_done(&mut self) {
        let done = std::mem::take(&mut self.done);
        self.running.retain(|s| !done.contains(&s.id));
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
        let bs = self.kv.config().block_size;
        let tile = self.config.scheduler.prefill_tile;
        while self.running.len() < self.config.parallel {
            let Some(job) = self.waiting.front() else {
                break;
            };
            let need = self.worst_blocks(job.prompt.len() + job.request.max_tokens, bs, tile);
            let promised: usize = self
                .running
                .iter()
                .map(|s| {
                    let held = self.kv.blocks_held(&s.kv).unwrap_or(s.worst_blocks);
                    s.worst_blocks.saturating_sub(held)
                })
                .sum();
            if self.kv.pool().free_blocks() < promised + need {
                break;
            }
            let Some(job) = self.waiting.pop_front() else {
                break;
            };
            match self.new_sequence(job, need) {
                Ok(seq) => self.running.push(seq),
                Err((job, e)) => {
                    tracing::error!(error = %e, "prefix lookup failed");
                    let _ = job.events.send(GenerationEvent::Failed {
                        message: e.to_string(),
                    });
                }
            }
        }
    }

    /// Blocks a request of `tokens` (prompt + max completion) may hold at
    /// once: all of them, or with a KV window, the window plus one chunk
    /// (and one more block, as the window starts mid-block).
    fn worst_blocks(&self, tokens: usize, bs: usize, tile: usize) -> usize {
        let held = match self.config.max_kv_size {
            Some(max) => tokens.min(max + self.config.scheduler.prefill_chunk_size) + bs,
            None => tokens,
        };
        worst_case_blocks(held, bs, tile)
    }

    /// A running sequence for `job`, its prompt prefix taken from the prefix
    /// cache unless the request opted out.
    #[allow(clippy::result_large_err)]
    fn new_sequence(
        &mut self,
        job: Job,
        worst_blocks: usize,
    ) -> Result<Sequence, (Job, mlxcel_kv::KvError)> {
        let (kv, cached) = if job.request.cache_prompt {
            match self.kv.new_sequence_for_prompt(&job.prompt) {
                Ok(found) => found,
                Err(e) => return Err((job, e)),
            }
        } else {
            (self.kv.new_sequence(), 0)
        };
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
            detok: IncrementalDetokenizer::new(),
            usage: Usage {
                prompt_tokens: job.prompt.len(),
                completion_tokens: 0,
                cached_tokens: cached,
            },
            timings: Timings::default(),
            first_token_at: None,
            span,
            job,
        })
    }

    /// Everything after a successful forward: the rows' computed tokens,
    /// prefix-cache donation, the `--max-kv-size` window, invariant checks,
    /// then sampling and streaming. A failure here fails only its row.
    fn after_forward(&mut self, plan: &StepPlan, logits: &[f32]) {
        self.count(plan);
        for r in &plan.rows {
            if let Err(message) = self.advance(r) {
                tracing::error!(error = %message, "row failed after its forward");
                self.fail(r.seq, &message);
            }
        }
        self.sample_and_emit(plan, logits);
    }

    /// Moves row `r`'s sequence past its computed tokens.
    fn advance(&mut self, r: &PlannedRow) -> Result<(), String> {
        let s = &mut self.running[r.seq];
        s.computed += r.real;
        let kv = &mut self.kv;
        if s.job.request.cache_prompt {
            // Full blocks become hittable as soon as they are computed.
            kv.donate(&s.kv, &s.tokens[..s.computed])
                .map_err(|e| e.to_string())?;
        }
        if let Some(max) = self.config.max_kv_size {
            let (start, end) = (kv.start(&s.kv), kv.end(&s.kv));
            let (start, end) = (
                start.map_err(|e| e.to_string())?,
                end.map_err(|e| e.to_string())?,
            );
            if end - start > max {
                kv.drop_front(&s.kv, end - max).map_err(|e| e.to_string())?;
            }
        }
        if self.config.check_invariants {
            kv.check(&s.kv).map_err(|e| e.to_string())?;
            let end = kv.end(&s.kv).map_err(|e| e.to_string())?;
            if end != s.computed {
                return Err(format!("cache end {end} != computed {}", s.computed));
            }
        }
        Ok(())
    }

    /// Reserves, runs and completes the step's forward; float32 logits of
    /// the sampling rows, `[rows * vocab]`, on the host.
    fn forward(&mut self, plan: &StepPlan) -> Result<Vec<f32>, String> {
        let started = Instant::now();
        let reserve: Vec<RowReserve<'_>> = plan
            .rows
            .iter()
            .map(|r| RowReserve {
                seq: &self.running[r.seq].kv,
                real: r.real,
                padded: r.padded,
            })
            .collect();
        let reservation = self.kv.reserve_step(&reserve).map_err(|e| e.to_string())?;
        let inputs: Vec<Vec<u32>> = plan
            .rows
            .iter()
            .map(|r| {
                let s = &self.running[r.seq];
                let mut t = s.tokens[s.computed..s.computed + r.real].to_vec();
                // Pad with the last real token (any id works: pads are
                // masked from real queries and rewound).
                let last = *t.last().unwrap_or(&0);
                t.resize(r.padded, last);
                t
            })
            .collect();
        let rows: Vec<StepRow<'_>> = plan
            .rows
            .iter()
            .zip(&inputs)
            .map(|(r, t)| StepRow {
                tokens: t,
                logits_at: r.sample.then(|| r.real - 1),
            })
            .collect();
        #[cfg(feature = "fault-injection")]
        self.config.fault.check(&inputs)?;
        let path = match self.kv.config().backend {
            StorageBackend::Paged => self.config.attention_path,
            StorageBackend::Dense => AttentionPath::PerRow,
        };
        let result = {
            let kv_rows: Vec<(&KvSequence, usize)> = plan
                .rows
                .iter()
                .map(|r| (&self.running[r.seq].kv, r.padded))
                .collect();
            let mut view = self.kv.step(&kv_rows).map_err(|e| e.to_string())?;
            self.model
                .forward(&rows, &mut view, path)
                .and_then(|l| Ok(l.to_vec_f32()?))
        };
        self.kv
            .complete_step(reservation, result.is_ok())
            .map_err(|e| e.to_string())?;
        let elapsed = started.elapsed().as_secs_f64();
        tracing::debug!(
            rows = plan.rows.len(),
            decode_rows = plan.decode_rows(),
            prefill_tokens = plan.prefill_tokens(),
            ok = result.is_ok(),
            ms = elapsed * 1e3,
            "step"
        );
        for r in plan.rows.iter().filter(|r| r.padded > 1) {
            self.running[r.seq].timings.prefill_s += elapsed;
        }
        if path == AttentionPath::BatchedDecode && plan.decode_rows() > 0 {
            self.counters.attention_batched_rows += plan.decode_rows() as u64;
        } else {
            self.counters.attention_per_row_rows += plan.decode_rows() as u64;
        }
        result.map_err(|e| e.to_string())
    }

    fn count(&mut self, plan: &StepPlan) {
        let c = &mut self.counters;
        c.steps += 1;
        let decode = plan.decode_rows();
        let prefill = plan.prefill_tokens();
        c.decode_steps += u64::from(decode > 0);
        c.prefill_steps += u64::from(prefill > 0);
        c.decode_tokens += decode as u64;
        c.prefill_tokens += prefill as u64;
        c.pad_tokens += plan
            .rows
            .iter()
            .map(|r| (r.padded - r.real) as u64)
            .sum::<u64>();
    }

    /// Samples each sampling row's next token and streams it; finishes and
    /// removes sequences that are done or whose client left.
    fn sample_and_emit(&mut self, plan: &StepPlan, logits: &[f32]) {
        let sampling: Vec<usize> = plan
            .rows
            .iter()
            .filter(|r| r.sample)
            .map(|r| r.seq)
            .collect();
        if sampling.is_empty() {
            return;
        }
        let vocab = logits.len() / sampling.len();
        for (i, &seq) in sampling.iter().enumerate() {
            if self.done.contains(&self.running[seq].id) {
                continue;
            }
            let row = &logits[i * vocab..(i + 1) * vocab];
            match self.emit(seq, row) {
                Ok(Emitted::Continue) => {}
                Ok(Emitted::Finished | Emitted::Cancelled) => self.done.push(self.running[seq].id),
                Err(message) => self.fail(seq, &message),
            }
        }
    }

    fn emit(&mut self, seq: usize, logits: &[f32]) -> Result<Emitted, String> {
        let eos = &self.text.eos;
        let tokenizer = &self.text.tokenizer;
        let s = &mut self.running[seq];
        let _enter = s.span.enter();
        let token = s.sampler.sample(logits);
        s.tokens.push(token);
        s.usage.completion_tokens += 1;
        let now = Instant::now();
        if s.first_token_at.is_none() {
            s.first_token_at = Some(now);
            s.timings.time_to_first_token_s = (now - s.job.submitted).as_secs_f64();
        }
        let is_eos = !s.job.request.ignore_eos && eos.contains(&token);
        let finish = if is_eos {
            Some(FinishReason::Stop)
        } else if s.usage.completion_tokens >= s.job.request.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        // The EOS token is not text; on the last token, whatever the
        // detokenizer held back goes out with it.
        let mut delta = if is_eos {
            String::new()
        } else {
            s.detok.push(tokenizer, token).map_err(|e| e.to_string())?
        };
        if finish.is_some() {
            delta.push_str(&s.detok.flush(tokenizer).map_err(|e| e.to_string())?);
        }
        let event = GenerationEvent::Delta { token, text: delta };
        if (!is_eos || matches!(&event, GenerationEvent::Delta { text, .. } if !text.is_empty()))
            && s.job.events.send(event).is_err()
        {
            tracing::info!("client went away; request cancelled");
            return Ok(Emitted::Cancelled);
        }
        let Some(reason) = finish else {
            return Ok(Emitted::Continue);
        };
        if let Some(t0) = s.first_token_at {
            s.timings.decode_s = t0.elapsed().as_secs_f64();
        }
        tracing::info!(
            completion_tokens = s.usage.completion_tokens,
            ?reason,
            ttft_s = s.timings.time_to_first_token_s,
            "request finished"
        );
        let _ = s.job.events.send(GenerationEvent::Finished {
            reason,
            usage: s.usage,
            timings: s.timings,
        });
        Ok(Emitted::Finished)
    }

    fn publish(&mut self) {
        let counts = self.kv.pool().counts();
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
        let mut out = self.published.lock().unwrap_or_else(|p| p.into_inner());
        out.clone_from(&self.counters);
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}
