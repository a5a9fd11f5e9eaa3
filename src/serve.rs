//! The HTTP serve loop: join a tensor-parallel group, listen, load the
//! model meanwhile, log the ready line, serve until SIGTERM or SIGINT, and
//! leave the process through [`exit`].

use anyhow::Context;
use mlxcel_engine::api::{EngineStats, InferenceService, ServiceSlot};
use mlxcel_engine::{Engine, EngineConfig};
use mlxcel_http::{AppState, HttpConfig};
use std::sync::Arc;

use crate::args::ServeArgs;

/// Joins the tensor-parallel group `args` asks for and sets
/// `config.tensor_parallel`; returns this process's rank (0 without
/// `--tensor-parallel`).
fn join_group(args: &ServeArgs, config: &mut EngineConfig) -> anyhow::Result<usize> {
    if !args.tensor_parallel {
        return Ok(0);
    }
    let backend = args.distributed_backend.name();
    let group = mlxcel_mlx::distributed::init(backend, true).with_context(|| {
        format!(
            "--tensor-parallel: joining the `{backend}` group (start every rank with \
             `mlx.launch`, see docs/distributed.md)"
        )
    })?;
    let (rank, size) = (group.rank(), group.size());
    tracing::info!(
        rank,
        ranks = size,
        backend,
        "joined the tensor-parallel group"
    );
    if size > 1 {
        config.tensor_parallel = Some(mlxcel_engine::TensorParallelConfig {
            shard: mlxcel_model::TensorParallel::new(rank, size)?,
            timeout: args.tensor_parallel_timeout,
        });
    }
    Ok(rank)
}

/// Serves the OpenAI-compatible API until SIGTERM or SIGINT (Ctrl-C). The
/// server listens at once and answers `GET /health` with 503 `starting`
/// while the model loads and warms up on another thread; then it serves.
///
/// On the signal it stops accepting connections and lets open requests run
/// for at most `--shutdown-timeout` (then they fail with an error), stops
/// the engine thread, and returns. The caller should then leave through
/// [`exit`]: an ordinary process exit can hang in OpenBLAS's exit handler.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut engine_config = args.model.engine_config(args.alias.clone())?;
    if join_group(&args, &mut engine_config)? > 0 {
        // A follower rank: no HTTP, its shard of every step until rank 0
        // stops.
        mlxcel_engine::run_follower(&engine_config)?;
        tracing::info!("follower stopped");
        return Ok(());
    }
    // Opened once: a GGUF file's header is read here and serves the
    // engine too.
    let checkpoint = mlxcel_engine::loader::Checkpoint::open(&engine_config.model_dir)?;
    let context_length = checkpoint.config()?.max_position_embeddings;
    let slot = Arc::new(ServiceSlot::new(engine_config.model_id(), context_length));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let served = runtime.block_on(serve_on(args, engine_config, checkpoint, Arc::clone(&slot)));
    // Every task (connections, streams) ends with the runtime, so the slot
    // is left holding the only handle to the engine.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    // Dropping the engine joins its thread: no MLX work outlives it.
    drop(slot);
    served?;
    tracing::info!("server stopped");
    Ok(())
}

/// The async part of [`serve`]: listen, load the model meanwhile, serve
/// until the shutdown signal and the drain are over.
async fn serve_on(
    args: ServeArgs,
    engine_config: EngineConfig,
    checkpoint: mlxcel_engine::loader::Checkpoint,
    slot: Arc<ServiceSlot>,
) -> anyhow::Result<()> {
    let signals = Signals::install().context("installing the SIGTERM and SIGINT handlers")?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let local = listener.local_addr()?;
    // Tests and scripts wait for this line (then for /health to be ok).
    tracing::info!("listening on http://{local}");
    if args.api_key.is_some() {
        tracing::info!("API key required on every route but GET /health");
    }
    let config = HttpConfig {
        default_max_tokens: args.default_max_tokens,
        api_key: args.api_key.map(|key| key.0),
        allowed_origins: args.allowed_origins.unwrap_or_default(),
        shutdown_grace: args.shutdown_timeout,
        responses_store_size: args.responses_store_size,
        ..HttpConfig::default()
    };
    let state = AppState::with_config(Arc::clone(&slot) as Arc<dyn InferenceService>, config);
    let mut server = tokio::spawn(mlxcel_http::serve(listener, state, signals.shutdown()));
    let model_id = engine_config.model_id();
    let gpu = engine_config.use_gpu && mlxcel_mlx::gpu_available();
    let loading = {
        let slot = Arc::clone(&slot);
        tokio::task::spawn_blocking(move || {
            let engine = Engine::start_from(engine_config, checkpoint)?;
            slot.fill(Arc::new(engine));
            anyhow::Ok(())
        })
    };
    tokio::select! {
        loaded = loading => {
            // A model that cannot load stops the server with its error.
            loaded.context("the model loader stopped")??;
            log_ready(local, &model_id, gpu, &slot.stats());
            server.await.context("the HTTP server task")??;
        }
        // Stopped (a signal) while the model was still loading.
        served = &mut server => {
            served.context("the HTTP server task")??;
            tracing::info!("stopped while the model was loading");
            leave_now(0);
        }
    }
    Ok(())
}

/// The one line that says the server is ready, and what it serves on what
/// (tests and scripts wait for its "ready: serving requests"): the
/// address, the model, the device as MLX names it, and the KV cache's size
/// in tokens and bytes.
fn log_ready(local: std::net::SocketAddr, model: &str, gpu: bool, stats: &EngineStats) {
    let name = mlxcel_mlx::device_name(gpu).unwrap_or_else(|e| format!("unnamed: {e}"));
    let device = format!("{}, {name}", if gpu { "gpu" } else { "cpu" });
    let kv_tokens = stats.kv_blocks_total * stats.kv_block_size;
    let kv_bytes = stats.kv_blocks_total * stats.kv_block_bytes;
    tracing::info!(
        address = %format!("http://{local}"),
        model,
        device = %device,
        kv_tokens,
        kv_bytes,
        kv_storage = %stats.kv_storage_backend,
        kv_dtype = %stats.kv_cache_dtype,
        speculative = %stats.speculative_method,
        "ready: serving requests"
    );
}

/// Ends the process with `result` as [`serve`]'s callers need: the error
/// printed as `main` would (`Error: ...`, status 1), or status 0.
///
/// The process leaves through `_exit`, which skips `atexit` handlers and
/// C++ static destructors. That is deliberate: OpenBLAS runs
/// `gotoblas_quit` at exit, whose `blas_thread_shutdown_` can wait forever
/// joining a BLAS worker thread that sleeps on a condition variable (a
/// server stopped after a few hundred requests was found there with gdb:
/// it had logged "server stopped" and never exited, so a service manager
/// would have had to kill it). The hang depends on timing (a 2-core
/// machine did not show it in 320 requests), so the exit avoids the
/// handler rather than hoping to miss the race. By the time this runs
/// nothing needs those handlers: the HTTP server has drained, the engine
/// thread has been joined (no MLX work is left), logs go to unbuffered
/// stderr, and stdout is flushed here. The kernel frees memory and closes
/// files and sockets.
pub fn exit(result: anyhow::Result<()>) -> ! {
    let status = match result {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("Error: {err:?}");
            1
        }
    };
    leave_now(status)
}

/// Flushes stdout and ends the process at once with `status`, skipping
/// exit handlers and destructors (see [`exit`]). Also used when a signal
/// arrives while the model loads: a blocking load or warm-up cannot be
/// cancelled, waiting for it would keep a stopped server alive for minutes,
/// and exit-time destructors would race the loader's MLX work.
fn leave_now(status: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` ends the process; nothing after it runs.
    unsafe { libc::_exit(status) }
}

/// SIGTERM and SIGINT, caught from the moment [`Signals::install`] returns
/// (a signal that came before the first poll of a lazily made stream would
/// still kill the process).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers; needs a tokio runtime.
    fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// The next signal's name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }

    /// Completes on the first signal. A second one ends the process at
    /// once (status 1), without waiting for open requests.
    async fn shutdown(mut self) {
        let signal = self.next().await;
        tracing::info!("{signal} received: shutting down");
        tokio::spawn(async move {
            let signal = self.next().await;
            tracing::warn!("second signal ({signal}): exiting without waiting for open requests");
            leave_now(1);
        });
    }
}
