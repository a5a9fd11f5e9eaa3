//! The command-line flags: the model's ([`ModelArgs`], shared by every
//! subcommand, and the [`EngineConfig`] they describe), the server's
//! ([`ServeArgs`]), their value enums and parsers.

use clap::{Args, ValueEnum};
use mlxcel_engine::{
    defaults, AttentionPath, EngineConfig, GgufQuantize, ReasoningParser, StorageBackend,
};
use mlxcel_http::cors::AllowedOrigins;
use mlxcel_mlx::Dtype;
use mlxcel_model::WeightMode;
use std::path::PathBuf;

use crate::model_source;

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
    /// With quantized weights, a matmul over at least this many tokens
    /// (prefill) dequantizes its weight for the product and runs a dense
    /// GEMM, which is faster there; `0` never does (`auto`: 512 on a GPU,
    /// 16 on a CPU).
    #[arg(long, default_value = "auto", value_parser = parse_auto_usize)]
    pub dequant_matmul_rows: AutoOr<usize>,
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
    #[arg(long, default_value_t = defaults::PARALLEL as u32, value_parser = clap::value_parser!(u32).range(1..))]
    pub parallel: u32,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = defaults::KV_BLOCK_SIZE as u32, value_parser = clap::value_parser!(u32).range(1..))]
    pub kv_block_size: u32,
    /// KV cache size in bytes (suffixes K, M, G, KiB, MiB, GiB), or `auto`:
    /// room for `--parallel` sequences of the model's full context, at most a
    /// quarter of physical memory. Requests that don't fit wait.
    #[arg(long, default_value = "auto", value_parser = parse_auto_bytes)]
    pub kv_cache_budget: AutoOr<usize>,
    /// How K/V are stored: `auto` (the model's compute dtype), `float16`,
    /// `bfloat16`, `float32`, or quantized per group of 64 features of a
    /// head (32 when the head size is not a multiple of 64) with a scale
    /// and a bias each: `int8` (~1.9x the tokens of float16 in the same
    /// budget), `int4` (~3.5x). Quantized blocks need paged storage.
    #[arg(long, default_value = "auto", value_parser = parse_kv_cache_dtype)]
    pub kv_cache_dtype: mlxcel_engine::KvCacheDtype,
    /// Where K/V live: one paged pool of blocks, or contiguous buffers per
    /// sequence (`auto`: paged when `--parallel` > 1 or the KV cache is
    /// quantized).
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
    /// Batch-invariant execution: a request's tokens and logprobs are bit
    /// for bit the same alone or batched, chunked or not, cold or from the
    /// prompt cache (matmuls in fixed row chunks, every query through the
    /// paged-attention kernel on a GPU, no split of its keys). Costs speed:
    /// see docs/performance.md.
    #[arg(long)]
    pub deterministic: bool,
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
    /// Verify prompt-lookup drafts inside the decode pipeline: the step
    /// after a queued one takes each row's token in flight as its first
    /// input and verifies a draft looked up after a guess of that token
    /// (a step behind a rejected draft is discarded). Experimental: it
    /// decodes slower than verifying synchronously (the default) on a CPU
    /// and on an H100 (17-27%). Output unchanged.
    #[arg(long)]
    pub pipelined_verification: bool,
    /// Speculative decoding: `ngram` lets each decode row propose the
    /// tokens that followed the last few tokens earlier in the prompt or
    /// reply (prompt lookup), `draft` the greedy tokens of
    /// `--draft-model`, and verifies them all in one forward; the output
    /// is the same as without (seeded sampling included). `off`: one token
    /// per step. `auto`: `draft` with `--draft-model`, else `ngram`, but
    /// `off` with --tensor-parallel and on a GPU whose verification rows
    /// would not go through the paged-attention kernel (with --parallel
    /// above 1: --attention-path batched|per-row, dense storage, a float
    /// --kv-cache-dtype other than the model's, --num-speculative-tokens of
    /// 16 or more, a head size not a multiple of 32 or above 256).
    #[arg(long, value_enum, default_value_t = SpeculativeArg::Auto)]
    pub speculative: SpeculativeArg,
    /// The draft model of `--speculative draft` (a directory, GGUF file or
    /// hub id like `-m`): a smaller model with the same tokenizer, loaded
    /// with the same dtype and weight mode, with its own KV and prefix
    /// cache.
    #[arg(long, value_name = "MODEL", value_hint = clap::ValueHint::AnyPath)]
    pub draft_model: Option<PathBuf>,
    /// Most draft tokens a row verifies per step with `--speculative`
    /// (each row adapts below it to what it gets accepted).
    #[arg(long, default_value_t = mlxcel_engine::speculative::DEFAULT_NUM_TOKENS, value_name = "N")]
    pub num_speculative_tokens: usize,
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
    /// Split a chat reply's reasoning off as `reasoning_content`: `auto`
    /// `<think>` blocks when the chat template writes `<think>` (Qwen3,
    /// QwQ, DeepSeek-R1), else Gemma 4's thought channel
    /// (`<|channel>thought` … `<channel|>`) when the vocabulary has its
    /// tokens; `think` and `gemma4` always those; `none` never.
    #[arg(long, value_enum, default_value_t = ReasoningParserArg::Auto)]
    pub reasoning_parser: ReasoningParserArg,
    /// Let control-token strings typed in message content (`<|im_end|>`...)
    /// become control tokens, as the chat template's own markup does. Off:
    /// content is encoded as plain text, so a user cannot close their turn
    /// or forge another role's.
    #[arg(long)]
    pub special_tokens_in_content: bool,
    /// Serve `POST /v1/embeddings` from this model even though it is no
    /// embedding checkpoint: each input's last-token final hidden state,
    /// L2-normalised. An embedding checkpoint (sentence-transformers
    /// pooling files, e.g. Qwen3-Embedding) serves them without this flag.
    #[arg(long)]
    pub embeddings: bool,
    /// Turn the prompt prefix cache off (it needs paged storage).
    #[arg(long)]
    pub no_prompt_cache: bool,
    /// Most unused cached KV blocks the prompt cache keeps (least recently
    /// used go first); `auto`: the whole pool.
    #[arg(long, default_value = "auto", value_parser = parse_auto_usize)]
    pub prompt_cache_capacity: AutoOr<usize>,
    /// A directory for the prompt cache's disk tier: KV blocks that leave
    /// RAM (evicted, or all of them at a clean stop) are saved there and
    /// read back by later prompts, across restarts. One server per
    /// directory (a lock file names the holder). Off without it.
    #[arg(long, value_name = "DIR", value_hint = clap::ValueHint::DirPath)]
    pub prompt_cache_dir: Option<std::path::PathBuf>,
    /// Most bytes of block files the disk tier keeps (suffixes K, M, G,
    /// KiB, MiB, GiB); least recently used go first.
    #[arg(long, default_value = "16GiB", value_parser = parse_bytes)]
    pub prompt_cache_disk_size: usize,
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    match parse_auto_bytes(s)? {
        AutoOr::Value(v) => Ok(v),
        AutoOr::Auto => Err("expected a size in bytes, got `auto`".into()),
    }
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

/// `--kv-cache-dtype`: one of [`mlxcel_engine::KvCacheDtype::ALL`]'s
/// names (or an alias its `FromStr` takes).
fn parse_kv_cache_dtype(s: &str) -> Result<mlxcel_engine::KvCacheDtype, String> {
    s.parse()
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
    Gemma4,
    None,
}

/// `--speculative`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpeculativeArg {
    Auto,
    Off,
    Ngram,
    Draft,
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
        c.dequant_matmul_rows = self.dequant_matmul_rows.value();
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
        c.deterministic = self.deterministic;
        c.special_tokens_in_content = self.special_tokens_in_content;
        c.embeddings = self.embeddings;
        c.reasoning_parser = match self.reasoning_parser {
            ReasoningParserArg::Auto => ReasoningParser::Auto,
            ReasoningParserArg::Think => ReasoningParser::Think,
            ReasoningParserArg::Gemma4 => ReasoningParser::Gemma4,
            ReasoningParserArg::None => ReasoningParser::None,
        };
        c.kernel_cache_dir = match self.kernel_cache_dir.as_str() {
            "none" => None,
            "auto" => default_kernel_cache_dir(),
            dir => Some(PathBuf::from(dir)),
        };
        c.pipeline = !self.no_decode_pipeline;
        c.pipelined_verification = self.pipelined_verification;
        c.speculative = mlxcel_engine::SpeculativeConfig {
            method: match self.speculative {
                SpeculativeArg::Auto => mlxcel_engine::SpeculativeMethod::Auto,
                SpeculativeArg::Off => mlxcel_engine::SpeculativeMethod::Off,
                SpeculativeArg::Ngram => mlxcel_engine::SpeculativeMethod::Ngram,
                SpeculativeArg::Draft => mlxcel_engine::SpeculativeMethod::Draft,
            },
            num_tokens: self.num_speculative_tokens,
            ..mlxcel_engine::SpeculativeConfig::default()
        };
        c.draft_model = self
            .draft_model
            .as_deref()
            .map(|m| model_source::resolve(m, None))
            .transpose()?;
        c.prefill_tile = self.prefill_tile.value();
        c.parallel = self.parallel as usize;
        c.kv_block_size = self.kv_block_size as usize;
        c.kv_cache_budget = self.kv_cache_budget.value();
        c.kv_cache_dtype = self.kv_cache_dtype;
        c.storage_backend = match self.decode_storage_backend {
            BackendArg::Auto => None,
            BackendArg::Dense => Some(StorageBackend::Dense),
            BackendArg::Paged => Some(StorageBackend::Paged),
        };
        c.prefix_cache = !self.no_prompt_cache;
        c.max_kv_size = self.max_kv_size.map(|n| n as usize);
        c.chat_template = self.chat_template.clone();
        c.prefix_cache_capacity = self.prompt_cache_capacity.value();
        c.prompt_cache_dir = self.prompt_cache_dir.clone();
        c.prompt_cache_disk_size = self.prompt_cache_disk_size as u64;
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
    #[arg(long, default_value_t = mlxcel_http::defaults::MAX_TOKENS)]
    pub default_max_tokens: usize,
    /// Require `Authorization: Bearer <KEY>` or `x-api-key: <KEY>` on every
    /// route but `GET /health`.
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
    #[arg(long, default_value_t = mlxcel_http::defaults::RESPONSES_STORE_SIZE, value_name = "N")]
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

/// A non-negative number of seconds (decimals allowed).
fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    s.parse::<f64>()
        .ok()
        .and_then(|secs| std::time::Duration::try_from_secs_f64(secs).ok())
        .ok_or_else(|| format!("expected a number of seconds, got `{s}`"))
}

/// The `--api-key` value: not empty, and never shown by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKeyArg(pub(crate) String);

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
