//! Tensor-parallel serving over MLX's distributed layer (docs/distributed.md).
//!
//! Rank 0 runs the HTTP server, the scheduler, the block bookkeeping and
//! sampling, as a single process does; its runner ([`LeaderRunner`])
//! wraps the local runner. Before it evaluates a step it broadcasts the
//! step's complete inputs ([`wire::Plan::Step`]: each row's tokens and
//! wanted logits, the KV layout of the step, the attention path); every
//! other rank (a *follower*, [`follower::run_follower`]) builds the same
//! step over its shard of the model and its `KvReplica`, so the
//! collectives inside the forward (one `all_sum` per attention and per
//! MLP) pair up. Followers run no scheduler and sample nothing.
//!
//! Failures break the group ([`watchdog`]): rank 0 fails the requests in
//! flight, reports unhealthy and refuses new requests.

pub(crate) mod follower;
pub(crate) mod watchdog;
pub(crate) mod wire;

use std::sync::Arc;
use std::time::Duration;

use mlxcel_kv::{KvCache, KvSequence, StepLayout};
use mlxcel_model::{AttentionPath, Model, StepRow};

use super::local::{LocalRunner, StepHook};
use super::RunnerHealth;
use super::{DecodeInput, InFlight, Pending, StepBatch, StepOutput, StepRunner};
use crate::error::{GroupError, StepError};
use watchdog::Watchdog;
use wire::{broadcast, Plan, Setup, WireStep};

/// Rank 0's runner: the local runner, with every step sent to the other
/// ranks between building and evaluating it.
pub(crate) struct LeaderRunner<'m> {
    local: LocalRunner<'m>,
    health: Arc<RunnerHealth>,
    watchdog: Watchdog,
}

impl<'m> LeaderRunner<'m> {
    /// Tells the other ranks what to allocate (the pool of `kv`, which
    /// must have one KV group) and which model to check theirs against,
    /// and returns rank 0's runner. The cache records its block copies
    /// from now on (followers mirror them).
    ///
    /// # Errors
    /// The watchdog thread could not start, or the set-up could not be
    /// sent (the group is then broken).
    pub(crate) fn connect(
        local: LocalRunner<'m>,
        model: &dyn Model,
        kv: &mut KvCache,
        health: Arc<RunnerHealth>,
        timeout: Duration,
    ) -> Result<Self, StepError> {
        let watchdog = Watchdog::start(timeout, Arc::clone(&health)).map_err(|e| {
            StepError::GroupBroken(format!("tensor parallelism: starting the watchdog: {e}"))
        })?;
        let runner = LeaderRunner {
            local,
            health,
            watchdog,
        };
        kv.record_block_copies(true);
        let c = kv.config();
        runner.send(&Plan::Setup(Setup {
            model_type: model.config().model_type.clone(),
            layers: model.config().num_hidden_layers,
            dtype: model.dtype(),
            num_blocks: c.num_blocks,
            block_size: c.block_size,
            kv_dtype: c.layout.kv_dtype.name().into(),
        }))?;
        Ok(runner)
    }

    /// Broadcasts `plan`; a failure breaks the group.
    fn send(&self, plan: &Plan) -> Result<(), StepError> {
        self.health()?;
        broadcast(Some(plan)).map(drop).map_err(|e| self.broken(&e))
    }

    /// Marks the group broken by `e` and returns it as a step error.
    fn broken(&self, e: &GroupError) -> StepError {
        let reason = e.to_string();
        self.health.mark_broken(&reason);
        StepError::GroupBroken(reason)
    }
}

/// Tells the followers to stop when a set-up could not be made (rank 0's
/// cache could not be built): they wait for one.
///
/// # Errors
/// The collective failed.
pub(crate) fn abort_setup() -> Result<(), GroupError> {
    broadcast(Some(&Plan::Stop)).map(drop)
}

impl StepRunner for LeaderRunner<'_> {
    fn attention_path(&self) -> AttentionPath {
        self.local.attention_path()
    }

    fn run(
        &mut self,
        kv: &mut KvCache,
        batch: &StepBatch<'_>,
        in_flight: &dyn InFlight,
    ) -> Result<StepOutput, StepError> {
        self.health()?;
        let mut hook = LeaderHook {
            path: self.local.attention_path(),
            health: &self.health,
            watchdog: &self.watchdog,
            in_flight,
            layout: None,
        };
        self.local.run_with(kv, batch, &mut hook)
    }

    fn can_queue(&self) -> bool {
        // Each step's inputs must be on the host to be broadcast.
        false
    }

    fn queue_decode(
        &mut self,
        _kv: &mut KvCache,
        _batch: &StepBatch<'_>,
        _input: DecodeInput<'_>,
    ) -> Result<Pending, StepError> {
        Err(StepError::Internal(
            "tensor parallelism does not pipeline decode steps",
        ))
    }

    fn read(&mut self, _kv: &mut KvCache, _pending: &Pending) -> Result<Vec<u32>, StepError> {
        Err(StepError::Internal(
            "tensor parallelism does not pipeline decode steps",
        ))
    }

    fn health(&self) -> Result<(), StepError> {
        match self.health.broken() {
            Some(reason) => Err(StepError::GroupBroken(reason)),
            None => Ok(()),
        }
    }
}

impl Drop for LeaderRunner<'_> {
    /// Rank 0 is going away: followers exit (unless the group is broken,
    /// when no collective can be trusted).
    fn drop(&mut self) {
        if self.health.broken().is_none() {
            if let Err(e) = broadcast(Some(&Plan::Stop)) {
                tracing::warn!(error = %e, "telling the other ranks to stop");
            }
        }
    }
}

/// What the leader does around one local step.
struct LeaderHook<'a> {
    path: AttentionPath,
    health: &'a RunnerHealth,
    watchdog: &'a Watchdog,
    in_flight: &'a dyn InFlight,
    /// The step's KV layout, taken once its positions are reserved.
    layout: Option<StepLayout>,
}

impl StepHook for LeaderHook<'_> {
    fn reserved(
        &mut self,
        kv: &mut KvCache,
        rows: &[(&KvSequence, usize)],
    ) -> Result<(), StepError> {
        let mut layout = kv.step_layout(rows)?;
        layout.copies = kv.take_block_copies();
        self.layout = Some(layout);
        Ok(())
    }

    fn built(&mut self, rows: &[StepRow<'_>]) -> Result<(), StepError> {
        let layout = self
            .layout
            .take()
            .ok_or(StepError::Internal("a step built before its layout"))?;
        // Built without error: now the other ranks run it with this rank.
        let step = WireStep::new(rows, layout, self.path).ok_or(StepError::Internal(
            "input embeddings under tensor parallelism",
        ))?;
        if let Some(reason) = self.health.broken() {
            return Err(StepError::GroupBroken(reason));
        }
        self.watchdog.arm(self.in_flight.streams());
        broadcast(Some(&Plan::Step(step))).map(drop).map_err(|e| {
            self.watchdog.disarm();
            let reason = e.to_string();
            self.health.mark_broken(&reason);
            StepError::GroupBroken(reason)
        })
    }

    fn evaluated(
        &mut self,
        outcome: Result<StepOutput, StepError>,
    ) -> Result<StepOutput, StepError> {
        self.watchdog.disarm();
        outcome.map_err(|e| {
            let reason = format!("tensor parallelism: a step failed: {e}");
            self.health.mark_broken(&reason);
            StepError::GroupBroken(reason)
        })
    }
}
