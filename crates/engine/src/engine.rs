//! The engine thread and its handle.
//!
//! [`Engine::start`] loads the tokenizer and chat template on the caller's
//! thread and the model on a dedicated OS thread, which then serves requests
//! from a queue. [`Engine`] (the handle) implements [`InferenceService`]:
//! it renders and tokenizes prompts on the caller's thread, so bad requests
//! fail fast with a 400 and never reach the model.
//!
//! The engine thread runs the continuous-batching loop of
//! [`crate::worker`]: up to `parallel` requests at once over one KV cache
//! (paged or dense), chunked and optionally tile-padded prefill interleaved
//! with batched decode. A request's stream being dropped cancels it at the
//! next step.

use crate::api::{
    CacheReset, EngineStats, GenerationRequest, InferenceService, Prompt, RequestField,
    ResponseFormat, SubmitError, TokenizeRequest, ToolChoice, ToolDefinition,
};
use crate::scheduler::SchedulerConfig;
use crate::worker::{Job, Message, ToolCallOutput, Worker, WorkerConfig};
use mlxcel_kv::{
    Admission, GroupAdmission, KvCache, KvCacheConfig, KvGroupConfig, KvLayout, PrefixCacheConfig,
    StorageBackend,
};
use mlxcel_mlx::Dtype;
use mlxcel_model::{AttentionPath, LoadOptions, Model, WeightMode};
use mlxcel_text::client_text::mark_client_text;
use mlxcel_text::constraint::{ConstrainedDecoder, Grammar};
use mlxcel_text::output::forced_call_prefix;
use mlxcel_text::{Text, TextError};
use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

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
    /// KV storage; `None` = auto (paged when `parallel > 1`).
    pub storage_backend: Option<StorageBackend>,
    /// How decode rows read a paged cache.
    pub attention_path: AttentionPath,
    /// Check KV invariants after every step (on in debug builds).
    pub check_invariants: bool,
    /// Reuse cached prompt prefixes across requests (paged storage only).
    pub prefix_cache: bool,
    /// Most unreferenced cached blocks kept; `None` = the whole pool.
    pub prefix_cache_capacity: Option<usize>,
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
    /// Run every kind of step once at start, so the GPU kernels the engine
    /// needs are compiled before the first request (`crate::warmup`);
    /// `None` = auto (on when running on a GPU).
    pub warmup: Option<bool>,
    /// Let MLX's CUDA backend use cuDNN's fused attention for prefill (it
    /// builds a graph per query/key shape, 50-800 ms each; default off: see
    /// docs/performance.md).
    pub cudnn_attention: bool,
    /// Where MLX's CUDA backend keeps compiled kernels across restarts (a
    /// subdirectory per MLX version is used); `None`: MLX's default.
    pub kernel_cache_dir: Option<PathBuf>,
    /// Tensor parallelism (`--tensor-parallel`): this process's rank of
    /// the group. Rank 0 runs this engine; other ranks run
    /// [`crate::run_follower`]. Forces the paged KV
    /// backend and turns the decode pipeline off (each step's inputs must
    /// be known on the host to be broadcast).
    pub tensor_parallel: Option<crate::TensorParallelConfig>,
    /// Test-only: make chosen forwards fail.
    #[cfg(feature = "fault-injection")]
    pub fault: crate::fault::FaultInjection,
}

/// When chat replies are split into reasoning (`reasoning_content`) and
/// content (`--reasoning-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningParser {
    /// When the chat template writes `<think>` (a reasoning model).
    #[default]
    Auto,
    /// Always: a `<think>` block opening the reply (or opened by the
    /// prompt) is reasoning.
    Think,
    /// Never: the reply is content as generated.
    None,
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
            prefill_chunk_size: 512,
            prefill_tile: None,
            parallel: 4,
            kv_block_size: 32,
            kv_cache_budget: None,
            storage_backend: None,
            attention_path: AttentionPath::BatchedDecode,
            check_invariants: cfg!(debug_assertions),
            prefix_cache: true,
            prefix_cache_capacity: None,
            max_kv_size: None,
            special_tokens_in_content: false,
            reasoning_parser: ReasoningParser::Auto,
            pipeline: true,
            warmup: None,
            cudnn_attention: false,
            kernel_cache_dir: None,
            chat_template: None,
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

/// Errors of [`Engine::start`].
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Text(#[from] TextError),
    #[error(transparent)]
    Model(#[from] mlxcel_model::ModelError),
    #[error(transparent)]
    Mlx(#[from] mlxcel_mlx::Error),
    #[error(transparent)]
    Kv(#[from] mlxcel_kv::KvError),
    #[error("engine thread: {0}")]
    Thread(String),
    #[error("bad engine option: {0}")]
    Config(String),
    /// The tensor-parallel group failed (a collective, a plan).
    #[error(transparent)]
    Group(#[from] crate::runner::tensor_parallel::wire::TpError),
    /// A tensor-parallel follower's step failed.
    #[error("follower step: {0}")]
    FollowerStep(crate::error::StepError),
    /// A step failed during start-up (the tensor-parallel set-up).
    #[error(transparent)]
    Step(#[from] crate::error::StepError),
}

/// Handle to a running engine. Cheap to share (`Arc`); dropping the last
/// handle stops the engine thread after its current request.
pub struct Engine {
    model_id: String,
    context_length: usize,
    /// Token ids accepted in `logit_bias`: the tokenizer's vocabulary
    /// (padding rows of the model's output have no text).
    vocab_size: usize,
    /// The engine thread's options (`parallel`, admission math).
    worker: WorkerConfig,
    /// See [`EngineConfig::special_tokens_in_content`].
    special_tokens_in_content: bool,
    /// Chat replies are split into reasoning and content
    /// ([`EngineConfig::reasoning_parser`], resolved at load).
    split_reasoning: bool,
    text: Arc<Text>,
    /// `None` once dropped (closing the channel stops the engine thread).
    jobs: Option<mpsc::Sender<Message>>,
    /// Joined on drop, so no MLX work outlives the handle.
    thread: Option<std::thread::JoinHandle<()>>,
    stats: Arc<Mutex<EngineStats>>,
    /// Tensor parallelism: the group's health (requests are refused once
    /// it is broken).
    group: Option<Arc<crate::runner::tensor_parallel::watchdog::GroupHealth>>,
    /// What was loaded, for logs and `/v1/models`.
    pub info: EngineInfo,
}

/// What [`Engine::start`] loaded.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub model_type: String,
    pub dtype: Dtype,
    pub weight_mode: WeightMode,
    pub gpu: bool,
    pub load_seconds: f64,
    /// KV storage in use.
    pub storage_backend: StorageBackend,
    /// Blocks in the KV pools (every KV group's together) and tokens per
    /// block.
    pub kv_blocks: usize,
    pub kv_block_size: usize,
    /// The KV cache's admission rule, per KV group (for `max_tokens`).
    pub kv_admission: GroupAdmission,
    /// Prefill tile in use (0: none).
    pub prefill_tile: usize,
    /// Prompt plus completion tokens one request may hold in the pool.
    pub max_request_tokens: usize,
}

impl Engine {
    /// Loads the model in `config.model_dir` and starts the engine thread.
    ///
    /// # Errors
    /// Unreadable tokenizer/template/config, unsupported model, weight errors.
    pub fn start(mut config: EngineConfig) -> Result<Engine, EngineError> {
        let started = Instant::now();
        let dir = config.model_dir.clone();
        let checkpoint = crate::loader::Checkpoint::open(&dir)?;
        let model_config = checkpoint.config()?;
        let vocab_size = model_config.vocab_size;
        let text = Arc::new(crate::loader::load_text(
            &checkpoint,
            config.chat_template.as_deref(),
            vocab_size,
        )?);
        let gpu = config.use_gpu && mlxcel_mlx::gpu_available();
        mlxcel_mlx::set_cudnn_attention(config.cudnn_attention)?;
        if let Some(dir) = &config.kernel_cache_dir {
            let dir = dir.join(format!("mlx-{}", mlxcel_mlx::version()));
            mlxcel_mlx::set_kernel_cache_dir(&dir)?;
        }
        mlxcel_mlx::use_device(gpu)?;
        let (dtype, weight_mode, quantize) = compute_types(&config, &model_config, gpu);
        let mut model_config = model_config;
        let group = match config.tensor_parallel {
            Some(tp) => {
                model_config.tensor_parallel = Some(tp.shard);
                // Followers address the pool by block id; the next step's
                // inputs must be on the host to be broadcast.
                config.storage_backend = Some(StorageBackend::Paged);
                config.pipeline = false;
                Some((
                    Arc::new(crate::runner::tensor_parallel::watchdog::GroupHealth::default()),
                    tp.timeout,
                ))
            }
            None => None,
        };
        let group_health = group.as_ref().map(|(health, _)| Arc::clone(health));
        let model_id = config.model_id();
        let context_length = model_config.max_position_embeddings;
        let model_type = model_config.model_type.clone();
        let (jobs, queue) = mpsc::channel::<Message>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread_text = Arc::clone(&text);
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let thread_stats = Arc::clone(&stats);
        let options = LoadOptions {
            dtype,
            weight_mode,
            quantize,
        };
        let identity = format!("{}|{:?}|{model_type}", dir.display(), dtype);
        let plan = ThreadPlan::new(&config, gpu, stable_hash(&identity))?;
        let thread = std::thread::Builder::new()
            .name("mlxcel-engine".into())
            .spawn(move || {
                let setup = (|| {
                    mlxcel_mlx::use_device(gpu)?;
                    tracing::info!(dir = %dir.display(), ?dtype, ?weight_mode, gpu, "loading model");
                    let model = checkpoint.load_model(model_config, options)?;
                    let kv = match plan.kv_cache(model.as_ref()) {
                        Ok(kv) => kv,
                        Err(e) => {
                            // Followers wait for the setup: let them exit.
                            if group.is_some() {
                                let _ = crate::runner::tensor_parallel::abort_setup();
                            }
                            return Err(e);
                        }
                    };
                    Ok::<_, EngineError>((model, kv))
                })();
                let (model, mut kv) = match setup {
                    Ok(loaded) => loaded,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let local = crate::runner::local::LocalRunner::new(
                    model.as_ref(),
                    kv.config().backend,
                    plan.worker.attention_path,
                );
                #[cfg(feature = "fault-injection")]
                let local = local.with_fault(plan.worker.fault);
                let runner: Box<dyn crate::runner::StepRunner + '_> = match group {
                    None => Box::new(local),
                    Some((health, timeout)) => {
                        match crate::runner::tensor_parallel::LeaderRunner::connect(
                            local,
                            model.as_ref(),
                            &mut kv,
                            health,
                            timeout,
                        ) {
                            Ok(leader) => Box::new(leader),
                            Err(e) => {
                                let _ = ready_tx.send(Err(e.into()));
                                return;
                            }
                        }
                    }
                };
                let loaded = plan.loaded(&kv);
                let _ = ready_tx.send(Ok(loaded));
                Worker::new(runner, &thread_text, kv, plan.worker, thread_stats).run(&queue);
            })
            .map_err(|e| EngineError::Thread(e.to_string()))?;
        let loaded = ready_rx
            .recv()
            .map_err(|_| EngineError::Thread("engine thread died while loading".into()))??;
        let info = EngineInfo {
            model_type,
            dtype,
            weight_mode,
            gpu,
            load_seconds: started.elapsed().as_secs_f64(),
            storage_backend: loaded.backend,
            kv_blocks: loaded.blocks,
            kv_block_size: loaded.block_size,
            kv_admission: loaded.admission,
            prefill_tile: plan.worker.scheduler.prefill_tile,
            max_request_tokens: loaded.max_request_tokens,
        };
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
        let engine = Engine {
            model_id,
            context_length,
            vocab_size: vocab_size.min(text.tokenizer.vocab_size()),
            worker: plan.worker,
            special_tokens_in_content: config.special_tokens_in_content,
            split_reasoning: match config.reasoning_parser {
                ReasoningParser::Think => true,
                ReasoningParser::None => false,
                ReasoningParser::Auto => {
                    text.template.as_ref().is_some_and(|t| t.knows_reasoning())
                }
            },
            text,
            jobs: Some(jobs),
            thread: Some(thread),
            stats,
            group: group_health,
            info,
        };
        if config.warmup.unwrap_or(gpu) {
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

    /// Renders (chat) and tokenizes a prompt exactly as it will be run.
    ///
    /// # Errors
    /// Template errors (`raise_exception`, bad messages) and tokenizer errors,
    /// as [`SubmitError::InvalidRequest`].
    pub fn tokenize_prompt(
        &self,
        prompt: &Prompt,
        tools: &[ToolDefinition],
    ) -> Result<Vec<u32>, SubmitError> {
        self.tokenize_request_prompt(prompt, tools, &serde_json::Map::new(), Encoding::RUN)
    }

    /// [`Engine::tokenize_prompt`] with extra chat template variables
    /// (`chat_template_kwargs`; client text, marked like the messages) and
    /// the choices of `encoding`.
    fn tokenize_request_prompt(
        &self,
        prompt: &Prompt,
        tools: &[ToolDefinition],
        kwargs: &serde_json::Map<String, serde_json::Value>,
        encoding: Encoding<'_>,
    ) -> Result<Vec<u32>, SubmitError> {
        let invalid = |e: TextError| SubmitError::InvalidRequest {
            message: e.to_string(),
            field: Some(RequestField::Prompt),
        };
        let Encoding {
            generation_prompt,
            special_tokens,
            reply,
        } = encoding;
        match prompt {
            Prompt::Tokens(ids) => Ok(ids.clone()),
            Prompt::Text(t) if special_tokens => {
                self.text.tokenizer.encode_text_prompt(t).map_err(invalid)
            }
            Prompt::Text(t) => self.text.tokenizer.encode(t, false).map_err(invalid),
            Prompt::Chat(messages) => {
                let template =
                    self.text
                        .template
                        .as_ref()
                        .ok_or_else(|| SubmitError::InvalidRequest {
                            message: "this model has no chat template".into(),
                            field: Some(RequestField::Prompt),
                        })?;
                let tokenizer = &self.text.tokenizer;
                let marked = if self.special_tokens_in_content {
                    None
                } else {
                    mark_client_text(tokenizer, messages, tools, kwargs)
                };
                match marked {
                    // Nothing typed looks like a control token: the plain path.
                    None => {
                        let rendered = template
                            .render_with_kwargs(messages, tools, generation_prompt, kwargs)
                            .map_err(invalid)?
                            + reply;
                        tokenizer.encode_chat_prompt(&rendered).map_err(invalid)
                    }
                    Some((messages, tools, kwargs)) => {
                        let rendered = template
                            .render_with_kwargs(&messages, &tools, generation_prompt, &kwargs)
                            .map_err(invalid)?
                            + reply;
                        tokenizer
                            .encode_marked_chat_prompt(&rendered)
                            .map_err(invalid)
                    }
                }
            }
        }
    }

    /// Refuses token ids outside the tokenizer's vocabulary (a 400 on
    /// `prompt`).
    fn check_token_ids(&self, tokens: &[u32]) -> Result<(), SubmitError> {
        let vocab = self.text.tokenizer.vocab_size();
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(SubmitError::InvalidRequest {
                message: format!("token id {bad} is outside the vocabulary ({vocab})"),
                field: Some(RequestField::Prompt),
            }),
            None => Ok(()),
        }
    }

    /// End-of-sequence token ids generation stops at.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.text.eos
    }
}

/// How a prompt is turned into tokens.
#[derive(Debug, Clone, Copy)]
struct Encoding<'a> {
    /// Chat: end with the assistant turn's header.
    generation_prompt: bool,
    /// Text: add the tokenizer's special tokens (a BOS).
    special_tokens: bool,
    /// Chat: markup of the engine's own after the generation prompt (a
    /// forced call's start).
    reply: &'a str,
}

impl Encoding<'_> {
    /// As a request runs: the generation prompt, special tokens, no reply.
    const RUN: Encoding<'static> = Encoding {
        generation_prompt: true,
        special_tokens: true,
        reply: "",
    };
}

impl InferenceService for Engine {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn context_length(&self) -> usize {
        self.context_length
    }

    fn submit(
        &self,
        mut request: GenerationRequest,
    ) -> Result<crate::api::EventStream, SubmitError> {
        let invalid = |field: RequestField, message: String| SubmitError::InvalidRequest {
            message,
            field: Some(field),
        };
        if let Some(reason) = self.group.as_ref().and_then(|g| g.broken()) {
            return Err(SubmitError::Unavailable(reason));
        }
        let n = request.n.max(1);
        if n > self.worker.parallel {
            return Err(invalid(
                RequestField::N,
                format!(
                    "n = {n} is more than the {} sequences this server runs at once (--parallel)",
                    self.worker.parallel
                ),
            ));
        }
        if let Some(&(bad, _)) = request
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= self.vocab_size)
        {
            return Err(invalid(
                RequestField::LogitBias,
                format!(
                    "token id {bad} is outside the vocabulary ({})",
                    self.vocab_size
                ),
            ));
        }
        let chat = matches!(request.prompt, Prompt::Chat(_));
        if !chat && !request.tools.is_empty() {
            return Err(invalid(
                RequestField::Tools,
                "tools need a chat prompt".into(),
            ));
        }
        // `tool_choice: none` hides the tools from the model.
        let tools: &[ToolDefinition] = if request.tool_choice == ToolChoice::None {
            &[]
        } else {
            &request.tools
        };
        let (grammar, reply) = grammar_of(&request)?.unzip();
        let constraints = match (&grammar, &self.text.grammar) {
            (Some((grammar, param)), Some(tokens)) => (0..n)
                .map(|_| ConstrainedDecoder::new(tokens, grammar))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid(*param, e.to_string()))?,
            (Some((_, param)), None) => {
                return Err(invalid(
                    *param,
                    "constrained output is not available for this model's tokenizer".into(),
                ))
            }
            (None, _) => Vec::new(),
        };
        let reply = reply.flatten();
        if !chat && !request.chat_template_kwargs.is_empty() {
            return Err(invalid(
                RequestField::ChatTemplateKwargs,
                "chat_template_kwargs need a chat prompt".into(),
            ));
        }
        if request.min_tokens > request.max_tokens {
            return Err(invalid(
                RequestField::MinTokens,
                format!(
                    "min_tokens ({}) is more than max_tokens ({})",
                    request.min_tokens, request.max_tokens
                ),
            ));
        }
        let prompt = self.tokenize_request_prompt(
            &request.prompt,
            tools,
            &request.chat_template_kwargs,
            Encoding {
                reply: reply.as_deref().unwrap_or(""),
                ..Encoding::RUN
            },
        )?;
        if prompt.is_empty() {
            return Err(invalid(RequestField::Prompt, "the prompt is empty".into()));
        }
        self.check_token_ids(&prompt)?;
        // A request must fit the model's context and, to its last token,
        // the KV pool with all its choices (else it could never be
        // admitted): `max_tokens` is clamped to both, with the engine
        // thread's own block count.
        let too_long = || SubmitError::ContextLengthExceeded {
            prompt_tokens: prompt.len(),
            context_length: self.context_length.min(self.info.max_request_tokens),
        };
        if prompt.len() >= self.context_length {
            return Err(too_long());
        }
        let want = request
            .max_tokens
            .min(self.context_length - prompt.len())
            .max(1);
        let max_tokens = self
            .info
            .kv_admission
            .max_new_tokens(prompt.len(), n, want)
            .ok_or_else(too_long)?;
        request.max_tokens = max_tokens;
        // Constrained output (a schema, a forced call) is all content.
        let reasoning = (chat && self.split_reasoning && grammar.is_none()).then(|| {
            let tail = &prompt[prompt.len().saturating_sub(8)..];
            let tail = self.text.tokenizer.decode(tail, false).unwrap_or_default();
            mlxcel_text::reasoning::ReasoningSplitter::prompt_opens_block(&tail)
        });
        let tool_calls = match reply {
            Some(prefix) => ToolCallOutput::Forced(prefix),
            None if chat && !tools.is_empty() => ToolCallOutput::Parsed,
            None => ToolCallOutput::Off,
        };
        let (events, stream) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt,
            request,
            submitted: Instant::now(),
            events,
            constraints,
            tool_calls,
            reasoning,
        };
        self.send(Message::Job(Box::new(job)))?;
        Ok(stream)
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, SubmitError> {
        self.check_token_ids(tokens)?;
        self.text
            .tokenizer
            .decode(tokens, false)
            .map_err(|e| SubmitError::InvalidRequest {
                message: e.to_string(),
                field: Some(RequestField::Prompt),
            })
    }

    fn tokenize(&self, request: &TokenizeRequest) -> Result<Vec<u32>, SubmitError> {
        let chat = matches!(request.prompt, Prompt::Chat(_));
        if !chat && !request.tools.is_empty() {
            return Err(SubmitError::InvalidRequest {
                message: "tools need chat messages".into(),
                field: Some(RequestField::Tools),
            });
        }
        if !chat && !request.chat_template_kwargs.is_empty() {
            return Err(SubmitError::InvalidRequest {
                message: "chat_template_kwargs need chat messages".into(),
                field: Some(RequestField::ChatTemplateKwargs),
            });
        }
        let tokens = self.tokenize_request_prompt(
            &request.prompt,
            &request.tools,
            &request.chat_template_kwargs,
            Encoding {
                generation_prompt: request.add_generation_prompt,
                special_tokens: request.add_special_tokens,
                reply: "",
            },
        )?;
        self.check_token_ids(&tokens)?;
        Ok(tokens)
    }

    fn stats(&self) -> EngineStats {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn unhealthy(&self) -> Option<String> {
        self.group.as_ref().and_then(|g| g.broken())
    }

    fn reset_prefix_cache(&self) -> Result<CacheReset, SubmitError> {
        let gone = || SubmitError::Unavailable("the engine has stopped".into());
        let (reply, outcome) = mpsc::channel();
        self.send(Message::ResetPrefixCache(reply))?;
        outcome.recv().map_err(|_| gone())
    }
}

impl Engine {
    fn send(&self, message: Message) -> Result<(), SubmitError> {
        self.jobs
            .as_ref()
            .and_then(|jobs| jobs.send(message).ok())
            .ok_or_else(|| SubmitError::Unavailable("the engine has stopped".into()))
    }
}

impl Drop for Engine {
    /// Closes the queue and waits for the engine thread: it finishes the
    /// requests it holds (whose clients, gone with the handle, cancel them
    /// at the next step) and any step still queued on the device, so no
    /// MLX work outlives the engine (a process exiting under a running
    /// evaluation corrupts MLX's heap).
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
    }
}

/// The grammar a request's output must follow with the field that asked
/// for it (a required or named tool call, or `response_format`), and for a
/// forced tool call the reply's start, which goes in the prompt
/// ([`forced_call_prefix`]): the model generates only the rest of the call
/// (for a named function, only its arguments), and the output filter builds
/// the call from it.
#[allow(clippy::type_complexity)]
fn grammar_of(
    request: &GenerationRequest,
) -> Result<Option<((Grammar, RequestField), Option<String>)>, SubmitError> {
    let only = match &request.tool_choice {
        ToolChoice::Required => None,
        ToolChoice::Function(name) => Some(name.clone()),
        ToolChoice::Auto | ToolChoice::None => {
            return Ok(request.response_format.as_ref().map(|f| {
                let grammar = match f {
                    ResponseFormat::JsonObject => Grammar::JsonObject,
                    ResponseFormat::JsonSchema(schema) => Grammar::JsonSchema(schema.clone()),
                };
                ((grammar, RequestField::ResponseFormat), None)
            }));
        }
    };
    let refuse = |message: &str| SubmitError::InvalidRequest {
        message: message.into(),
        field: Some(RequestField::ToolChoice),
    };
    if request.tools.is_empty() {
        return Err(refuse("tool_choice requires tools"));
    }
    if request.response_format.is_some() {
        return Err(refuse(
            "a required tool call cannot be combined with response_format",
        ));
    }
    let grammar = match &only {
        Some(name) => {
            let tool = request
                .tools
                .iter()
                .find(|t| &t.name == name)
                .ok_or_else(|| {
                    refuse(&format!("tool_choice names an unknown function `{name}`"))
                })?;
            Grammar::JsonSchema(tool.parameters.clone())
        }
        None => Grammar::ToolCalls {
            tools: request
                .tools
                .iter()
                .map(|t| (t.name.clone(), t.parameters.clone()))
                .collect(),
            single: !request.parallel_tool_calls,
        },
    };
    Ok(Some((
        (grammar, RequestField::ToolChoice),
        Some(forced_call_prefix(only.as_deref())),
    )))
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

/// The compute dtype, weight mode and GGUF re-quantization `config` asks
/// for on this device (`auto`: float32 and dequantized weights on a CPU,
/// the checkpoint's dtype and quantized weights on a GPU; see
/// [`GgufQuantize`]).
pub(crate) fn compute_types(
    config: &EngineConfig,
    model_config: &mlxcel_model::ModelConfig,
    gpu: bool,
) -> (Dtype, WeightMode, Option<mlxcel_model::gguf::Requantize>) {
    let dtype = config
        .dtype
        .unwrap_or_else(|| mlxcel_model::auto_dtype(model_config, gpu));
    let weight_mode = config.weight_mode.unwrap_or(if gpu {
        WeightMode::Quantized
    } else {
        WeightMode::Dequantized
    });
    use mlxcel_model::gguf::Requantize;
    let quantize = match config.quantize {
        _ if !crate::loader::is_gguf(&config.model_dir) => None,
        GgufQuantize::Off => None,
        _ if weight_mode == WeightMode::Dequantized => {
            if config.quantize != GgufQuantize::Auto {
                tracing::warn!("--quantize has no effect with dequantized weights");
            }
            None
        }
        GgufQuantize::Auto if gpu => Some(Requantize::MatchSource),
        GgufQuantize::Auto => None,
        GgufQuantize::Bits(bits) => Some(Requantize::All(mlxcel_model::config::QuantSpec {
            group_size: GGUF_QUANTIZE_GROUP,
            bits,
        })),
    };
    (dtype, weight_mode, quantize)
}

/// What the engine thread builds after loading, decided from the config.
#[derive(Debug, Clone, Copy)]
struct ThreadPlan {
    worker: WorkerConfig,
    block_size: usize,
    budget: Option<usize>,
    backend: StorageBackend,
    /// Prefix cache: (extra key, capacity in blocks) when on (paged
    /// storage only).
    prefix: Option<(u64, Option<usize>)>,
    /// Under `--tensor-parallel` (one KV group only).
    tensor_parallel: bool,
}

/// What the engine thread reports once ready.
struct Loaded {
    backend: StorageBackend,
    blocks: usize,
    block_size: usize,
    max_request_tokens: usize,
    admission: GroupAdmission,
}

impl ThreadPlan {
    fn new(config: &EngineConfig, gpu: bool, extra_key: u64) -> Result<Self, EngineError> {
        if config.parallel == 0 || config.kv_block_size == 0 || config.prefill_chunk_size == 0 {
            return Err(EngineError::Config(
                "--parallel, --kv-block-size and --prefill-chunk-size must be at least 1".into(),
            ));
        }
        let tile = config
            .prefill_tile
            .unwrap_or_else(|| auto_prefill_tile(gpu));
        let backend = config.storage_backend.unwrap_or(if config.parallel > 1 {
            StorageBackend::Paged
        } else {
            StorageBackend::Dense
        });
        Ok(ThreadPlan {
            worker: WorkerConfig {
                scheduler: SchedulerConfig {
                    prefill_chunk_size: config.prefill_chunk_size,
                    prefill_tile: tile,
                },
                parallel: config.parallel,
                attention_path: config.attention_path,
                check_invariants: config.check_invariants,
                max_kv_size: config.max_kv_size,
                pipeline: config.pipeline,
                #[cfg(feature = "fault-injection")]
                fault: config.fault,
            },
            block_size: config.kv_block_size,
            budget: config.kv_cache_budget,
            backend,
            // Several KV groups force paged storage (`kv_cache`), so the
            // prefix cache is decided with the cache.
            prefix: config
                .prefix_cache
                .then_some((extra_key, config.prefix_cache_capacity)),
            tensor_parallel: config.tensor_parallel.is_some(),
        })
    }

    /// The KV cache: the model's layers grouped by window into KV groups
    /// (`mlxcel_kv::KvGroupConfig`), sized from the budget (auto: `parallel`
    /// full contexts of the full-attention layers plus the window groups'
    /// share, at most a quarter of physical memory). Each window group gets
    /// room for `parallel` sequences at their worst (its keep plus a chunk:
    /// `Admission::blocks_for`) twice over, half for running sequences and
    /// half for the prefix cache; the first group (full attention, when the
    /// model has such layers) gets the rest. Several groups need paged
    /// storage, and can't run under tensor parallelism.
    fn kv_cache(&self, model: &dyn Model) -> Result<KvCache, EngineError> {
        let layout = model.kv_layout();
        let mut groups =
            KvGroupConfig::from_layer_windows(&model.layer_windows(), self.worker.max_kv_size);
        let mut backend = self.backend;
        if groups.len() > 1 {
            if self.tensor_parallel {
                return Err(EngineError::Config(format!(
                    "--tensor-parallel serves models whose layers share one attention window; \
                     this one has {} KV groups (sliding-window and full layers)",
                    groups.len()
                )));
            }
            if backend == StorageBackend::Dense {
                tracing::info!("KV groups need paged storage: using it");
                backend = StorageBackend::Paged;
            }
        }
        let bs = self.block_size;
        let group_bytes = |g: &KvGroupConfig| {
            KvLayout {
                layers: g.layers.len(),
                ..layout
            }
            .bytes_per_token()
                * bs
        };
        let (tile, chunk) = (
            self.worker.scheduler.prefill_tile,
            self.worker.scheduler.prefill_chunk_size,
        );
        // Window groups after the first: fixed room; the first takes the rest.
        let mut fixed_bytes = 0;
        for g in groups.iter_mut().skip(1) {
            let worst = Admission::new(bs, tile, g.keep, chunk).blocks_for(usize::MAX);
            g.num_blocks = 2 * self.worker.parallel * worst;
            fixed_bytes += g.num_blocks * group_bytes(g);
        }
        let first_bytes = group_bytes(&groups[0]).max(1);
        let per_seq = model.config().max_position_embeddings * first_bytes / bs;
        let budget = self.budget.unwrap_or_else(|| {
            (per_seq * self.worker.parallel + fixed_bytes).min(physical_memory_bytes() / 4)
        });
        groups[0].num_blocks = budget.saturating_sub(fixed_bytes) / first_bytes;
        let num_blocks = groups.iter().map(|g| g.num_blocks).sum();
        let prefix = self.prefix.map(|(extra_key, cap)| PrefixCacheConfig {
            extra_key,
            capacity_blocks: cap.unwrap_or(num_blocks),
        });
        let config = KvCacheConfig {
            layout,
            block_size: bs,
            num_blocks,
            backend,
            prefix: prefix.filter(|_| backend == StorageBackend::Paged),
        };
        for g in &groups {
            let slack = Admission::new(bs, tile, g.keep, chunk).slack();
            if g.num_blocks <= slack {
                return Err(EngineError::Config(format!(
                    "a KV cache budget of {budget} bytes holds {} blocks of {bs} tokens \
                     for the layers {:?}; at least {} are needed",
                    g.num_blocks,
                    g.layers,
                    slack + 1
                )));
            }
            tracing::info!(
                layers = g.layers.len(),
                window = ?g.window,
                keep = ?g.keep,
                blocks = g.num_blocks,
                bytes = g.num_blocks * group_bytes(g),
                "KV group"
            );
        }
        tracing::info!(budget_bytes = budget, blocks = num_blocks, groups = groups.len(), backend = %backend, "allocating KV cache");
        Ok(KvCache::with_groups(config, groups)?)
    }

    fn loaded(&self, kv: &KvCache) -> Loaded {
        let c = kv.config();
        Loaded {
            backend: c.backend,
            blocks: c.num_blocks,
            block_size: c.block_size,
            // With a KV window a request holds at most the window plus a
            // chunk, whatever its length.
            max_request_tokens: self.worker.admission(kv).max_request_tokens(),
            admission: self.worker.admission(kv),
        }
    }
}

/// `--prefill-chunk-size auto`, in tokens: 2048 on a GPU (one step for
/// most prompts; measured on an H200, docs/performance.md), 512 on a CPU
/// (long steps there delay every decode row sharing them).
pub fn auto_prefill_chunk_size(gpu: bool) -> usize {
    if gpu {
        2048
    } else {
        512
    }
}

/// `--prefill-tile auto`: 32 on Apple M5 and newer (GPU Neural
/// Accelerators prefer 32-token tiles), 0 elsewhere.
fn auto_prefill_tile(gpu: bool) -> usize {
    if gpu && apple_chip_generation().is_some_and(|g| g >= 5) {
        32
    } else {
        0
    }
}

/// The `N` of an "Apple MN ..." CPU brand string (macOS only).
fn apple_chip_generation() -> Option<u32> {
    if !cfg!(target_os = "macos") {
        return None;
    }
    let out = std::process::Command::new("sysctl")
        .args(["-n", "machdep.cpu.brand_string"])
        .output()
        .ok()?;
    let brand = String::from_utf8_lossy(&out.stdout);
    let rest = brand.trim().strip_prefix("Apple M")?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Physical memory in bytes (Linux `/proc/meminfo`, macOS `hw.memsize`);
/// 8 GiB when unknown.
fn physical_memory_bytes() -> usize {
    const FALLBACK: usize = 8 << 30;
    if let Ok(info) = std::fs::read_to_string("/proc/meminfo") {
        let kib = info
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok());
        if let Some(kib) = kib {
            return kib * 1024;
        }
    }
    std::process::Command::new("sysctl")
        .args(["-n", "hw.memsize"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(FALLBACK)
}

/// FNV-1a, 64-bit: a hash stable across builds and platforms (the prefix
/// cache's model identity key).
fn stable_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
