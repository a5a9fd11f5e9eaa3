//! The engine's options: one typed struct ([`EngineConfig`]) built once by
//! the binaries from their flags, and the defaults both sides read
//! ([`defaults`]: clap's `default_value_t` names these constants, so a
//! default is written once).

use std::path::PathBuf;
use std::time::Duration;

use mlxcel_kv::StorageBackend;
use mlxcel_mlx::Dtype;
use mlxcel_model::{AttentionPath, TensorParallel, WeightMode};
use mlxcel_text::reasoning::ReasoningMarkers;

/// The defaults of [`EngineConfig::new`] that flags restate.
pub mod defaults {
    /// Sequences running at once (`--parallel`).
    pub const PARALLEL: usize = 4;
    /// Tokens per KV block (`--kv-block-size`).
    pub const KV_BLOCK_SIZE: usize = 32;
    /// Prefill tokens one step runs when nothing decides otherwise
    /// (`--prefill-chunk-size auto` picks by device:
    /// [`super::auto_prefill_chunk_size`]).
    pub const PREFILL_CHUNK_SIZE: usize = 512;
    /// Prefill chunk of `--prefill-chunk-size auto` on a GPU: one step for
    /// most prompts (measured on an H200, docs/performance.md).
    pub const GPU_PREFILL_CHUNK_SIZE: usize = 2048;
    /// Input rows from which a GPU product with a quantized matrix
    /// dequantizes it and runs a dense matmul (`--dequant-matmul-rows
    /// auto`): from there the dense one was faster on every large shape
    /// measured (H100, `mlxcel_model::layers::set_dequantized_matmul_rows`).
    pub const GPU_DEQUANT_MATMUL_ROWS: usize = 512;
    /// The same on a CPU, for `--weights quantized` (the CPU default
    /// dequantizes at load): MLX's CPU quantized matmul runs ~2 GFLOP/s at
    /// any row count, so dequantizing for the product pays from a few
    /// rows (SmolLM2 4-bit, float32, 700-token prompt on this 2-core
    /// machine: prefill 15.5 -> 186 tok/s at 16; at 1, decode fell from
    /// 9.6 to 1.9 tok/s).
    pub const CPU_DEQUANT_MATMUL_ROWS: usize = 16;
    /// Fewest weights (`out x in`) a quantized matrix needs for a GPU
    /// product to dequantize it (`mlxcel_model::layers::
    /// set_dequantized_matmul_min_weights`): 4 Mi. Smaller products are
    /// launch-bound, where the dequantization only adds a kernel
    /// (SmolLM2-135M's GPU prefill lost a third with its matrices of at
    /// most 0.9 Mi weights dequantized). No floor on a CPU, where the
    /// quantized matmul is slow at any size.
    pub const GPU_DEQUANT_MATMUL_MIN_WEIGHTS: usize = 4 << 20;
    /// Most bytes of block files the prompt cache's disk tier keeps
    /// (`--prompt-cache-disk-size`): 16 GiB.
    pub const PROMPT_CACHE_DISK_SIZE: u64 = 16 << 30;
}

/// Typed engine options, built once by the binaries from their flags.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// An MLX checkpoint directory.
    pub model_dir: PathBuf,
    /// The name the model is served under (default: the directory name).
    pub alias: Option<String>,
    /// Compute dtype; `None` = auto (float32 on CPU, checkpoint dtype on GPU).
    pub dtype: Option<Dtype>,
    /// Quantized weights: `None` = auto (dequantize on CPU, keep on GPU).
    pub weight_mode: Option<WeightMode>,
    /// A GGUF file's floating-point matrices at load (`--quantize`).
    pub quantize: GgufQuantize,
    /// Run on the GPU when MLX has one (default true).
    pub use_gpu: bool,
    /// Prefill tokens one step runs (and the chunk grid), in tokens.
    pub prefill_chunk_size: usize,
    /// Pad prefill chunks to a multiple of this many tokens; `None` = auto
    /// (32 on Apple GPUs with Neural Accelerators, M5 and newer; 0 elsewhere).
    pub prefill_tile: Option<usize>,
    /// Sequences running at once.
    pub parallel: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// KV cache budget in bytes; `None` = auto (room for `parallel`
    /// sequences of the model's full context, at most a quarter of RAM).
    pub kv_cache_budget: Option<usize>,
    /// KV storage; `None` = auto (paged when `parallel > 1` or the KV
    /// dtype is quantized).
    pub storage_backend: Option<StorageBackend>,
    /// How K/V are stored: the compute dtype, another float type, or
    /// quantized (int8, int4: paged storage only).
    pub kv_cache_dtype: mlxcel_kv::KvCacheDtype,
    /// How decode rows read a paged cache.
    pub attention_path: AttentionPath,
    /// Check KV invariants after every step (on in debug builds).
    pub check_invariants: bool,
    /// Reuse cached prompt prefixes across requests (paged storage only).
    pub prefix_cache: bool,
    /// Most unreferenced cached blocks kept; `None` = the whole pool.
    pub prefix_cache_capacity: Option<usize>,
    /// The prefix cache's disk tier (`--prompt-cache-dir`): blocks that
    /// leave RAM are saved there and read back by later lookups, across
    /// restarts. `None`: off. Needs the prefix cache; not with tensor
    /// parallelism.
    pub prompt_cache_dir: Option<PathBuf>,
    /// Most bytes of block files the disk tier keeps
    /// (`--prompt-cache-disk-size`, default
    /// [`defaults::PROMPT_CACHE_DISK_SIZE`]).
    pub prompt_cache_disk_size: u64,
    /// Most K/V tokens each sequence keeps in every layer (older ones are
    /// dropped from the front; positions keep counting). `None`: all (up
    /// to the context). A sliding-window layer keeps at most its window
    /// anyway (its KV group's keep, `mlxcel_kv::KvGroupConfig::keep_for`).
    pub max_kv_size: Option<usize>,
    /// A Jinja chat template file used instead of the model's own.
    pub chat_template: Option<PathBuf>,
    /// Let special-token strings typed in message content (`<|im_end|>`...)
    /// become control tokens, as the template's own markup does (default
    /// false: content is encoded as plain text, so a user cannot end their
    /// turn or forge another role's).
    pub special_tokens_in_content: bool,
    /// Which chat replies get their `<think>` block split off as reasoning
    /// (`mlxcel_text::reasoning`).
    pub reasoning_parser: ReasoningParser,
    /// Pipeline decode steps whose rows sample on the device: the next step
    /// is queued before the current step's tokens are read (default true).
    pub pipeline: bool,
    /// Prompt lookup verifies inside the decode pipeline: a step with
    /// verification rows is queued like a decode step, and the step after
    /// it takes each row's token in flight as its first input, with a
    /// draft looked up after a guess of that token (`worker/pipeline.rs`;
    /// `--pipelined-verification`, default false). Off by default: on a
    /// CPU it lost 17-26% of prompt lookup's decode speed (a CPU is bound
    /// by the steps' arithmetic, which wrong guesses and discarded steps
    /// add to; `CHANGELOG.md`), and it is not measured on a GPU yet.
    pub pipelined_verification: bool,
    /// Speculative decoding (`--speculative`, `--num-speculative-tokens`):
    /// decode rows verify draft tokens several at a time
    /// ([`crate::speculative`]). Not with tensor parallelism.
    pub speculative: crate::speculative::SpeculativeConfig,
    /// The draft model of `--speculative draft` (`--draft-model`): a
    /// checkpoint with the same tokenizer, loaded with the same compute
    /// settings.
    pub draft_model: Option<PathBuf>,
    /// Run every kind of step once at start, so the GPU kernels the engine
    /// needs are compiled before the first request (`crate::warmup`);
    /// `None` = auto (on when running on a GPU).
    pub warmup: Option<bool>,
    /// With quantized weights, products over at least this many input rows
    /// dequantize their matrix and run a dense matmul
    /// ([`mlxcel_model::layers::set_dequantized_matmul_rows`]); `Some(0)`:
    /// never; `None` = auto ([`defaults::GPU_DEQUANT_MATMUL_ROWS`] on a
    /// GPU, [`defaults::CPU_DEQUANT_MATMUL_ROWS`] on a CPU).
    pub dequant_matmul_rows: Option<usize>,
    /// Let MLX's CUDA backend use cuDNN's fused attention for prefill (it
    /// builds a graph per query/key shape, 50-800 ms each; default off: see
    /// docs/performance.md).
    pub cudnn_attention: bool,
    /// Batch-invariant execution (`--deterministic`,
    /// [`mlxcel_model::invariant`]): a request's tokens and logprobs are
    /// bit for bit the same whatever shares its steps (alone or batched,
    /// chunked or not, cold or from the prefix cache). Needs paged
    /// storage and, on a GPU, the paged attention path; not with tensor
    /// parallelism.
    pub deterministic: bool,
    /// Where MLX's CUDA backend keeps compiled kernels across restarts (a
    /// subdirectory per MLX version is used); `None`: MLX's default.
    pub kernel_cache_dir: Option<PathBuf>,
    /// Serve `/v1/embeddings` from any decoder (`--embeddings`): the last
    /// token's final hidden state, L2-normalised. An embedding checkpoint
    /// (sentence-transformers pooling files) serves them without it, pooled
    /// as its files say.
    pub embeddings: bool,
    /// Tensor parallelism (`--tensor-parallel`): this process's rank of
    /// the group. Rank 0 runs this engine; other ranks run
    /// [`crate::run_follower`]. Forces the paged KV
    /// backend and turns the decode pipeline off (each step's inputs must
    /// be known on the host to be broadcast).
    pub tensor_parallel: Option<TensorParallelConfig>,
    /// Test-only: make chosen forwards fail.
    #[cfg(feature = "fault-injection")]
    pub fault: crate::fault::FaultInjection,
}

/// When chat replies are split into reasoning (`reasoning_content`) and
/// content (`--reasoning-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningParser {
    /// `<think>` blocks when the chat template writes `<think>` (a
    /// reasoning model); else Gemma 4's thought channel when the
    /// vocabulary has its `<|channel>` and `<channel|>` tokens (as mlx_lm
    /// infers it); else none.
    #[default]
    Auto,
    /// Always: a `<think>` block opening the reply (or opened by the
    /// prompt) is reasoning.
    Think,
    /// Always: Gemma 4's thought channel (`<|channel>thought` …
    /// `<channel|>`) is reasoning.
    Gemma4,
    /// Never: the reply is content as generated.
    None,
}

impl ReasoningParser {
    /// The markers replies are split at: `template_thinks` when the chat
    /// template writes `<think>`, `in_vocabulary` whether a token is in
    /// the tokenizer's vocabulary.
    pub fn markers(
        self,
        template_thinks: bool,
        in_vocabulary: impl Fn(&str) -> bool,
    ) -> Option<ReasoningMarkers> {
        match self {
            ReasoningParser::Think => Some(ReasoningMarkers::THINK),
            ReasoningParser::Gemma4 => Some(ReasoningMarkers::GEMMA4_CHANNEL),
            ReasoningParser::None => None,
            ReasoningParser::Auto if template_thinks => Some(ReasoningMarkers::THINK),
            ReasoningParser::Auto => ReasoningMarkers::GEMMA4_CHANNEL
                .special_tokens
                .iter()
                .all(|t| in_vocabulary(t))
                .then_some(ReasoningMarkers::GEMMA4_CHANNEL),
        }
    }
}

impl EngineConfig {
    /// Defaults for `model_dir`.
    pub fn new(model_dir: PathBuf) -> Self {
        EngineConfig {
            model_dir,
            alias: None,
            dtype: None,
            weight_mode: None,
            quantize: GgufQuantize::Auto,
            use_gpu: true,
            prefill_chunk_size: defaults::PREFILL_CHUNK_SIZE,
            prefill_tile: None,
            parallel: defaults::PARALLEL,
            kv_block_size: defaults::KV_BLOCK_SIZE,
            kv_cache_budget: None,
            storage_backend: None,
            kv_cache_dtype: mlxcel_kv::KvCacheDtype::Auto,
            attention_path: AttentionPath::BatchedDecode,
            check_invariants: cfg!(debug_assertions),
            prefix_cache: true,
            prefix_cache_capacity: None,
            prompt_cache_dir: None,
            prompt_cache_disk_size: defaults::PROMPT_CACHE_DISK_SIZE,
            max_kv_size: None,
            special_tokens_in_content: false,
            reasoning_parser: ReasoningParser::Auto,
            pipeline: true,
            pipelined_verification: false,
            speculative: crate::speculative::SpeculativeConfig::default(),
            draft_model: None,
            warmup: None,
            dequant_matmul_rows: None,
            cudnn_attention: false,
            deterministic: false,
            kernel_cache_dir: None,
            chat_template: None,
            embeddings: false,
            tensor_parallel: None,
            #[cfg(feature = "fault-injection")]
            fault: crate::fault::FaultInjection::default(),
        }
    }
}

impl EngineConfig {
    /// The name the model is served under: the alias, else the model
    /// directory's name.
    pub fn model_id(&self) -> String {
        self.alias.clone().unwrap_or_else(|| {
            self.model_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        })
    }
}

/// `--quantize`: what becomes of a GGUF file's floating-point matrices
/// (tensor types MLX's loader dequantizes, such as Q6_K, or that mlxcel
/// decodes to float32, such as Q5_0) at load. Nothing is quantized when
/// weights run dequantized (`--weights dequantized`, the CPU default):
/// it would only round them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufQuantize {
    /// On a GPU (where a dense matrix costs 2 to 8 times the memory
    /// traffic of a quantized one), each quantized to about the precision
    /// the file stored it at (`Requantize::MatchSource`: 4 bits for 4-bit
    /// types, 8 for 5- to 8-bit ones; F32/F16/BF16 tensors kept); on a
    /// CPU, kept.
    Auto,
    /// Kept as the file has them.
    Off,
    /// Every one to this many bits (4 or 8), MLX affine with group size
    /// [`GGUF_QUANTIZE_GROUP`].
    Bits(i32),
}

/// Group size of `--quantize` (`mlxcel_model::gguf::REQUANTIZE_GROUP`).
pub const GGUF_QUANTIZE_GROUP: i32 = mlxcel_model::gguf::REQUANTIZE_GROUP;

/// `--prefill-chunk-size auto`, in tokens: 2048 on a GPU (one step for
/// most prompts; measured on an H200, docs/performance.md), 512 on a CPU
/// (long steps there delay every decode row sharing them).
pub fn auto_prefill_chunk_size(gpu: bool) -> usize {
    if gpu {
        defaults::GPU_PREFILL_CHUNK_SIZE
    } else {
        defaults::PREFILL_CHUNK_SIZE
    }
}

/// The input rows from which products with quantized matrices dequantize
/// them (`--dequant-matmul-rows`; `None`: never): `rows` as given, `0` as
/// never, `auto` ([`EngineConfig::dequant_matmul_rows`] `None`)
/// [`defaults::GPU_DEQUANT_MATMUL_ROWS`] on a GPU and
/// [`defaults::CPU_DEQUANT_MATMUL_ROWS`] on a CPU.
pub fn dequant_matmul_rows(rows: Option<usize>, gpu: bool) -> Option<usize> {
    match rows {
        Some(0) => None,
        Some(rows) => Some(rows),
        None if gpu => Some(defaults::GPU_DEQUANT_MATMUL_ROWS),
        None => Some(defaults::CPU_DEQUANT_MATMUL_ROWS),
    }
}

/// The fewest weights a quantized matrix needs for
/// [`dequant_matmul_rows`] to apply to it:
/// [`defaults::GPU_DEQUANT_MATMUL_MIN_WEIGHTS`] on a GPU, 0 on a CPU.
/// `MLXCEL_DEQUANT_MIN_WEIGHTS` (a count of weights) overrides it on
/// either, for benchmarks (`benches/gpu_decode_modes.sh`).
pub fn dequant_matmul_min_weights(gpu: bool) -> usize {
    min_weights_from(
        std::env::var("MLXCEL_DEQUANT_MIN_WEIGHTS").ok().as_deref(),
        gpu,
    )
}

/// [`dequant_matmul_min_weights`] given the variable's value (a value
/// that is not a count is ignored).
fn min_weights_from(var: Option<&str>, gpu: bool) -> usize {
    var.and_then(|v| v.trim().parse().ok()).unwrap_or(if gpu {
        defaults::GPU_DEQUANT_MATMUL_MIN_WEIGHTS
    } else {
        0
    })
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` reads `<think>` off the template first, then Gemma 4's
    /// channel off the vocabulary (both of its tokens), else nothing; the
    /// explicit values ignore both.
    #[test]
    fn reasoning_markers_follow_the_template_then_the_vocabulary() {
        let gemma4 = |t: &str| matches!(t, "<|channel>" | "<channel|>");
        let half = |t: &str| t == "<|channel>";
        let none = |_: &str| false;
        use ReasoningMarkers as M;
        use ReasoningParser as P;
        assert_eq!(P::Auto.markers(true, gemma4), Some(M::THINK));
        assert_eq!(P::Auto.markers(false, gemma4), Some(M::GEMMA4_CHANNEL));
        assert_eq!(P::Auto.markers(false, half), None);
        assert_eq!(P::Auto.markers(false, none), None);
        assert_eq!(P::Think.markers(false, none), Some(M::THINK));
        assert_eq!(P::Gemma4.markers(true, none), Some(M::GEMMA4_CHANNEL));
        assert_eq!(P::None.markers(true, gemma4), None);
    }

    #[test]
    fn dequantized_matmuls_start_at_the_rows_asked_or_the_devices_default() {
        assert_eq!(dequant_matmul_rows(None, true), Some(512));
        assert_eq!(dequant_matmul_rows(None, false), Some(16));
        assert_eq!(dequant_matmul_rows(Some(0), true), None);
        assert_eq!(dequant_matmul_rows(Some(0), false), None);
        assert_eq!(dequant_matmul_rows(Some(96), true), Some(96));
        // The weights floor: 4 Mi on a GPU, none on a CPU, or the
        // variable's count.
        assert_eq!(min_weights_from(None, true), 4 << 20);
        assert_eq!(min_weights_from(None, false), 0);
        assert_eq!(min_weights_from(Some("1000"), true), 1000);
        assert_eq!(min_weights_from(Some(" 0 "), true), 0);
        assert_eq!(min_weights_from(Some("lots"), true), 4 << 20);
    }
}
