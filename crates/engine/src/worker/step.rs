//! One step of the worker: plan, guarded forward (rewind on failure,
//! row-by-row isolation), and what follows a successful forward.

use mlxcel_kv::{KvSequence, RowReserve, StorageBackend};
use mlxcel_model::{AttentionPath, StepRow};
use std::time::Instant;

use super::Worker;
use crate::api::GenerationEvent;
use crate::scheduler::{plan_step, PlannedRow, SeqProgress, StepPlan};

impl Worker<'_> {
    /// Plans and runs one step. A forward that fails (an error or a panic)
    /// over several rows is retried row by row, so only the rows that also
    /// fail alone fail: a poisoned request can't take its batch-mates down.
    pub(super) fn guarded_step(&mut self) {
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
            let len = kv.len(&s.kv).map_err(|e| e.to_string())?;
            if len > max {
                let end = kv.end(&s.kv).map_err(|e| e.to_string())?;
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
        if result.is_ok() {
            for r in plan.rows.iter().filter(|r| r.padded > 1) {
                self.running[r.seq].timings.prefill_s += elapsed;
            }
            if path == AttentionPath::BatchedDecode && plan.decode_rows() > 0 {
                self.counters.attention_batched_rows += plan.decode_rows() as u64;
            } else {
                self.counters.attention_per_row_rows += plan.decode_rows() as u64;
            }
        }
        result.map_err(|e| e.to_string())
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

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}
