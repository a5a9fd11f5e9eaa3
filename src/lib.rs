//! Shared command-line plumbing of the `mlxcel` and `mlxcel-server` binaries:
//! the model flags, the config file, logging, and the HTTP serve loop.

pub mod config;
pub mod model_source;
pub mod package_files;
pub mod progress;

use anyhow::Context;
use clap::{Args, ValueEnum};
use mlxcel_engine::api::{EngineStats, InferenceService, ServiceSlot};
use mlxcel_engine::{
    AttentionPath, Engine, EngineConfig, GgufQuantize, ReasoningParser, StorageBackend,
};
use mlxcel_http::cors::AllowedOrigins;
use mlxcel_http::{AppState, HttpConfig};
use mlxcel_mlx::Dtype;
use mlxcel_model::WeightMode;
use std::path::PathBuf;
use std::sync::Arc;

/// `--dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// float32 on CPU, the checkpoint's dtype on GPU.
    Auto,
    Float32,
    Float16,
    Bfloat16,
}

/// `--weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WeightsArg {
    /// Dequantize on CPU, keep quantized on GPU.
    Auto,
    /// Keep quantized weights quantized (quantized matmul).
    Quantized,
    /// Dequantize quantized weights once at load (dense matmul).
    Dequantized,
}

/// `--quantize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QuantizeArg {
    /// On a GPU, 4 or 8 bits as the file stored each matrix; none on a CPU.
    Auto,
    /// 4-bit MLX affine quantization.
    #[value(name = "4")]
    Q4,
    /// 8-bit MLX affine quantization.
    #[value(name = "8")]
    Q8,
    /// Keep them as the file has them.
    None,
}

/// `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// The GPU when MLX has one, else the CPU.
    Auto,
    Cpu,
    Gpu,
}

/// Flags that choose and load the model (shared by every subcommand).
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// MLX checkpoint directory (config.json, *.safetensors, tokenizer.json),
    /// a GGUF file (`model.gguf`: weights, tokenizer and chat template from
    /// the one file), or a hub repository id (`org/name`), taken from the
    /// local hub cache or downloaded into it.
    #[arg(short = 'm', long = "model", env = "MLXCEL_MODEL", value_hint = clap::ValueHint::AnyPath)]
    pub model: PathBuf,
    /// Compute dtype.
    #[arg(long, value_enum, default_value_t = DtypeArg::Auto)]
    pub dtype: DtypeArg,
    /// How quantized weights are used.
    #[arg(long, value_enum, default_value_t = WeightsArg::Auto)]
    pub weights: WeightsArg,
    /// A GGUF file's floating-point matrices (types MLX does not keep
    /// quantized, such as Q6_K or Q5_0) quantized at load to 4 or 8 bits
    /// (group size 32), or kept (`none`). `auto`: on a GPU, each to about
    /// the precision the file stored it at (float tensors kept); on a CPU,
    /// none. Only for GGUF files; no effect with dequantized weights.
    #[arg(long, value_enum, default_value_t = QuantizeArg::Auto)]
    pub quantize: QuantizeArg,
    /// Device to run on.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
    /// Prefill tokens one step runs, in tokens; prompts are split into
    /// chunks ending at multiples of it, interleaved with decode (`auto`:
    /// 2048 on a GPU, 512 on a CPU).
    #[arg(long, default_value = "auto", value_parser = parse_auto_usize)]
    pub prefill_chunk_size: AutoOr<usize>,
    /// Pad each prefill chunk to a multiple of this many tokens (`auto`: 32
    /// on Apple M5 and newer GPUs, 0 elsewhere). Pad tokens are masked and
    /// rewound.
    #[arg(long, default_value = "auto", value_parser = parse_auto_usize)]
    pub prefill_tile: AutoOr<usize>,
    /// Sequences decoded together (continuous batching).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub parallel: u32,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub kv_block_size: u32,
    /// KV cache size in bytes (suffixes K, M, G, KiB, MiB, GiB), or `auto`:
    /// room for `--parallel` sequences of the model's full context, at most a
    /// quarter of physical memory. Requests that don't fit wait.
    #[arg(long, default_value = "auto", value_parser = parse_auto_bytes)]
    pub kv_cache_budget: AutoOr<usize>,
    /// Where K/V live: one paged pool of blocks, or contiguous buffers per
    /// sequence (`auto`: paged when `--parallel` > 1).
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub decode_storage_backend: BackendArg,
    /// How decode rows read a paged cache: a paged-attention kernel reading
    /// the pool through block tables (`paged`, GPU only), one attention over
    /// all rows gathered and padded to the longest (`batched`), or one per
    /// row (`auto`: paged on a GPU, batched elsewhere).
    #[arg(long, value_enum, default_value_t = AttentionPathArg::Auto)]
    pub attention_path: AttentionPathArg,
    /// Run every kind of step once before serving, so that GPU kernels are
    /// compiled before the first request (`auto`: on a GPU).
    #[arg(long, value_enum, default_value_t = SwitchArg::Auto)]
    pub warmup: SwitchArg,
    /// Let MLX's CUDA backend use cuDNN's fused attention for prefill (it
    /// builds a graph for every new prompt shape, 50-800 ms each).
    #[arg(long)]
    pub cudnn_attention: bool,
    /// Where MLX's CUDA backend keeps the GPU kernels it compiles, so that
    /// restarts don't compile them again (`auto`:
    /// `$XDG_CACHE_HOME/mlxcel/kernels`, else `~/.cache/mlxcel/kernels`;
    /// `none`: MLX's default under /tmp). `MLX_PTX_CACHE_DIR`, when set,
    /// wins.
    #[arg(long, default_value = "auto", value_name = "DIR", value_hint = clap::ValueHint::DirPath)]
    pub kernel_cache_dir: String,
    /// Read each decode step's tokens before queueing the next one (the
    /// default queues the next step first, overlapping host and device).
    #[arg(long)]
    pub no_decode_pipeline: bool,
    /// Keep at most N tokens of K/V per sequence: older ones are dropped
    /// from the front (positions keep counting), so long prompts and
    /// generations run in bounded memory. Models with a sliding window use
    /// it as the bound.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_kv_size: Option<u32>,
    /// A Jinja chat template file to use instead of the model's own (e.g.
    /// one that renders tools).
    #[arg(long, value_name = "FILE", value_hint = clap::ValueHint::FilePath)]
    pub chat_template: Option<std::path::PathBuf>,
    /// Split a chat reply's `<think>` block off as `reasoning_content`:
    /// `auto` when the chat template writes `<think>` (Qwen3, QwQ,
    /// DeepSeek-R1), `think` always, `none` never.
    #[arg(long, value_enum, default_value_t = ReasoningParserArg::Auto)]
    pub reasoning_parser: ReasoningParserArg,
    /// Let control-token strings typed in message content (`<|im_end|>`...)
    /// become control tokens, as the chat template's own markup does. Off:
    /// content is encoded as plain text, so a user cannot close their turn
    /// or forge another role's.
    #[arg(long)]
    pub special_tokens_in_content: bool,
    /// Turn the prompt prefix cache off (it needs paged storage).
    #[arg(long)]
    pub no_prompt_cache: bool,
    /// Most unused cached KV blocks the prompt cache keeps (least recently
    /// used go first); `auto`: the whole pool.
    #[arg(long, default_value = "auto", value_parser = parse_auto_usize)]
    pub prompt_cache_capacity: AutoOr<usize>,
}

/// A flag value that is `auto` or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoOr<T> {
    Auto,
    Value(T),
}

impl<T: Copy> AutoOr<T> {
    fn value(self) -> Option<T> {
        match self {
            AutoOr::Auto => None,
            AutoOr::Value(v) => Some(v),
        }
    }
}

fn parse_auto_usize(s: &str) -> Result<AutoOr<usize>, String> {
    if s == "auto" {
        return Ok(AutoOr::Auto);
    }
    s.parse()
        .map(AutoOr::Value)
        .map_err(|_| format!("expected `auto` or a number of tokens, got `{s}`"))
}

/// `auto`, or bytes with an optional K/M/G (x1000) or KiB/MiB/GiB (x1024) suffix.
fn parse_auto_bytes(s: &str) -> Result<AutoOr<usize>, String> {
    if s == "auto" {
        return Ok(AutoOr::Auto);
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let mult: usize = match unit.trim() {
        "" | "B" => 1,
        "K" | "KB" => 1_000,
        "M" | "MB" => 1_000_000,
        "G" | "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => return Err(format!("unknown size unit `{other}`")),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .map(AutoOr::Value)
        .ok_or_else(|| format!("expected `auto` or a size in bytes, got `{s}`"))
}

/// `--decode-storage-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    Auto,
    Dense,
    Paged,
}

/// `--attention-path`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AttentionPathArg {
    Auto,
    Paged,
    Batched,
    PerRow,
}

/// `--reasoning-parser`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReasoningParserArg {
    Auto,
    Think,
    None,
}

/// An on/off flag whose default depends on the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SwitchArg {
    Auto,
    On,
    Off,
}

impl ModelArgs {
    /// The engine configuration these flags describe.
    pub fn engine_config(&self, alias: Option<String>) -> anyhow::Result<EngineConfig> {
        if self.device == DeviceArg::Gpu && !mlxcel_mlx::gpu_available() {
            anyhow::bail!("--device gpu: this MLX build has no GPU backend here");
        }
        let dir = model_source::resolve(&self.model, None)?;
        // A hub snapshot's directory name is a commit hash: serve the repo id
        // (a GGUF file is served under its file name).
        let local = self.model.is_dir() || mlxcel_engine::loader::is_gguf(&self.model);
        let alias = alias.or_else(|| (!local).then(|| self.model.to_string_lossy().into_owned()));
        let mut c = EngineConfig::new(dir);
        c.alias = alias;
        c.dtype = match self.dtype {
            DtypeArg::Auto => None,
            DtypeArg::Float32 => Some(Dtype::Float32),
            DtypeArg::Float16 => Some(Dtype::Float16),
            DtypeArg::Bfloat16 => Some(Dtype::Bfloat16),
        };
        c.weight_mode = match self.weights {
            WeightsArg::Auto => None,
            WeightsArg::Quantized => Some(WeightMode::Quantized),
            WeightsArg::Dequantized => Some(WeightMode::Dequantized),
        };
        c.quantize = match self.quantize {
            QuantizeArg::Auto => GgufQuantize::Auto,
            QuantizeArg::None => GgufQuantize::Off,
            QuantizeArg::Q4 | QuantizeArg::Q8 if !mlxcel_engine::loader::is_gguf(&c.model_dir) => {
                anyhow::bail!(
                    "--quantize {} applies to GGUF files; {} is a checkpoint directory \
                     (quantize it with mlx_lm.convert -q)",
                    if self.quantize == QuantizeArg::Q4 {
                        4
                    } else {
                        8
                    },
                    c.model_dir.display()
                )
            }
            QuantizeArg::Q4 => GgufQuantize::Bits(4),
            QuantizeArg::Q8 => GgufQuantize::Bits(8),
        };
        c.use_gpu = self.device != DeviceArg::Cpu;
        let gpu = c.use_gpu && mlxcel_mlx::gpu_available();
        c.prefill_chunk_size = match self.prefill_chunk_size {
            AutoOr::Auto => mlxcel_engine::auto_prefill_chunk_size(gpu),
            AutoOr::Value(0) => anyhow::bail!("--prefill-chunk-size must be at least 1"),
            AutoOr::Value(n) => n,
        };
        c.warmup = match self.warmup {
            SwitchArg::Auto => None,
            SwitchArg::On => Some(true),
            SwitchArg::Off => Some(false),
        };
        c.cudnn_attention = self.cudnn_attention;
        c.special_tokens_in_content = self.special_tokens_in_content;
        c.reasoning_parser = match self.reasoning_parser {
            ReasoningParserArg::Auto => ReasoningParser::Auto,
            ReasoningParserArg::Think => ReasoningParser::Think,
            ReasoningParserArg::None => ReasoningParser::None,
        };
        c.kernel_cache_dir = match self.kernel_cache_dir.as_str() {
            "none" => None,
            "auto" => default_kernel_cache_dir(),
            dir => Some(PathBuf::from(dir)),
        };
        c.pipeline = !self.no_decode_pipeline;
        c.prefill_tile = self.prefill_tile.value();
        c.parallel = self.parallel as usize;
        c.kv_block_size = self.kv_block_size as usize;
        c.kv_cache_budget = self.kv_cache_budget.value();
        c.storage_backend = match self.decode_storage_backend {
            BackendArg::Auto => None,
            BackendArg::Dense => Some(StorageBackend::Dense),
            BackendArg::Paged => Some(StorageBackend::Paged),
        };
        c.prefix_cache = !self.no_prompt_cache;
        c.max_kv_size = self.max_kv_size.map(|n| n as usize);
        c.chat_template = self.chat_template.clone();
        c.prefix_cache_capacity = self.prompt_cache_capacity.value();
        c.attention_path = match self.attention_path {
            AttentionPathArg::Auto | AttentionPathArg::Paged => AttentionPath::PagedDecode,
            AttentionPathArg::Batched => AttentionPath::BatchedDecode,
            AttentionPathArg::PerRow => AttentionPath::PerRow,
        };
        Ok(c)
    }
}

/// `--kernel-cache-dir auto`: `$XDG_CACHE_HOME/mlxcel/kernels`, else
/// `$HOME/.cache/mlxcel/kernels`; `None` without either variable.
fn default_kernel_cache_dir() -> Option<PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("mlxcel").join("kernels"))
}

/// OpenAI-compatible LLM inference server on MLX.
///
/// Serves the OpenAI API (chat and text completions, responses, models,
/// streaming) for one MLX model, plus /health, /metrics (Prometheus),
/// /tokenize, /detokenize, /v1/cache/stats, /v1/cache/reset and
/// /openapi.json. Flags can also be set in a TOML file
/// (--config).
#[derive(Debug, clap::Parser)]
#[command(name = "mlxcel-server", version)]
pub struct ServerCli {
    /// The server's flags.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// Flags of the HTTP server.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Read flags from this TOML file: keys are the long flag names
    /// (`kv-cache-budget = "4GiB"`, `no-prompt-cache = true`); the command
    /// line and the flags' environment variables win over it.
    #[arg(long, value_name = "FILE", env = "MLXCEL_CONFIG", value_hint = clap::ValueHint::FilePath)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "MLXCEL_HOST")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080, env = "MLXCEL_PORT")]
    pub port: u16,
    /// Name the model is served under (default: the directory name).
    #[arg(long)]
    pub alias: Option<String>,
    /// `max_tokens` of requests that do not set it.
    #[arg(long, default_value_t = 512)]
    pub default_max_tokens: usize,
    /// Require `Authorization: Bearer <KEY>` on every route but `GET /health`.
    #[arg(
        long,
        env = "MLXCEL_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub api_key: Option<ApiKeyArg>,
    /// Origins whose browser pages may call the API: `*`, or a
    /// comma-separated list such as `https://app.example.com`. Default: no
    /// CORS headers.
    #[arg(long, value_name = "ORIGINS")]
    pub allowed_origins: Option<AllowedOrigins>,
    /// After SIGTERM or SIGINT, how many seconds open requests may run
    /// before they fail with an error; the server exits once they have
    /// ended. A second signal exits at once.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = parse_seconds)]
    pub shutdown_timeout: std::time::Duration,
    /// Most responses of `POST /v1/responses` kept in memory for
    /// `previous_response_id` and `GET /v1/responses/{id}`; storing one
    /// more evicts the oldest. 0 turns the store off (then `store: true`
    /// and `previous_response_id` are a 400).
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub responses_store_size: usize,
    /// Split the model over the processes `mlx.launch` started, one per
    /// rank (tensor parallelism: attention heads and MLP columns): rank 0
    /// serves HTTP, the others run their shard of each step. See
    /// docs/distributed.md.
    #[arg(long)]
    pub tensor_parallel: bool,
    /// MLX distributed backend of `--tensor-parallel`: `any` (the one the
    /// launcher configured), `ring` (TCP), `jaccl` (RDMA over
    /// Thunderbolt), `mpi`, `nccl` (NVIDIA).
    #[arg(long, value_enum, default_value_t = DistributedBackendArg::Any)]
    pub distributed_backend: DistributedBackendArg,
    /// With `--tensor-parallel`: seconds one step of the group may take
    /// before rank 0 gives up on it (a rank that stopped answering can
    /// block a collective for as long as the backend waits); its requests
    /// then fail and `/health` reports unhealthy.
    #[arg(long, default_value = "60", value_name = "SECONDS", value_parser = parse_seconds)]
    pub tensor_parallel_timeout: std::time::Duration,
}

/// `--distributed-backend`: MLX's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DistributedBackendArg {
    Any,
    Ring,
    Jaccl,
    Mpi,
    Nccl,
}

impl DistributedBackendArg {
    /// The name MLX's `distributed::init` takes.
    pub fn name(self) -> &'static str {
        match self {
            DistributedBackendArg::Any => "any",
            DistributedBackendArg::Ring => "ring",
            DistributedBackendArg::Jaccl => "jaccl",
            DistributedBackendArg::Mpi => "mpi",
            DistributedBackendArg::Nccl => "nccl",
        }
    }
}

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

/// A non-negative number of seconds (decimals allowed).
fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    s.parse::<f64>()
        .ok()
        .and_then(|secs| std::time::Duration::try_from_secs_f64(secs).ok())
        .ok_or_else(|| format!("expected a number of seconds, got `{s}`"))
}

/// The `--api-key` value: not empty, and never shown by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKeyArg(String);

impl std::str::FromStr for ApiKeyArg {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err("the API key must not be empty");
        }
        // A bearer token is read without surrounding whitespace, so such a
        // key could never match.
        if s.trim() != s {
            return Err("the API key must not start or end with whitespace");
        }
        Ok(Self(s.to_owned()))
    }
}

impl std::fmt::Debug for ApiKeyArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKeyArg(<redacted>)")
    }
}

/// Parses the process's arguments as `P`, with the settings of the
/// `--config` file of the server's flags (see [`config`]) put before the
/// command line's. `serve` names the subcommand that takes the server's
/// flags (`mlxcel serve`), or is `None` when the command itself does
/// (`mlxcel-server`). Exits with clap's usage errors (status 2), and with a
/// config file's error.
pub fn parse_args<P: clap::Parser>(serve: Option<&str>) -> P {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Only `--version` asks MLX about the device (a GPU backend may take a
    // moment to start).
    let asks_version = argv
        .iter()
        .skip(1)
        .take_while(|a| *a != "--")
        .any(|a| a == "--version");
    let mut command = P::command().version(SHORT_VERSION);
    if asks_version {
        command = command.long_version(long_version());
    }
    command = match serve {
        None => command.args_override_self(true),
        Some(name) => command.mut_subcommand(name, |c| c.args_override_self(true)),
    };
    // The server's flags start after the binary (and the subcommand).
    let start = match serve {
        None => Some(1),
        Some(name) => (argv.get(1).is_some_and(|a| a == name)).then_some(2),
    };
    let server = match serve {
        None => Some(&command),
        Some(name) => command.find_subcommand(name),
    };
    if let (Some(start), Some(server)) = (start, server) {
        let tail = argv.split_off(start.min(argv.len()));
        match config::args_with_config(server, tail) {
            Ok(tail) => argv.extend(tail),
            Err(err) => {
                eprintln!("error: {err}");
                std::process::exit(2);
            }
        }
    }
    let matches = command.get_matches_from(argv);
    P::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// What `-V` prints after the binary's name: the version and the git
/// commit it was built from (`unknown` when built outside a git checkout
/// without `MLXCEL_GIT_COMMIT`).
pub const SHORT_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("MLXCEL_GIT_COMMIT"),
    ")"
);

/// What `--version` prints after the binary's name: the version, the git
/// commit, the version of the MLX library loaded, and the device MLX runs
/// on by default (`--device auto`) as MLX names it.
pub fn long_version() -> String {
    let gpu = mlxcel_mlx::gpu_available();
    let kind = if gpu { "gpu" } else { "cpu" };
    let device = mlxcel_mlx::device_name(gpu).unwrap_or_else(|e| format!("unnamed ({e})"));
    format!(
        "{}\ncommit: {}\nmlx: {}\ndevice: {kind}, {device}",
        env!("CARGO_PKG_VERSION"),
        env!("MLXCEL_GIT_COMMIT"),
        mlxcel_mlx::version(),
    )
}

/// Logs to stderr; `RUST_LOG` filters (default `info`). On a terminal,
/// loading weights and warming up also draw progress bars
/// ([`progress::ProgressLayer`]), whatever `RUST_LOG` says.
pub fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Progress events are for the bars, never log lines.
    let filter = match format!("{}=off", progress::TARGET).parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    };
    let bars = progress::Bars::default();
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(progress::BarWriter::new(bars.clone()))
        .with_filter(filter);
    let bars_layer = progress::ProgressLayer::stderr(bars).with_filter(
        tracing_subscriber::filter::Targets::new()
            .with_target(progress::TARGET, tracing::Level::DEBUG),
    );
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(bars_layer)
        .try_init();
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
    let context_length =
        mlxcel_engine::loader::read_config(&engine_config.model_dir)?.max_position_embeddings;
    let slot = Arc::new(ServiceSlot::new(engine_config.model_id(), context_length));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let served = runtime.block_on(serve_on(args, engine_config, Arc::clone(&slot)));
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
            let engine = Engine::start(engine_config)?;
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
