//! Tensor-parallel serving over MLX's distributed layer (docs/distributed.md).
//!
//! Rank 0 runs the HTTP server, the scheduler, the block bookkeeping and
//! sampling, as a single process does. Before it evaluates a step it
//! broadcasts the step's complete inputs ([`Plan::Step`]: each row's
//! tokens and wanted logits, each row's positions and block table, the
//! block copies its bookkeeping made, the attention path); every other
//! rank (a *follower*, [`run_follower`]) builds the same step over its
//! shard of the model and its [`KvReplica`], so the collectives inside the
//! forward (one `all_sum` per attention and per MLP) pair up. Followers
//! run no scheduler and sample nothing.
//!
//! A plan travels as JSON bytes packed into int32 words through
//! `all_sum` (rank 0 contributes the words, the others zeros), which every
//! backend carries: one collective of [`HEAD_WORDS`] words, and a second
//! one when the plan is longer.
//!
//! Failures: a collective that fails (a peer's connection closed) comes
//! back as an error; one that never returns (a peer that stopped
//! answering) is caught by [`Watchdog`] after the configured timeout.
//! Either way rank 0 fails the requests in flight, reports unhealthy and
//! refuses new requests: the group cannot be trusted any more.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use mlxcel_kv::{CopyLayout, KvReplica, RowLayout, StepLayout};
use mlxcel_mlx::{distributed, Array, Dtype};
use mlxcel_model::{AttentionPath, StepRow, TensorParallel};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::GenerationEvent;
use crate::{EngineConfig, EngineError};

/// Words of a plan's first collective (the length, then the first bytes).
pub const HEAD_WORDS: usize = 1024;

/// `--tensor-parallel` as the engine takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallelConfig {
    /// This process's rank and the world size.
    pub shard: TensorParallel,
    /// Longest a step of the group may take before rank 0 gives up on it
    /// (a peer that stopped answering blocks a collective for as long as
    /// the backend waits).
    pub timeout: Duration,
}

/// What rank 0 broadcasts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Plan {
    /// Once, after loading: the pool every follower allocates, and what it
    /// checks its own model against.
    Setup {
        model_type: String,
        layers: usize,
        dtype: i32,
        num_blocks: usize,
        block_size: usize,
    },
    /// One step's inputs.
    Step(StepPlan),
    /// Rank 0 is shutting down: followers exit.
    Stop,
}

/// One step's inputs, everything a follower's forward depends on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct StepPlan {
    /// 0 per row, 1 batched decode, 2 paged decode.
    path: u8,
    /// Per row: tokens (pads included), the index whose logits are wanted,
    /// the scored prompt tokens.
    rows: Vec<(Vec<u32>, Option<usize>, usize)>,
    /// Per row: start, end, new, block table.
    kv_rows: Vec<(usize, usize, usize, Vec<u32>)>,
    /// Block copies (src, dst, tokens) to make first.
    copies: Vec<(u32, u32, u32)>,
}

impl StepPlan {
    /// The plan of a step over `rows` whose KV view is `layout`.
    pub(crate) fn new(rows: &[StepRow<'_>], layout: StepLayout, path: AttentionPath) -> Self {
        StepPlan {
            path: match path {
                AttentionPath::PerRow => 0,
                AttentionPath::BatchedDecode => 1,
                AttentionPath::PagedDecode => 2,
            },
            rows: rows
                .iter()
                .map(|r| (r.tokens.to_vec(), r.logits_at, r.scored))
                .collect(),
            kv_rows: layout
                .rows
                .into_iter()
                .map(|r| (r.start, r.end, r.new, r.blocks))
                .collect(),
            copies: layout
                .copies
                .into_iter()
                .map(|c| (c.src, c.dst, c.tokens))
                .collect(),
        }
    }

    fn path(&self) -> AttentionPath {
        match self.path {
            0 => AttentionPath::PerRow,
            1 => AttentionPath::BatchedDecode,
            _ => AttentionPath::PagedDecode,
        }
    }

    fn layout(&self) -> StepLayout {
        StepLayout {
            copies: self
                .copies
                .iter()
                .map(|&(src, dst, tokens)| CopyLayout { src, dst, tokens })
                .collect(),
            rows: self
                .kv_rows
                .iter()
                .map(|(start, end, new, blocks)| RowLayout {
                    start: *start,
                    end: *end,
                    new: *new,
                    blocks: blocks.clone(),
                })
                .collect(),
        }
    }
}

/// A failure of the tensor-parallel group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tensor parallelism: {0}")]
pub struct TpError(pub String);

impl From<mlxcel_mlx::Error> for TpError {
    fn from(e: mlxcel_mlx::Error) -> Self {
        TpError(e.to_string())
    }
}

/// Packs `bytes` as little-endian int32 words after a length word.
fn to_words(bytes: &[u8]) -> Vec<i32> {
    let mut words = Vec::with_capacity(1 + bytes.len().div_ceil(4));
    words.push(bytes.len() as i32);
    words.extend(bytes.chunks(4).map(|c| {
        let mut w = [0u8; 4];
        w[..c.len()].copy_from_slice(c);
        i32::from_le_bytes(w)
    }));
    words
}

/// The bytes of [`to_words`]'s words (the length word first).
fn from_words(words: &[i32]) -> Result<Vec<u8>, TpError> {
    let len = words.first().copied().unwrap_or(0);
    let len = usize::try_from(len).map_err(|_| TpError(format!("a plan of {len} bytes")))?;
    let mut bytes: Vec<u8> = words[1..].iter().flat_map(|w| w.to_le_bytes()).collect();
    if bytes.len() < len {
        return Err(TpError(format!(
            "a plan of {len} bytes in {} words",
            words.len()
        )));
    }
    bytes.truncate(len);
    Ok(bytes)
}

/// Sums `words` (padded with zeros to `n`) over the group and reads the sum.
fn sum_words(words: &[i32], n: usize) -> Result<Vec<i32>, TpError> {
    let mut padded = vec![0i32; n];
    let k = words.len().min(n);
    padded[..k].copy_from_slice(&words[..k]);
    let x = Array::from_i32(&padded, &[n as i32])?;
    Ok(distributed::all_sum(&x, None)?.to_vec_i32()?)
}

/// Broadcasts `plan` from rank 0 (`Some`) to every rank (`None` on
/// followers) and returns it: one collective of [`HEAD_WORDS`], a second
/// for the rest of a longer plan.
pub(crate) fn broadcast(plan: Option<&Plan>) -> Result<Plan, TpError> {
    let words = match plan {
        Some(p) => to_words(&serde_json::to_vec(p).map_err(|e| TpError(e.to_string()))?),
        None => Vec::new(),
    };
    let mut all = sum_words(&words, HEAD_WORDS)?;
    let len = all.first().copied().unwrap_or(0).max(0) as usize;
    let total = 1 + len.div_ceil(4);
    if total > HEAD_WORDS {
        let rest = words.get(HEAD_WORDS..).unwrap_or(&[]);
        all.extend(sum_words(rest, total - HEAD_WORDS)?);
    }
    let bytes = from_words(&all)?;
    serde_json::from_slice(&bytes).map_err(|e| TpError(format!("a plan that does not parse: {e}")))
}

/// The group's health as rank 0 sees it, shared with the engine handle
/// (new requests are refused once it is broken) and `/health`.
#[derive(Debug, Default)]
pub(crate) struct GroupHealth {
    broken: Mutex<Option<String>>,
}

impl GroupHealth {
    /// Marks the group broken (the first reason stays).
    pub(crate) fn mark_broken(&self, reason: &str) {
        let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        if b.is_none() {
            tracing::error!(reason, "tensor-parallel group broken: serving stops");
            *b = Some(reason.to_owned());
        }
    }

    /// Why the group is broken, if it is.
    pub(crate) fn broken(&self) -> Option<String> {
        self.broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[derive(Default)]
struct WatchState {
    /// The step being watched: its start and the requests to fail.
    armed: Option<(Instant, Vec<UnboundedSender<GenerationEvent>>)>,
    stop: bool,
}

/// Fails the requests of a step of the group that has run longer than the
/// timeout, from its own thread (the engine thread is the one blocked in
/// the collective), and marks the group broken.
pub(crate) struct Watchdog {
    state: Arc<(Mutex<WatchState>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the watchdog thread.
    pub(crate) fn start(timeout: Duration, health: Arc<GroupHealth>) -> Result<Self, EngineError> {
        let state: Arc<(Mutex<WatchState>, Condvar)> = Arc::default();
        let watched = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name("mlxcel-tp-watchdog".into())
            .spawn(move || {
                let (lock, cv) = &*watched;
                let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if s.stop {
                        return;
                    }
                    let wait = match &s.armed {
                        None => timeout,
                        Some((since, _)) => match timeout.checked_sub(since.elapsed()) {
                            Some(left) => left,
                            None => {
                                let reason = format!(
                                    "a step of the tensor-parallel group did not finish in {} s \
                                     (--tensor-parallel-timeout): a rank stopped answering",
                                    timeout.as_secs_f64()
                                );
                                health.mark_broken(&reason);
                                if let Some((_, events)) = s.armed.take() {
                                    for e in events {
                                        let _ = e.send(GenerationEvent::Failed {
                                            message: reason.clone(),
                                        });
                                    }
                                }
                                continue;
                            }
                        },
                    };
                    s = cv
                        .wait_timeout(s, wait)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
            })
            .map_err(|e| EngineError::Thread(e.to_string()))?;
        Ok(Watchdog {
            state,
            thread: Some(thread),
        })
    }

    /// Watches a step from now; `events` are its requests' streams.
    pub(crate) fn arm(&self, events: Vec<UnboundedSender<GenerationEvent>>) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap_or_else(|p| p.into_inner()).armed = Some((Instant::now(), events));
        cv.notify_all();
    }

    /// The step is over.
    pub(crate) fn disarm(&self) {
        let (lock, _) = &*self.state;
        lock.lock().unwrap_or_else(|p| p.into_inner()).armed = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Rank 0's side of the group, owned by the engine thread.
pub(crate) struct Leader {
    pub(crate) health: Arc<GroupHealth>,
    pub(crate) watchdog: Watchdog,
}

impl Leader {
    /// Broadcasts `plan` under the watchdog (failing `events` if it
    /// fires); a failure breaks the group.
    pub(crate) fn send(&self, plan: &Plan) -> Result<(), TpError> {
        self.check()?;
        broadcast(Some(plan))
            .map(drop)
            .inspect_err(|e| self.health.mark_broken(&e.to_string()))
    }

    /// An error when the group is broken.
    pub(crate) fn check(&self) -> Result<(), TpError> {
        match self.health.broken() {
            Some(reason) => Err(TpError(reason)),
            None => Ok(()),
        }
    }
}

/// Runs a follower rank (rank > 0) of `config.tensor_parallel`: loads its
/// shard of the model, allocates the K/V pool rank 0 announces, then runs
/// every step rank 0 broadcasts until it says stop.
///
/// # Errors
/// Loading errors; a Setup that does not match this rank's model; a
/// failed collective (rank 0 or another rank went away) or a failed step,
/// after which the group is broken: the process should exit, which closes
/// its connections so that the other ranks fail too instead of waiting.
pub fn run_follower(config: &EngineConfig) -> Result<(), EngineError> {
    let tp = config
        .tensor_parallel
        .ok_or_else(|| EngineError::Config("a follower needs --tensor-parallel".into()))?;
    let dir = &config.model_dir;
    let checkpoint = crate::loader::Checkpoint::open(dir)?;
    let mut model_config = checkpoint.config()?;
    model_config.tensor_parallel = Some(tp.shard);
    let gpu = config.use_gpu && mlxcel_mlx::gpu_available();
    mlxcel_mlx::set_cudnn_attention(config.cudnn_attention)?;
    if let Some(dir) = &config.kernel_cache_dir {
        mlxcel_mlx::set_kernel_cache_dir(&dir.join(format!("mlx-{}", mlxcel_mlx::version())))?;
    }
    mlxcel_mlx::use_device(gpu)?;
    let (dtype, weight_mode, quantize) = crate::engine::compute_types(config, &model_config, gpu);
    tracing::info!(
        rank = tp.shard.rank,
        ranks = tp.shard.size,
        dir = %dir.display(),
        ?dtype,
        "tensor-parallel follower: loading its shard"
    );
    let model = checkpoint.load_model(
        model_config,
        mlxcel_model::LoadOptions {
            dtype,
            weight_mode,
            quantize,
        },
    )?;
    let fail = |e: TpError| EngineError::Config(e.to_string());
    let (num_blocks, block_size) = match broadcast(None).map_err(fail)? {
        Plan::Setup {
            model_type,
            layers,
            dtype: leader_dtype,
            num_blocks,
            block_size,
        } => {
            let c = model.config();
            if model_type != c.model_type
                || layers != c.num_hidden_layers
                || leader_dtype != dtype_code(model.dtype())
            {
                return Err(EngineError::Config(format!(
                    "rank 0 serves {model_type} ({layers} layers, dtype {leader_dtype}); this \
                     rank loaded {} ({} layers, {:?}): start every rank with the same model and \
                     flags",
                    c.model_type,
                    c.num_hidden_layers,
                    model.dtype()
                )));
            }
            (num_blocks, block_size)
        }
        Plan::Stop => return Ok(()),
        Plan::Step(_) => return Err(EngineError::Config("a step before the setup".into())),
    };
    let mut kv = KvReplica::new(model.kv_layout(), num_blocks, block_size)
        .map_err(|e| EngineError::Config(e.to_string()))?;
    tracing::info!(
        rank = tp.shard.rank,
        num_blocks,
        block_size,
        "tensor-parallel follower ready"
    );
    loop {
        match broadcast(None).map_err(fail)? {
            Plan::Step(step) => {
                let layout = step.layout();
                let rows: Vec<StepRow<'_>> = step
                    .rows
                    .iter()
                    .map(|(tokens, logits_at, scored)| StepRow {
                        tokens,
                        logits_at: *logits_at,
                        scored: *scored,
                    })
                    .collect();
                let mut run = || -> Result<(), mlxcel_model::ModelError> {
                    let mut view = kv.step(&layout)?;
                    let logits = model.build_step(&rows, None, &mut view, step.path())?;
                    let mut outputs = vec![&logits];
                    outputs.extend(mlxcel_kv::AttentionKv::storage(&view));
                    mlxcel_mlx::eval(&outputs)?;
                    Ok(())
                };
                run().map_err(|e| EngineError::Config(format!("follower step: {e}")))?;
            }
            Plan::Stop => {
                tracing::info!(rank = tp.shard.rank, "rank 0 stopped: follower exits");
                return Ok(());
            }
            Plan::Setup { .. } => {
                return Err(EngineError::Config("a second setup".into()));
            }
        }
    }
}

/// `dtype` as the plans carry it.
pub(crate) fn dtype_code(dtype: Dtype) -> i32 {
    dtype as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_any_length() {
        for n in [0usize, 1, 3, 4, 5, 4095, 4096, 4097, 10_000] {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
            let words = to_words(&bytes);
            assert_eq!(words.len(), 1 + n.div_ceil(4));
            assert_eq!(from_words(&words).unwrap(), bytes);
        }
        assert!(from_words(&[9, 0]).is_err());
        assert!(from_words(&[-1]).is_err());
    }

    #[test]
    fn a_step_plan_round_trips_through_json() {
        let tokens = [5u32, 6, 7];
        let rows = [StepRow {
            tokens: &tokens,
            logits_at: Some(2),
            scored: 1,
        }];
        let layout = StepLayout {
            copies: vec![CopyLayout {
                src: 3,
                dst: 9,
                tokens: 2,
            }],
            rows: vec![RowLayout {
                start: 30,
                end: 35,
                new: 3,
                blocks: vec![1, 9],
            }],
        };
        let plan = Plan::Step(StepPlan::new(
            &rows,
            layout.clone(),
            AttentionPath::PagedDecode,
        ));
        let json = serde_json::to_vec(&plan).unwrap();
        let back: Plan = serde_json::from_slice(&from_words(&to_words(&json)).unwrap()).unwrap();
        assert_eq!(back, plan);
        let Plan::Step(step) = back else {
            unreachable!()
        };
        assert_eq!(step.layout(), layout);
        assert_eq!(step.path(), AttentionPath::PagedDecode);
    }
}
