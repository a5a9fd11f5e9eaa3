//! One step of the worker: plan, guarded forward (rewind on failure,
//! row-by-row isolation), and what follows a successful forward.
//!
//! Sampling happens on the device where nothing needs the host (a greedy
//! choice without logit processors, grammar or logprobs): only the token id
//! comes back, not a `[vocab]` row of logits. Steps made only of such decode
//! rows are *pipelined* (mlx-lm's `generate_step` does the same): step n+1
//! is built from step n's tokens on the device and queued with `async_eval`
//! before step n's tokens are read, so building and encoding one step
//! overlaps the device running the other (see `docs/performance.md`).

use std::time::Instant;

use mlxcel_kv::{AttentionKv, KvSequence, RowReserve, StorageBackend};
use mlxcel_mlx::{Array, Dtype};
use mlxcel_model::profile::{self, ProfileMode};
use mlxcel_model::{AttentionPath, StepRow};

use super::{NextToken, Sampled, Worker};
use crate::api::{GenerationEvent, SampledLogprobs};
use crate::logits::log_probs;
use crate::scheduler::{plan_step, PlannedRow, SeqProgress, StepPlan};

/// A decode step queued on the device whose tokens are not read yet.
pub(super) struct Queued {
    /// The rows' sequence ids, in row order.
    ids: Vec<u64>,
    /// The sampled tokens, uint32 `[rows]`, being evaluated.
    tokens: Array,
}

impl Drop for Queued {
    /// Waits for the step's evaluation: a handle dropped unread (its rows
    /// ended) must not leave device work running behind the engine.
    fn drop(&mut self) {
        let _ = self.tokens.eval();
    }
}

/// A stand-in host token for rows whose input comes from the device.
const DEVICE_INPUT: [u32; 1] = [0];

impl Worker<'_> {
    /// Plans and runs one step. A forward that fails (an error or a panic)
    /// over several rows is retried row by row, so only the rows that also
    /// fail alone fail: a poisoned request can't take its batch-mates down.
    pub(super) fn guarded_step(&mut self) {
        if let Some(queued) = self.inflight.take() {
            self.continue_pipeline(queued);
            self.remove_done();
            profile::end_step();
            return;
        }
        let plan = self.plan();
        if plan.rows.is_empty() {
            return;
        }
        if profile::mode() != ProfileMode::Off {
            profile::begin_step(match plan.prefill_tokens() {
                0 => format!("decode x{}", plan.rows.len()),
                _ => "prefill".to_string(),
            });
        }
        if self.starts_pipeline(&plan) {
            let ids: Vec<u64> = plan.rows.iter().map(|r| self.running[r.seq].id).collect();
            match self.queue_decode(&ids, None) {
                Ok(queued) => {
                    self.inflight = Some(queued);
                    profile::end_step();
                    return;
                }
                Err(message) => {
                    tracing::warn!(error = %message, "queueing a decode step failed; running it synchronously");
                }
            }
        }
        match self.guarded_forward(&plan) {
            Ok(sampled) => {
                profile::region("engine.sample_emit", || self.after_forward(&plan, &sampled))
            }
            Err(message) => {
                self.counters.failed_steps += 1;
                tracing::error!(error = %message, rows = plan.rows.len(), "step failed");
                if self.group.as_ref().is_some_and(|g| g.check().is_err()) {
                    // The group is broken: the run loop fails every request.
                } else if let [row] = plan.rows[..] {
                    self.fail(row.seq, &message);
                } else {
                    self.isolate(&plan);
                }
            }
        }
        self.remove_done();
        profile::end_step();
    }

    /// Re-runs each row of a failed step alone.
    fn isolate(&mut self, plan: &StepPlan) {
        for row in &plan.rows {
            let single = StepPlan { rows: vec![*row] };
            match self.guarded_forward(&single) {
                Ok(sampled) => self.after_forward(&single, &sampled),
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
                scored: s.job.request.prompt_logprobs.is_some(),
            })
            .collect();
        plan_step(&progress, self.config.scheduler)
    }

    /// Whether pipelining may run for these rows at all: it is on, no KV
    /// group trims between steps (a window must be applied before the
    /// next step reads), and (tests only) no fault is being injected.
    fn pipeline_allowed(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self.config.fault.poison_token.is_some() {
            return false;
        }
        self.config.pipeline && !self.kv.trims()
    }

    /// A plan starts a pipeline when every running sequence is in it as a
    /// decode row (one token, its last known one, sampled on the device),
    /// unless the last pipelined step failed (the next step then runs
    /// synchronously, where a failing row is isolated).
    fn starts_pipeline(&self, plan: &StepPlan) -> bool {
        !self.pipeline_paused
            && self.pipeline_allowed()
            && plan.rows.len() == self.running.len()
            && plan.rows.iter().all(|r| {
                let s = &self.running[r.seq];
                r.sample && r.real == 1 && r.padded == 1 && s.samples_on_device()
            })
    }

    /// Queues the next decode step behind `queued` (when every running
    /// sequence is in it and some of its rows will still want a token after
    /// it), then reads `queued`'s tokens and streams them.
    fn continue_pipeline(&mut self, queued: Queued) {
        if profile::mode() != ProfileMode::Off {
            profile::begin_step(format!("decode x{} (pipelined)", queued.ids.len()));
        }
        let next = self.chain_after(&queued).and_then(|ids| {
            self.queue_decode(&ids, Some(&queued))
                .map_err(|e| tracing::warn!(error = %e, "queueing a decode step failed"))
                .ok()
        });
        let read = profile::region("engine.wait_tokens", || queued.tokens.to_vec_u32());
        match read {
            Ok(tokens) => {
                let ahead: Vec<u64> = next.as_ref().map(|n| n.ids.clone()).unwrap_or_default();
                profile::region("engine.sample_emit", || {
                    self.emit_queued(&queued, &tokens, &ahead)
                });
                self.inflight = next;
            }
            Err(e) => {
                // Rewind both steps; the sync path reruns the rows and
                // isolates a failing one.
                self.counters.failed_steps += 1;
                tracing::error!(error = %e, rows = queued.ids.len(), "pipelined step failed");
                self.rewind_queued(&queued);
                self.pipeline_paused = true;
            }
        }
    }

    /// The sequences of `queued` that get another pipelined step: all of
    /// them must be every running sequence (nothing else waits to compute),
    /// and a row continues only while the token in flight won't be its last.
    fn chain_after(&self, queued: &Queued) -> Option<Vec<u64>> {
        if !self.pipeline_allowed() || self.running.len() != queued.ids.len() {
            return None;
        }
        let mut ids = Vec::with_capacity(queued.ids.len());
        for &id in &queued.ids {
            let s = self.running.iter().find(|s| s.id == id)?;
            if !s.samples_on_device() {
                return None;
            }
            if s.usage.completion_tokens + 1 < s.job.request.max_tokens {
                ids.push(id);
            }
        }
        (!ids.is_empty()).then_some(ids)
    }

    /// Reserves one position for each sequence of `ids`, builds a decode
    /// step whose inputs are the sequences' last tokens (on the host), or
    /// `after`'s sampled tokens (on the device, not read yet), samples it
    /// greedily on the device and starts its evaluation.
    fn queue_decode(&mut self, ids: &[u64], after: Option<&Queued>) -> Result<Queued, String> {
        let started = Instant::now();
        let seqs: Vec<usize> = ids
            .iter()
            .map(|id| self.running.iter().position(|s| s.id == *id))
            .collect::<Option<_>>()
            .ok_or("a pipelined sequence is gone")?;
        // Everything that can fail before the positions are reserved.
        let device_ids = match after {
            None => None,
            Some(q) if q.ids == ids => Some(q.tokens.clone()),
            Some(q) => {
                let picks = ids
                    .iter()
                    .map(|id| q.ids.iter().position(|x| x == id).map(|p| p as i32))
                    .collect::<Option<Vec<i32>>>()
                    .ok_or("a pipelined row has no token in flight")?;
                let picks =
                    Array::from_i32(&picks, &[picks.len() as i32]).map_err(|e| e.to_string())?;
                Some(q.tokens.take(&picks, 0).map_err(|e| e.to_string())?)
            }
        };
        let host_inputs: Vec<[u32; 1]> = seqs
            .iter()
            .map(|&i| match after {
                Some(_) => DEVICE_INPUT,
                None => [self.running[i].tokens.last().copied().unwrap_or(0)],
            })
            .collect();
        let reserve: Vec<RowReserve<'_>> = seqs
            .iter()
            .map(|&i| RowReserve {
                seq: &self.running[i].kv,
                real: 1,
                padded: 1,
            })
            .collect();
        let reservation = self.kv.reserve_step(&reserve).map_err(|e| e.to_string())?;
        let rows: Vec<StepRow<'_>> = host_inputs
            .iter()
            .map(|t| StepRow {
                tokens: t,
                logits_at: Some(0),
                scored: 0,
            })
            .collect();
        let path = self.attention_path();
        let result = {
            let kv_rows: Vec<(&KvSequence, usize)> =
                seqs.iter().map(|&i| (&self.running[i].kv, 1)).collect();
            let model = self.model;
            let kv = &mut self.kv;
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut view = kv.step(&kv_rows)?;
                let logits = model.build_step(&rows, device_ids.as_ref(), &mut view, path)?;
                let tokens = logits.argmax(-1, false)?.astype(Dtype::Uint32)?;
                let mut outputs = vec![&tokens];
                outputs.extend(view.storage());
                mlxcel_mlx::async_eval(&outputs)?;
                drop(outputs);
                Ok::<_, mlxcel_model::ModelError>(tokens)
            }))
            .unwrap_or_else(|p| {
                Err(mlxcel_model::ModelError::Cache(format!(
                    "internal error: {}",
                    panic_message(&p)
                )))
            })
        };
        self.kv
            .complete_step(reservation, result.is_ok())
            .map_err(|e| e.to_string())?;
        profile::record("engine.queue", started);
        if result.is_ok() && after.is_some() {
            self.counters.pipelined_steps += 1;
        }
        Ok(Queued {
            ids: ids.to_vec(),
            tokens: result.map_err(|e| e.to_string())?,
        })
    }

    /// Streams the tokens of a pipelined step. Sequences that ended or left
    /// since it was queued are skipped (their positions go with their
    /// blocks); `ahead` holds the sequences with a later step queued.
    fn emit_queued(&mut self, queued: &Queued, tokens: &[u32], ahead: &[u64]) {
        let rows = queued.ids.len();
        self.count(&StepPlan {
            rows: (0..rows)
                .map(|seq| PlannedRow {
                    seq,
                    real: 1,
                    padded: 1,
                    sample: true,
                })
                .collect(),
        });
        self.count_attention_rows(self.attention_path(), rows);
        for (&id, &token) in queued.ids.iter().zip(tokens) {
            let Some(seq) = self.running.iter().position(|s| s.id == id) else {
                continue;
            };
            if self.done.contains(&id) {
                continue;
            }
            let reserved_ahead = usize::from(ahead.contains(&id));
            if let Err(message) = self.advance(seq, 1, reserved_ahead) {
                tracing::error!(error = %message, "row failed after its forward");
                self.fail(seq, &message);
                continue;
            }
            self.emit_and_record(seq, NextToken::Sampled(token));
            if reserved_ahead > 0 {
                // The emitted token is the queued step's input: every
                // position the cache holds is known now, so its full blocks
                // can be donated (the queued step's write lands before any
                // later reader, on the same stream), also when the sequence
                // just finished.
                if let Err(message) = self.donate_known(seq) {
                    tracing::error!(error = %message, "donating a pipelined row's blocks");
                }
            }
        }
    }

    /// Gives back the positions of a failed pipelined step and of any step
    /// queued behind it.
    fn rewind_queued(&mut self, queued: &Queued) {
        let seqs: Vec<usize> = queued
            .ids
            .iter()
            .filter_map(|id| self.running.iter().position(|s| s.id == *id))
            .collect();
        self.rewind_to_computed(&seqs);
    }

    /// [`Worker::forward`] with panics caught; on any failure every row's
    /// cache is rewound to where it was before the step.
    fn guarded_forward(&mut self, plan: &StepPlan) -> Result<Sampled, String> {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.forward(plan)));
        let result =
            outcome.unwrap_or_else(|p| Err(format!("internal error: {}", panic_message(&p))));
        if result.is_err() {
            let seqs: Vec<usize> = plan.rows.iter().map(|r| r.seq).collect();
            self.rewind_to_computed(&seqs);
        }
        result
    }

    /// Shrinks each sequence's cache back to its computed tokens (a failed
    /// step advanced none of them).
    fn rewind_to_computed(&mut self, seqs: &[usize]) {
        for &seq in seqs {
            let s = &self.running[seq];
            if self.kv.end(&s.kv).is_ok_and(|e| e > s.computed) {
                if let Err(e) = self.kv.truncate_tail(&s.kv, s.computed) {
                    tracing::error!(error = %e, "rewinding a failed step");
                }
            }
        }
    }

    /// Marks `seq` failed: its client gets the error; it leaves at the end of
    /// the step (its blocks return).
    pub(super) fn fail(&mut self, seq: usize, message: &str) {
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

    /// Everything after a successful forward: the rows' computed tokens,
    /// prefix-cache donation, each KV group's trim, invariant checks,
    /// then sampling and streaming. A failure here fails only its row.
    fn after_forward(&mut self, plan: &StepPlan, sampled: &Sampled) {
        self.count(plan);
        self.score_prompts(plan, sampled);
        for r in &plan.rows {
            if let Err(message) = self.advance(r.seq, r.real, 0) {
                tracing::error!(error = %message, "row failed after its forward");
                self.fail(r.seq, &message);
            }
        }
        self.sample_and_emit(plan, sampled);
    }

    /// Turns the step's scored logits rows into prompt logprobs (before the
    /// rows advance: row `r` scored the tokens from `computed` on); a
    /// sequence whose prompt is now computed sends them.
    fn score_prompts(&mut self, plan: &StepPlan, sampled: &Sampled) {
        let text = self.text;
        let total: usize = plan
            .rows
            .iter()
            .map(|r| self.running[r.seq].scored_in_row(r.real))
            .sum();
        let vocab = sampled.scored.len().checked_div(total).unwrap_or(0);
        let mut at = 0;
        for r in &plan.rows {
            let s = &mut self.running[r.seq];
            let scored = s.scored_in_row(r.real);
            if scored > 0 {
                let k = s.job.request.prompt_logprobs.unwrap_or(0);
                for j in 0..scored {
                    let Some(row) = sampled.scored.get((at + j) * vocab..(at + j + 1) * vocab)
                    else {
                        break;
                    };
                    let Some(&token) = s.job.prompt.get(s.computed + j + 1) else {
                        break;
                    };
                    let (logprob, top) = log_probs(row, token, k);
                    s.prompt_logprobs.push(SampledLogprobs {
                        token: text.token_logprob(token, logprob),
                        top: top
                            .into_iter()
                            .map(|(id, lp)| text.token_logprob(id, lp))
                            .collect(),
                    });
                }
                at += scored;
            }
            // The prompt's last chunk (not a later decode row).
            let prompt_done = r.sample && s.computed < s.job.prompt.len();
            if prompt_done && s.job.request.prompt_logprobs.is_some() {
                let logprobs = std::mem::take(&mut s.prompt_logprobs);
                let first = text.token_logprob(s.job.prompt.first().copied().unwrap_or(0), 0.0);
                let _ = s.job.events.send(GenerationEvent::PromptLogprobs {
                    index: s.index,
                    first,
                    logprobs,
                });
            }
        }
    }

    /// Moves sequence `seq` past `real` more computed tokens; `ahead`
    /// positions past them are reserved by a step already queued.
    fn advance(&mut self, seq: usize, real: usize, ahead: usize) -> Result<(), String> {
        self.running[seq].computed += real;
        // Full blocks become hittable as soon as they are computed (with a
        // step queued ahead, the token at `computed` is not known before the
        // emit: `emit_queued` donates then).
        self.donate_known(seq)?;
        let s = &self.running[seq];
        let kv = &mut self.kv;
        // Each KV group drops what fell out of its window (or past
        // `--max-kv-size`); a full group keeps everything.
        kv.trim(&s.kv).map_err(|e| e.to_string())?;
        if self.config.check_invariants {
            kv.check(&s.kv).map_err(|e| e.to_string())?;
            let end = kv.end(&s.kv).map_err(|e| e.to_string())?;
            if end != s.computed + ahead {
                return Err(format!(
                    "cache end {end} != computed {} + {ahead} queued",
                    s.computed
                ));
            }
        }
        Ok(())
    }

    /// Donates sequence `seq`'s full blocks when every position its cache
    /// holds has a known token.
    fn donate_known(&mut self, seq: usize) -> Result<(), String> {
        let s = &self.running[seq];
        let end = self.kv.end(&s.kv).map_err(|e| e.to_string())?;
        if s.job.request.cache_prompt && s.tokens.len() >= end {
            self.kv
                .donate(&s.kv, &s.tokens[..end])
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Counts `rows` decode rows under the attention path that read them.
    fn count_attention_rows(&mut self, path: AttentionPath, rows: usize) {
        match path {
            AttentionPath::BatchedDecode | AttentionPath::PagedDecode => {
                self.counters.attention_batched_rows += rows as u64
            }
            AttentionPath::PerRow => self.counters.attention_per_row_rows += rows as u64,
        }
    }

    /// How decode rows read the cache in this engine.
    fn attention_path(&self) -> AttentionPath {
        match self.kv.config().backend {
            StorageBackend::Paged => self.config.attention_path,
            StorageBackend::Dense => AttentionPath::PerRow,
        }
    }

    /// Reserves, runs and completes the step's forward: each sampling row's
    /// token, sampled on the device, or its float32 logits on the host.
    fn forward(&mut self, plan: &StepPlan) -> Result<Sampled, String> {
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
                scored: self.running[r.seq].scored_in_row(r.real),
            })
            .collect();
        // Where each sampling row's logits row is, and the scored ones.
        let mut sample_at = Vec::new();
        let mut scored_at = Vec::new();
        let mut next = 0i32;
        for row in &rows {
            scored_at.extend(next..next + row.scored as i32);
            next += row.scored as i32;
            if row.logits_at.is_some() {
                sample_at.push(next);
                next += 1;
            }
        }
        // Which sampling rows are sampled on the device.
        let on_device: Vec<bool> = plan
            .rows
            .iter()
            .filter(|r| r.sample)
            .map(|r| self.running[r.seq].samples_on_device())
            .collect();
        #[cfg(feature = "fault-injection")]
        self.config.fault.check(&inputs)?;
        let path = self.attention_path();
        // Tensor parallelism: the step's inputs for the other ranks, and
        // the requests the watchdog fails if the group stops answering.
        let group_step = match &self.group {
            None => None,
            Some(_) => {
                let kv_rows: Vec<(&KvSequence, usize)> = plan
                    .rows
                    .iter()
                    .map(|r| (&self.running[r.seq].kv, r.padded))
                    .collect();
                let mut layout = self.kv.step_layout(&kv_rows).map_err(|e| e.to_string());
                if let Ok(l) = &mut layout {
                    l.copies = self.kv.take_block_copies();
                }
                let events = self
                    .running
                    .iter()
                    .map(|s| s.job.events.clone())
                    .chain(self.waiting.iter().map(|j| j.events.clone()))
                    .collect::<Vec<_>>();
                Some((layout, events))
            }
        };
        let result = {
            let kv_rows: Vec<(&KvSequence, usize)> = plan
                .rows
                .iter()
                .map(|r| (&self.running[r.seq].kv, r.padded))
                .collect();
            let group = self.group.as_ref();
            match self.kv.step(&kv_rows) {
                Err(e) => Err(e.to_string()),
                Ok(mut view) => {
                    profile::record("engine.prepare", started);
                    self.model
                        .build_step(&rows, None, &mut view, path)
                        .map_err(|e| e.to_string())
                        .and_then(|logits| {
                            let wanted = LogitRows {
                                sample_at: &sample_at,
                                on_device: &on_device,
                                scored_at: &scored_at,
                            };
                            match (group, group_step) {
                                (Some(group), Some((layout, events))) => {
                                    // Built without error: now the other
                                    // ranks run it with this rank.
                                    let step =
                                        crate::tensor_parallel::StepPlan::new(&rows, layout?, path);
                                    group.watchdog.arm(events);
                                    let ran = group
                                        .send(&crate::tensor_parallel::Plan::Step(step))
                                        .map_err(|e| e.to_string())
                                        .and_then(|()| {
                                            sample_rows(&logits, wanted, view.storage()).map_err(
                                                |e| {
                                                    format!(
                                                        "tensor parallelism: a step failed: {e}"
                                                    )
                                                },
                                            )
                                        });
                                    group.watchdog.disarm();
                                    if let Err(e) = &ran {
                                        group.health.mark_broken(e);
                                    }
                                    ran
                                }
                                _ => sample_rows(&logits, wanted, view.storage()),
                            }
                        })
                }
            }
        };
        let completing = Instant::now();
        self.kv
            .complete_step(reservation, result.is_ok())
            .map_err(|e| e.to_string())?;
        profile::record("engine.complete_step", completing);
        let elapsed = started.elapsed().as_secs_f64();
        tracing::debug!(
            rows = plan.rows.len(),
            decode_rows = plan.decode_rows(),
            prefill_tokens = plan.prefill_tokens(),
            ok = result.is_ok(),
            ms = elapsed * 1e3,
            "step"
        );
        if result.is_ok() {
            for r in plan.rows.iter().filter(|r| r.padded > 1) {
                self.running[r.seq].timings.prefill_s += elapsed;
            }
            self.count_attention_rows(path, plan.decode_rows());
        }
        result
    }

    pub(super) fn count(&mut self, plan: &StepPlan) {
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
}

/// Which rows of a step's logits are what.
struct LogitRows<'a> {
    /// The logits row of each sampling row, in row order.
    sample_at: &'a [i32],
    /// Per sampling row: sampled on the device.
    on_device: &'a [bool],
    /// The logits rows of scored prompt tokens, in row order.
    scored_at: &'a [i32],
}

/// Evaluates a step (its logits `[wanted positions, vocab]` and the cache
/// `storage`) with the sampling rows marked on the device reduced to their
/// greedy token there, and reads back only those tokens, the other
/// sampling rows' logits and the scored rows' logits: one device round
/// trip.
fn sample_rows(
    logits: &Array,
    rows: LogitRows<'_>,
    storage: Vec<&Array>,
) -> Result<Sampled, String> {
    let total = rows.sample_at.len() + rows.scored_at.len();
    let take = |idx: &[i32]| -> Result<Option<Array>, mlxcel_mlx::Error> {
        if idx.is_empty() {
            return Ok(None);
        }
        if idx.len() == total && idx.iter().enumerate().all(|(i, &r)| r == i as i32) {
            return Ok(Some(logits.clone()));
        }
        let idx = Array::from_i32(idx, &[idx.len() as i32])?;
        Ok(Some(logits.take(&idx, 0)?))
    };
    let pick = |want: bool| -> Vec<i32> {
        rows.sample_at
            .iter()
            .zip(rows.on_device)
            .filter(|(_, &d)| d == want)
            .map(|(&r, _)| r)
            .collect()
    };
    let run = || -> Result<Sampled, mlxcel_mlx::Error> {
        let tokens = match take(&pick(true))? {
            Some(l) => Some(l.argmax(-1, false)?.astype(Dtype::Uint32)?),
            None => None,
        };
        let host = take(&pick(false))?;
        let scored = take(rows.scored_at)?;
        let mut outputs: Vec<&Array> = tokens
            .iter()
            .chain(host.iter())
            .chain(scored.iter())
            .collect();
        outputs.extend(storage);
        profile::region("model.eval", || mlxcel_mlx::eval(&outputs))?;
        let (device_tokens, logits, scored) = profile::region("engine.logits_to_host", || {
            let floats = |a: &Option<Array>| match a {
                Some(a) => a.to_vec_f32(),
                None => Ok(Vec::new()),
            };
            Ok::<_, mlxcel_mlx::Error>((
                match &tokens {
                    Some(t) => t.to_vec_u32()?,
                    None => Vec::new(),
                },
                floats(&host)?,
                floats(&scored)?,
            ))
        })?;
        Ok(Sampled::new(rows.on_device, device_tokens, logits, scored))
    };
    run().map_err(|e| e.to_string())
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}
