//! One step of the worker: plan, hand the step to the runner, and what
//! follows a successful forward (computed tokens, prefix-cache donation,
//! each KV group's trim, invariant checks, prompt logprobs, sampling).
//!
//! A step that fails over several rows is re-run row by row, so only the
//! rows that also fail alone fail: a poisoned request can't take its
//! batch-mates down (invariant 6). The runner has already rolled the
//! failed step back (`crate::runner`).

use std::ops::Range;
use std::time::Instant;

use mlxcel_model::profile::{self, ProfileMode};
use mlxcel_model::{AttentionPath, RowInput};

use super::{Sequence, Worker};
use crate::api::{GenerationEvent, SampledLogprobs};
use crate::error::StepError;
use crate::logits::log_probs;
use crate::runner::{BatchRow, StepBatch, StepOutput};
use crate::scheduler::{plan_step, PlannedRow, SeqProgress, StepPlan};

impl Sequence {
    /// The positions of a planned row whose logits come back to the host,
    /// and those whose greedy token is taken on the device: the scored
    /// prompt tokens, then the sampling position (on the device when the
    /// choice samples there).
    ///
    /// # Errors
    /// [`StepError::Internal`] when a sampling row's scored tokens do not
    /// end right before its sampling position.
    fn logits_wanted(&self, row: &PlannedRow) -> Result<(Range<usize>, Range<usize>), StepError> {
        if row.draft > 0 {
            // A verification row: the model's output after every position.
            return Ok(if self.samples_on_device() {
                (0..0, 0..row.real)
            } else {
                (0..row.real, 0..0)
            });
        }
        if self.job.embedding.is_some() {
            // Hidden states instead (`Sequence::hidden_wanted`).
            return Ok((0..0, 0..0));
        }
        let scored = self.scored_in_row(row.real);
        if !row.sample {
            return Ok((0..scored, 0..0));
        }
        let last = row.real - 1;
        if scored != 0 && scored != last {
            return Err(StepError::Internal(
                "scored prompt tokens that do not reach the sampling position",
            ));
        }
        Ok(if self.samples_on_device() {
            (0..scored, last..row.real)
        } else {
            (last - scored..row.real, 0..0)
        })
    }
}

impl Worker<'_> {
    /// Plans and runs one step (or continues the decode pipeline).
    pub(super) fn guarded_step(&mut self) {
        // A step discarded in the last one is waited for once this one is
        // built (dropped at the end of this function).
        let _retired = self.retired.take();
        if let Some(queued) = self.inflight.take() {
            self.continue_pipeline(queued);
            self.remove_done();
            profile::end_step();
            return;
        }
        let mut plan = self.plan();
        if plan.rows.is_empty() {
            return;
        }
        self.speculate(&mut plan);
        if profile::mode() != ProfileMode::Off {
            profile::begin_step(match plan.prefill_tokens() {
                0 => format!("decode x{}", plan.rows.len()),
                _ => "prefill".to_string(),
            });
        }
        if self.starts_pipeline(&plan) {
            let rows = self.pipeline_rows(&plan);
            match self.queue_decode(&rows, None) {
                Ok(queued) => {
                    self.inflight = Some(queued);
                    profile::end_step();
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "queueing a decode step failed; running it synchronously");
                }
            }
        }
        match self.run_plan(&plan) {
            Ok(output) => {
                self.pipeline_paused = false;
                profile::region("engine.sample_emit", || self.after_forward(&plan, &output))
            }
            Err(e) => {
                self.counters.failed_steps += 1;
                tracing::error!(error = %e, rows = plan.rows.len(), "step failed");
                if e.is_group_broken() {
                    // No step can run: the run loop fails every request.
                } else if let [row] = plan.rows[..] {
                    self.fail(row.seq, &e);
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
            let s = &self.running[row.seq];
            // The runner rolled the step back; a row whose cache is not at
            // its computed tokens cannot run again.
            if self.kv.end(&s.kv).ok() != Some(s.computed) {
                self.fail(
                    row.seq,
                    &StepError::Internal("a failed step was not rolled back"),
                );
                continue;
            }
            let single = StepPlan { rows: vec![*row] };
            match self.run_plan(&single) {
                Ok(output) => self.after_forward(&single, &output),
                Err(e) => {
                    self.counters.failed_steps += 1;
                    tracing::error!(error = %e, "row failed alone");
                    self.fail(row.seq, &e);
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
                donates: s.job.request.cache_prompt,
            })
            .collect();
        plan_step(&progress, self.config.scheduler)
    }

    /// Runs `plan` through the runner (see [`Worker::run_plan_unguarded`]);
    /// a panic anywhere on the way (building the rows, the runner's
    /// reservation or completion) is this step's error, not the engine
    /// thread's end. The runner rolls back what it reserved; a row the
    /// panic left mid-step fails in [`Worker::isolate`] ("not rolled
    /// back").
    fn run_plan(&mut self, plan: &StepPlan) -> Result<StepOutput, StepError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.run_plan_unguarded(plan)
        }))
        .unwrap_or_else(|panic| Err(StepError::from_panic(&*panic)))
    }

    /// Runs `plan` through the runner: each row's next tokens (real, then
    /// pads repeating the last real token: any id works, pads are masked
    /// from real queries and rewound) and the logits it wants.
    fn run_plan_unguarded(&mut self, plan: &StepPlan) -> Result<StepOutput, StepError> {
        let started = Instant::now();
        let inputs: Vec<Vec<u32>> = plan
            .rows
            .iter()
            .map(|r| {
                let s = &self.running[r.seq];
                let known = s.computed..s.computed + (r.real - r.draft);
                let mut t = s.tokens.get(known).unwrap_or_default().to_vec();
                t.extend_from_slice(&s.draft[..r.draft.min(s.draft.len())]);
                let last = *t.last().unwrap_or(&0);
                t.resize(r.padded, last);
                t
            })
            .collect();
        let rows = plan
            .rows
            .iter()
            .zip(&inputs)
            .map(|(r, t)| {
                let s = &self.running[r.seq];
                let (host_logits, device_argmax) = s.logits_wanted(r)?;
                Ok(BatchRow {
                    kv: &s.kv,
                    input: RowInput::Tokens(t),
                    real: r.real,
                    host_logits,
                    device_argmax,
                    hidden: s.hidden_wanted(r),
                })
            })
            .collect::<Result<Vec<_>, StepError>>()?;
        let batch = StepBatch { rows };
        let in_flight = super::Streams {
            running: &self.running,
            waiting: &self.waiting,
        };
        let result = self.runner.run(&mut self.kv, &batch, &in_flight);
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
            for r in plan.rows.iter().filter(|r| r.padded > 1 && r.draft == 0) {
                self.running[r.seq].timings.prefill_s += elapsed;
            }
            let path = self.runner.attention_path();
            self.count_attention_rows(path, plan.decode_rows());
        }
        result
    }

    /// Marks `seq` failed: its client gets the error; it leaves at the end of
    /// the step (its blocks return).
    pub(super) fn fail(&mut self, seq: usize, error: &StepError) {
        let s = &self.running[seq];
        let _ = s.job.events.send(error.event());
        self.done.push(s.id);
    }

    pub(super) fn remove_done(&mut self) {
        let done = std::mem::take(&mut self.done);
        self.running.retain(|s| !done.contains(&s.id));
    }

    /// Everything after a successful forward: the rows' computed tokens,
    /// prefix-cache donation, each KV group's trim, invariant checks,
    /// then sampling and streaming. A failure here fails only its row.
    fn after_forward(&mut self, plan: &StepPlan, output: &StepOutput) {
        self.count(plan);
        self.score_prompts(plan, output);
        self.pool_hidden(plan, output);
        for (r, out) in plan.rows.iter().zip(&output.rows) {
            let kept = match r.draft {
                0 => Ok(r.real),
                _ => self.verify(r, out).map(|accepted| 1 + accepted),
            };
            if let Err(e) = kept.and_then(|kept| self.advance(r.seq, kept, 0)) {
                tracing::error!(error = %e, "row failed after its forward");
                self.fail(r.seq, &e);
            }
        }
        self.sample_and_emit(plan, output);
    }

    /// Turns the step's scored logits rows into prompt logprobs (before the
    /// rows advance: row `r` scored the tokens from `computed` on); a
    /// sequence whose prompt is now computed sends them.
    fn score_prompts(&mut self, plan: &StepPlan, output: &StepOutput) {
        let text = self.text;
        for (r, out) in plan.rows.iter().zip(&output.rows) {
            let s = &mut self.running[r.seq];
            let scored = s.scored_in_row(r.real);
            let k = s.job.request.prompt_logprobs.unwrap_or(0);
            for j in 0..scored {
                let Some(row) = out.logits_row(j) else {
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
    pub(super) fn advance(
        &mut self,
        seq: usize,
        real: usize,
        ahead: usize,
    ) -> Result<(), StepError> {
        self.running[seq].computed += real;
        // Full blocks become hittable as soon as they are computed and
        // read (a step queued ahead writes past `computed`: its positions
        // wait for its read).
        self.donate_known(seq)?;
        let s = &self.running[seq];
        let kv = &mut self.kv;
        // Each KV group drops what fell out of its window (or past
        // `--max-kv-size`); a full group keeps everything. Keys a queued
        // step's rollback would need again stay (`ahead` more).
        kv.trim_keeping(&s.kv, ahead)?;
        if self.config.check_invariants {
            self.check_cache(seq, ahead)?;
        }
        Ok(())
    }

    /// Checks sequence `seq`'s cache ([`mlxcel_kv::KvCache::check`]) and
    /// that it ends at the computed tokens plus the `ahead` positions
    /// reserved by a step still queued.
    ///
    /// # Errors
    /// [`StepError::Internal`] (or the cache's invariant error) naming
    /// what is broken.
    pub(super) fn check_cache(&self, seq: usize, ahead: usize) -> Result<(), StepError> {
        let s = &self.running[seq];
        self.kv.check(&s.kv)?;
        let end = self.kv.end(&s.kv)?;
        if end != s.computed + ahead {
            tracing::error!(end, computed = s.computed, ahead, "cache end mismatch");
            return Err(StepError::Internal(
                "the cache's end is not the computed tokens plus those queued",
            ));
        }
        Ok(())
    }

    /// Donates sequence `seq`'s full blocks among its computed positions
    /// with known tokens: those a read step wrote, never those of a step
    /// still queued (its read may fail and roll it back) nor rejected
    /// drafts (their tokens are not the sequence's).
    pub(super) fn donate_known(&mut self, seq: usize) -> Result<(), StepError> {
        let s = &self.running[seq];
        if s.job.request.cache_prompt {
            let known = s.computed.min(s.tokens.len());
            self.kv.donate(&s.kv, &s.tokens[..known])?;
        }
        Ok(())
    }

    /// Counts `rows` decode rows under the attention path that read them.
    pub(super) fn count_attention_rows(&mut self, path: AttentionPath, rows: usize) {
        match path {
            AttentionPath::BatchedDecode | AttentionPath::PagedDecode => {
                self.counters.attention_batched_rows += rows as u64
            }
            AttentionPath::PerRow => self.counters.attention_per_row_rows += rows as u64,
        }
    }

    pub(super) fn count(&mut self, plan: &StepPlan) {
        let c = &mut self.counters;
        c.steps += 1;
        let decode = plan.decode_rows() + plan.verify_rows();
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
