//! Starting an engine: open the checkpoint once, load the text side on the
//! caller's thread and the model on a dedicated OS thread (the engine
//! thread, which then builds the KV cache and the step runner and serves
//! requests), then warm up through the finished handle.

use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use mlxcel_kv::{DiskTierConfig, KvCache, StorageBackend};
use mlxcel_model::Model;
use mlxcel_text::Text;

use crate::api::EngineStats;
use crate::config::EngineConfig;
use crate::draft::Drafter;
use crate::error::EngineError;
use crate::handle::{Engine, EngineInfo};
use crate::loader::{load_text, Checkpoint, Opened};
use crate::plan::{EnginePlan, Loaded};
use crate::request::{Limits, RequestBuilder};
use crate::runner::local::LocalRunner;
use crate::runner::tensor_parallel::{abort_setup, LeaderRunner};
use crate::runner::RunnerHealth;
use crate::runner::StepRunner;
use crate::worker::{Message, Worker};

/// Rank 0 of a tensor-parallel group: the group's health (shared with the
/// handle) and the longest a step of the group may take.
type Group = Option<(Arc<RunnerHealth>, Duration)>;

impl Engine {
    /// Loads the model in `config.model_dir` and starts the engine thread;
    /// with a warm-up (`config.warmup`, on by default on a GPU) every kind
    /// of step runs once before this returns.
    ///
    /// # Errors
    /// Unreadable tokenizer/template/config, unsupported model, weight
    /// errors, a KV budget too small for one request, a failed warm-up.
    pub fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        let checkpoint = Checkpoint::open(&config.model_dir)?;
        Self::start_from(config, checkpoint)
    }

    /// [`Engine::start`] on a checkpoint the caller already opened (of
    /// `config.model_dir`), so that a front end which needed its config
    /// first (the context length, before the engine exists) does not read
    /// a GGUF header twice.
    ///
    /// # Errors
    /// As [`Engine::start`].
    pub fn start_from(
        mut config: EngineConfig,
        checkpoint: Checkpoint,
    ) -> Result<Engine, EngineError> {
        let started = Instant::now();
        crate::disk::check(&config)?;
        if config.speculative.num_tokens == 0 {
            return Err(EngineError::Config(
                "--num-speculative-tokens must be at least 1".into(),
            ));
        }
        if config.tensor_parallel.is_some() {
            // Followers address the pool by block id; the next step's
            // inputs must be on the host to be broadcast.
            config.storage_backend = Some(StorageBackend::Paged);
            config.pipeline = false;
        }
        let shard = config.tensor_parallel.map(|tp| tp.shard);
        let embedding = embedding_pooling(&config, &checkpoint)?;
        let opened = Opened::new(&config, checkpoint, shard)?;
        let model_config = opened.model_config.clone();
        let warmup = config.warmup.unwrap_or(opened.gpu);
        // Started before the model loads, so that both run at once.
        let kernel_jobs = if warmup {
            start_kernel_jobs(&config, &opened)
        } else {
            None
        };
        let text = Arc::new(load_text(
            &opened.checkpoint,
            config.chat_template.as_deref(),
            model_config.vocab_size,
        )?);
        let (gpu, options) = (opened.gpu, opened.options);
        config.speculative.method = config.speculative.method.resolve(
            gpu,
            config.tensor_parallel.is_some(),
            config.draft_model.is_some(),
            crate::speculative::gpu_verification_fits(&config, model_config.head_dim),
        );
        if config.tensor_parallel.is_some() && config.speculative.method.proposes() {
            // Rejected drafts are truncated on rank 0 only; the followers'
            // replicas would keep them.
            return Err(EngineError::Config(
                "--speculative does not run with --tensor-parallel yet".into(),
            ));
        }
        let draft = open_draft(&config, &text, model_config.vocab_size)?;
        let identity = format!(
            "{}|{:?}|{}",
            config.model_dir.display(),
            options.dtype,
            model_config.model_type
        );
        let plan = EnginePlan::new(&config, gpu, crate::platform::stable_hash(&identity))?;
        let group: Group = config
            .tensor_parallel
            .map(|tp| (Arc::new(RunnerHealth::default()), tp.timeout));
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let disk = crate::disk::tier_config(&config);
        let (jobs, thread, loaded) = spawn_engine_thread(
            opened,
            draft,
            plan,
            disk,
            Arc::clone(&text),
            Arc::clone(&stats),
            group.clone(),
        )?;
        let info = EngineInfo {
            model_type: model_config.model_type.clone(),
            dtype: options.dtype,
            weight_mode: options.weight_mode,
            gpu,
            load_seconds: started.elapsed().as_secs_f64(),
            storage_backend: loaded.backend,
            kv_blocks: loaded.blocks,
            kv_block_size: loaded.block_size,
            kv_admission: loaded.admission.clone(),
            prefill_tile: plan.worker.scheduler.prefill_tile,
            max_request_tokens: loaded.max_request_tokens,
        };
        let model_id = config.model_id();
        tracing::info!(
            model = %model_id,
            load_s = info.load_seconds,
            gemv_forwarding = mlxcel_mlx::gemv_forwarding_active(),
            kv_backend = %info.storage_backend,
            kv_blocks = info.kv_blocks,
            kv_block_size = info.kv_block_size,
            parallel = plan.worker.parallel,
            prefill_tile = info.prefill_tile,
            "model ready"
        );
        let reasoning = config.reasoning_parser.markers(
            text.template.as_ref().is_some_and(|t| t.knows_reasoning()),
            |token| text.tokenizer.token_to_id(token).is_some(),
        );
        let limits = Limits {
            context_length: model_config.max_position_embeddings,
            vocab_size: model_config.vocab_size.min(text.tokenizer.vocab_size()),
            parallel: plan.worker.parallel,
            max_request_tokens: loaded.max_request_tokens,
            admission: loaded.admission,
            special_tokens_in_content: config.special_tokens_in_content,
            reasoning,
            embedding: embedding.map(|pooling| (pooling, model_config.hidden_size)),
        };
        let engine = Engine {
            model_id,
            requests: RequestBuilder { text, limits },
            jobs: Some(jobs),
            thread: Some(thread),
            stats,
            health: group.map(|(health, _)| health),
            info,
        };
        if let Some(jobs) = kernel_jobs {
            let report = jobs.wait();
            tracing::info!(
                jobs = report.jobs,
                failed = report.failed,
                children = report.children,
                seconds = report.seconds,
                timed_out = report.timed_out,
                "kernels compiled in parallel"
            );
        }
        if warmup {
            let report = crate::warmup::warm_up(
                &engine,
                plan.worker.scheduler.prefill_chunk_size,
                plan.worker.parallel,
            )?;
            tracing::info!(
                requests = report.requests,
                seconds = report.seconds,
                "warm-up done: every kind of step has run once"
            );
        }
        Ok(engine)
    }
}

/// Starts the kernel jobs of [`crate::kernels`] for the warm-up when they
/// can run: on a CUDA GPU, not a tensor-parallel rank, and an executable
/// whose `main` runs a job when started as one
/// ([`crate::kernels::available`]: mlxcel's binaries; an engine embedded
/// elsewhere compiles in its warm-up as before). The parent's GPU context
/// is made first, so that children can never keep it from the GPU.
fn start_kernel_jobs(config: &EngineConfig, opened: &Opened) -> Option<crate::kernels::Precompile> {
    let cuda = opened.gpu && !cfg!(target_os = "macos") && mlxcel_mlx::paged_attention_available();
    if !(cuda && crate::kernels::available()) || config.tensor_parallel.is_some() {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    if let Err(e) = mlxcel_mlx::zeros(&[1], mlxcel_mlx::Dtype::Float32).and_then(|a| a.eval()) {
        tracing::debug!(error = %e, "no kernel jobs: the GPU refused a first array");
        return None;
    }
    let jobs = crate::kernels::plan(
        &config.model_dir,
        &opened.model_config.quantization,
        opened.options.dtype,
        opened.options.weight_mode == mlxcel_model::WeightMode::Quantized,
        config.prefill_chunk_size,
    );
    tracing::info!(jobs = jobs.len(), "compiling kernels in parallel");
    Some(crate::kernels::start(jobs, exe))
}

/// Starts the engine thread and waits until it has loaded the model and
/// built the KV cache and the runner.
///
/// # Errors
/// The thread could not start, or what it reported while loading.
fn spawn_engine_thread(
    opened: Opened,
    draft: Option<Opened>,
    plan: EnginePlan,
    disk: Option<DiskTierConfig>,
    text: Arc<Text>,
    stats: Arc<Mutex<EngineStats>>,
    group: Group,
) -> Result<(mpsc::Sender<Message>, std::thread::JoinHandle<()>, Loaded), EngineError> {
    let (jobs, queue) = mpsc::channel::<Message>();
    let (ready_tx, ready_rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("mlxcel-engine".into())
        .spawn(move || {
            let setup = Setup {
                opened,
                draft,
                plan,
                disk,
            };
            engine_thread(setup, &text, stats, group, &queue, &ready_tx)
        })
        .map_err(|e| EngineError::Thread(e.to_string()))?;
    let loaded = ready_rx
        .recv()
        .map_err(|_| EngineError::Thread("engine thread died while loading".into()))??;
    Ok((jobs, thread, loaded))
}

/// What the engine thread builds from.
struct Setup {
    opened: Opened,
    draft: Option<Opened>,
    plan: EnginePlan,
    /// The prefix cache's disk tier, when on.
    disk: Option<DiskTierConfig>,
}

/// The engine thread: loads the model, builds the KV cache (and opens its
/// disk tier) and the runner, reports ready (or what failed) on `ready`,
/// then serves `queue` until every handle is gone.
fn engine_thread(
    setup: Setup,
    text: &Text,
    stats: Arc<Mutex<EngineStats>>,
    group: Group,
    queue: &mpsc::Receiver<Message>,
    ready: &mpsc::Sender<Result<Loaded, EngineError>>,
) {
    let tensor_parallel = group.is_some();
    let Setup {
        opened,
        draft,
        plan,
        disk,
    } = setup;
    // Before the model loads: the engine thread builds every forward.
    mlxcel_model::invariant::set(plan.worker.batch_invariant);
    let setup = opened.load().and_then(|model| {
        let mut kv = plan.kv_cache(model.as_ref())?;
        crate::disk::open(&mut kv, disk.as_ref())?;
        #[cfg(feature = "fault-injection")]
        if let Some(errno) = plan.worker.fault.disk_write_errno {
            kv.fail_disk_writes_with(errno);
        }
        let draft = match draft {
            // Speculation is off for a target with recurrent layers
            // (`Worker::new`): no draft to load.
            Some(_) if kv.has_recurrent_layers() => None,
            Some(draft) => {
                let draft_model = draft.load()?;
                let draft_kv = plan.draft_kv_cache(draft_model.as_ref(), &kv)?;
                Some((draft_model, draft_kv))
            }
            None => None,
        };
        Ok((model, kv, draft))
    });
    let (model, mut kv, draft) = match setup {
        Ok(built) => built,
        Err(e) => {
            if tensor_parallel {
                // Followers wait for the set-up: let them exit.
                if let Err(stop) = abort_setup() {
                    tracing::warn!(error = %stop, "telling the other ranks to stop");
                }
            }
            let _ = ready.send(Err(e));
            return;
        }
    };
    let runner = match runner(model.as_ref(), &mut kv, &plan, group) {
        Ok(runner) => runner,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let (draft_model, draft_kv) = match draft {
        Some((m, kv)) => (Some(m), Some(kv)),
        None => (None, None),
    };
    let chunk = plan.worker.scheduler.prefill_chunk_size;
    let drafter = draft_model
        .as_deref()
        .zip(draft_kv)
        .map(|(m, kv)| Drafter::new(m, kv, chunk, plan.worker.attention_path));
    let _ = ready.send(Ok(plan.loaded(&kv)));
    Worker::new(runner, drafter, text, kv, plan.worker, stats).run(queue);
}

/// The step runner of this engine: the local runner, wrapped by rank 0's
/// runner under tensor parallelism (which sends the group its set-up).
///
/// # Errors
/// The tensor-parallel set-up could not be sent.
fn runner<'m>(
    model: &'m dyn Model,
    kv: &mut KvCache,
    plan: &EnginePlan,
    group: Group,
) -> Result<Box<dyn StepRunner + 'm>, EngineError> {
    let local = LocalRunner::new(model, kv.config().backend, plan.worker.attention_path);
    #[cfg(feature = "fault-injection")]
    let local = local.with_fault(plan.worker.fault);
    Ok(match group {
        None => Box::new(local),
        Some((health, timeout)) => {
            Box::new(LeaderRunner::connect(local, model, kv, health, timeout)?)
        }
    })
}

/// The draft model's checkpoint when the resolved method is
/// `--speculative draft`: opened with the target's compute settings, its
/// vocabulary checked against the target's (`target`).
///
/// # Errors
/// `--speculative draft` without `--draft-model`, `--draft-model` with
/// `--speculative ngram`, an unreadable draft checkpoint, a draft whose
/// tokenizer differs from the target's (the first differing token named),
/// or one with more logit rows than the target's `target_vocab` (its
/// tokens would not all be the target's).
fn open_draft(
    config: &EngineConfig,
    target: &Text,
    target_vocab: usize,
) -> Result<Option<Opened>, EngineError> {
    use crate::speculative::SpeculativeMethod;
    let dir = match (config.speculative.method, &config.draft_model) {
        (SpeculativeMethod::Draft, Some(dir)) => dir,
        (SpeculativeMethod::Draft, None) => {
            return Err(EngineError::Config(
                "--speculative draft needs --draft-model DIR".into(),
            ))
        }
        (SpeculativeMethod::Ngram, Some(_)) => {
            return Err(EngineError::Config(
                "--draft-model is used by --speculative draft (or auto), not ngram".into(),
            ))
        }
        (_, Some(dir)) => {
            tracing::warn!(draft = %dir.display(), "--speculative off: the draft model is not loaded");
            return Ok(None);
        }
        (_, None) => return Ok(None),
    };
    let mut draft_config = config.clone();
    draft_config.model_dir = dir.clone();
    let opened = Opened::new(&draft_config, Checkpoint::open(dir)?, None)?;
    let draft_text = load_text(&opened.checkpoint, None, opened.model_config.vocab_size)?;
    let draft_vocab = opened.model_config.vocab_size;
    let rows = if draft_vocab > target_vocab {
        Err(format!(
            "vocab_size {draft_vocab} against the model's {target_vocab}"
        ))
    } else {
        Ok(())
    };
    rows.and_then(|()| same_vocabulary(target, &draft_text))
        .map_err(|why| {
            EngineError::Config(format!(
                "--draft-model {}: its vocabulary differs from the model's ({why}); \
             a draft must share the tokenizer",
                dir.display()
            ))
        })?;
    tracing::info!(draft = %dir.display(), model_type = %opened.model_config.model_type, "draft model");
    Ok(Some(opened))
}

/// Whether two tokenizers give every id the same token (the draft's
/// proposals are the target's token ids).
///
/// # Errors
/// Why not: the sizes, or the first id whose tokens differ.
fn same_vocabulary(a: &Text, b: &Text) -> Result<(), String> {
    let (n, m) = (a.tokenizer.vocab_size(), b.tokenizer.vocab_size());
    if n != m {
        return Err(format!("{n} tokens against {m}"));
    }
    for id in 0..n as u32 {
        let (x, y) = (a.tokenizer.id_to_token(id), b.tokenizer.id_to_token(id));
        if x != y {
            return Err(format!("token {id} is {x:?} against {y:?}"));
        }
    }
    Ok(())
}

/// How the model serves embeddings: as its sentence-transformers files
/// say (an embedding checkpoint), else last-token pooling under
/// `--embeddings`, else not at all. GGUF files carry no pooling files.
///
/// # Errors
/// Unreadable pooling files, or a pooling mode other than last-token and
/// mean (named in the message).
fn embedding_pooling(
    config: &EngineConfig,
    checkpoint: &crate::loader::Checkpoint,
) -> Result<Option<mlxcel_model::pooling::Pooling>, EngineError> {
    let read = match checkpoint.gguf() {
        Some(_) => None,
        None => mlxcel_model::pooling::read_pooling(checkpoint.path())?,
    };
    let pooling = read.or(config
        .embeddings
        .then_some(mlxcel_model::pooling::Pooling::LastToken));
    if let Some(p) = pooling {
        tracing::info!(
            pooling = p.as_str(),
            from_checkpoint = read.is_some(),
            "serving embeddings"
        );
    }
    Ok(pooling)
}
