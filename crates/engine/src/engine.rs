//! The engine thread and its handle.
//!
//! [`Engine::start`] loads the tokenizer and chat template on the caller's
//! thread and the model on a dedicated OS thread, which then serves requests
//! from a queue. [`Engine`] (the handle) implements [`InferenceService`]:
//! it renders and tokenizes prompts on the caller's thread, so bad requests
//! fail fast with a 400 and never reach the model.
//!
//! Requests run one at a time, first come first served; a request's stream
//! being dropped cancels it at the next token.

use crate::api::{
    FinishReason, GenerationEvent, GenerationRequest, InferenceService, Prompt, SubmitError,
    Timings, Usage,
};
use crate::chat_template::ChatTemplate;
use crate::detokenizer::IncrementalDetokenizer;
use crate::sampler::Sampler;
use crate::tokenizer::{eos_token_ids, TextTokenizer};
use mlxcel_mlx::Dtype;
use mlxcel_model::{LoadOptions, Model, ModelConfig, WeightMode};
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

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
    /// Run on the GPU when MLX has one (default true).
    pub use_gpu: bool,
    /// Longest prompt chunk one forward processes, in tokens.
    pub prefill_chunk_size: usize,
}

impl EngineConfig {
    /// Defaults for `model_dir`.
    pub fn new(model_dir: PathBuf) -> Self {
        EngineConfig {
            model_dir,
            alias: None,
            dtype: None,
            weight_mode: None,
            use_gpu: true,
            prefill_chunk_size: 512,
        }
    }
}

/// Errors of [`Engine::start`].
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Text(#[from] crate::tokenizer::TextError),
    #[error(transparent)]
    Model(#[from] mlxcel_model::ModelError),
    #[error(transparent)]
    Mlx(#[from] mlxcel_mlx::Error),
    #[error("engine thread: {0}")]
    Thread(String),
}

/// The text side shared by the handle and the engine thread.
struct Text {
    tokenizer: TextTokenizer,
    template: Option<ChatTemplate>,
    eos: Vec<u32>,
}

/// One queued request.
struct Job {
    prompt: Vec<u32>,
    request: GenerationRequest,
    submitted: Instant,
    events: UnboundedSender<GenerationEvent>,
}

/// Handle to a running engine. Cheap to share (`Arc`); dropping the last
/// handle stops the engine thread after its current request.
pub struct Engine {
    model_id: String,
    context_length: usize,
    text: Arc<Text>,
    jobs: mpsc::Sender<Job>,
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
}

impl Engine {
    /// Loads the model in `config.model_dir` and starts the engine thread.
    ///
    /// # Errors
    /// Unreadable tokenizer/template/config, unsupported model, weight errors.
    pub fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        let started = Instant::now();
        let dir = config.model_dir.clone();
        let model_config = ModelConfig::from_model_dir(&dir)?;
        let tokenizer = TextTokenizer::from_model_dir(&dir)?;
        let template = ChatTemplate::from_model_dir(&dir)?;
        // generation_config.json, config.json and the tokenizer's EOS.
        let eos = eos_token_ids(&dir, &tokenizer);
        let gpu = config.use_gpu && mlxcel_mlx::gpu_available();
        mlxcel_mlx::use_device(gpu)?;
        let dtype = config
            .dtype
            .unwrap_or_else(|| mlxcel_model::auto_dtype(&model_config, gpu));
        let weight_mode = config.weight_mode.unwrap_or(if gpu {
            WeightMode::Quantized
        } else {
            WeightMode::Dequantized
        });
        let model_id = config.alias.clone().unwrap_or_else(|| {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        });
        let context_length = model_config.max_position_embeddings;
        let model_type = model_config.model_type.clone();
        let text = Arc::new(Text {
            tokenizer,
            template,
            eos,
        });
        let (jobs, queue) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread_text = Arc::clone(&text);
        let chunk = config.prefill_chunk_size.max(1);
        std::thread::Builder::new()
            .name("mlxcel-engine".into())
            .spawn(move || {
                if let Err(e) = mlxcel_mlx::use_device(gpu) {
                    let _ = ready_tx.send(Err(EngineError::Mlx(e)));
                    return;
                }
                tracing::info!(dir = %dir.display(), ?dtype, ?weight_mode, gpu, "loading model");
                let options = LoadOptions { dtype, weight_mode };
                match crate::loader::load_model(&dir, model_config, options) {
                    Ok(model) => {
                        let _ = ready_tx.send(Ok(()));
                        serve_queue(model.as_ref(), &thread_text, chunk, &queue);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(EngineError::Model(e)));
                    }
                }
            })
            .map_err(|e| EngineError::Thread(e.to_string()))?;
        ready_rx
            .recv()
            .map_err(|_| EngineError::Thread("engine thread died while loading".into()))??;
        let info = EngineInfo {
            model_type,
            dtype,
            weight_mode,
            gpu,
            load_seconds: started.elapsed().as_secs_f64(),
        };
        tracing::info!(
            model = %model_id,
            load_s = info.load_seconds,
            gemv_forwarding = mlxcel_mlx::gemv_forwarding_active(),
            "model ready"
        );
        Ok(Engine {
            model_id,
            context_length,
            text,
            jobs,
            info,
        })
    }

    /// Renders (chat) and tokenizes a prompt exactly as it will be run.
    ///
    /// # Errors
    /// Template errors (`raise_exception`, bad messages) and tokenizer errors,
    /// as [`SubmitError::InvalidRequest`].
    pub fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, SubmitError> {
        let invalid = |e: crate::tokenizer::TextError| SubmitError::InvalidRequest {
            message: e.to_string(),
            param: Some("messages".into()),
        };
        match prompt {
            Prompt::Tokens(ids) => Ok(ids.clone()),
            Prompt::Text(t) => self.text.tokenizer.encode_text_prompt(t).map_err(invalid),
            Prompt::Chat(messages) => {
                let template =
                    self.text
                        .template
                        .as_ref()
                        .ok_or_else(|| SubmitError::InvalidRequest {
                            message: "this model has no chat template".into(),
                            param: Some("messages".into()),
                        })?;
                let rendered = template.render(messages, true).map_err(invalid)?;
                self.text
                    .tokenizer
                    .encode_chat_prompt(&rendered)
                    .map_err(invalid)
            }
        }
    }

    /// End-of-sequence token ids generation stops at.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.text.eos
    }
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
        let prompt = self.tokenize_prompt(&request.prompt)?;
        if prompt.is_empty() {
            return Err(SubmitError::InvalidRequest {
                message: "the prompt is empty".into(),
                param: Some("messages".into()),
            });
        }
        let vocab = self.text.tokenizer.vocab_size();
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::InvalidRequest {
                message: format!("token id {bad} is outside the vocabulary ({vocab})"),
                param: Some("prompt".into()),
            });
        }
        if prompt.len() >= self.context_length {
            return Err(SubmitError::ContextLengthExceeded {
                prompt_tokens: prompt.len(),
                context_length: self.context_length,
            });
        }
        request.max_tokens = request
            .max_tokens
            .min(self.context_length - prompt.len())
            .max(1);
        let (events, stream) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt,
            request,
            submitted: Instant::now(),
            events,
        };
        self.jobs
            .send(job)
            .map_err(|_| SubmitError::Unavailable("the engine has stopped".into()))?;
        Ok(stream)
    }
}

/// The engine thread's loop: one request at a time until every handle is gone.
fn serve_queue(model: &dyn Model, text: &Text, chunk: usize, queue: &mpsc::Receiver<Job>) {
    while let Ok(job) = queue.recv() {
        let events = job.events.clone();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_request(model, text, chunk, job)
        }));
        let message = match outcome {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e,
            Err(panic) => format!(
                "internal error: {}",
                panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".into())
            ),
        };
        tracing::error!(error = %message, "request failed");
        let _ = events.send(GenerationEvent::Failed { message });
    }
    tracing::info!("engine thread stopping");
}

/// Prefills `job`'s prompt and decodes until EOS, `max_tokens`, or the
/// client going away. Errors are returned as the message for its `Failed`.
fn run_request(model: &dyn Model, text: &Text, chunk: usize, job: Job) -> Result<(), String> {
    let span = tracing::info_span!("generate", prompt_tokens = job.prompt.len());
    let _enter = span.enter();
    let mut cache = model.new_cache();
    let mut sampler = Sampler::new(&job.request.sampling);
    let mut detok = IncrementalDetokenizer::new();
    let prefill_start = Instant::now();
    let mut logits = None;
    for piece in job.prompt.chunks(chunk) {
        if job.events.is_closed() {
            return Ok(());
        }
        logits = Some(
            model
                .forward(piece, &mut cache)
                .map_err(|e| e.to_string())?,
        );
    }
    let prefill_s = prefill_start.elapsed().as_secs_f64();
    let mut logits = logits.ok_or("empty prompt")?;
    let mut usage = Usage {
        prompt_tokens: job.prompt.len(),
        ..Usage::default()
    };
    let mut timings = Timings {
        prefill_s,
        ..Timings::default()
    };
    let mut first_token_at = None;
    let reason = loop {
        let host = logits.to_vec_f32().map_err(|e| e.to_string())?;
        let token = sampler.sample(&host);
        usage.completion_tokens += 1;
        let now = Instant::now();
        if first_token_at.is_none() {
            first_token_at = Some(now);
            timings.time_to_first_token_s = (now - job.submitted).as_secs_f64();
        }
        let is_eos = !job.request.ignore_eos && text.eos.contains(&token);
        let finish = if is_eos {
            Some(FinishReason::Stop)
        } else if usage.completion_tokens >= job.request.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        // The EOS token is not text; on the last token, whatever the
        // detokenizer held back goes out with it.
        let mut delta = if is_eos {
            String::new()
        } else {
            detok
                .push(&text.tokenizer, token)
                .map_err(|e| e.to_string())?
        };
        if finish.is_some() {
            delta.push_str(&detok.flush(&text.tokenizer).map_err(|e| e.to_string())?);
        }
        if (!is_eos || !delta.is_empty())
            && job
                .events
                .send(GenerationEvent::Delta { token, text: delta })
                .is_err()
        {
            tracing::info!("client went away; request cancelled");
            return Ok(());
        }
        if let Some(reason) = finish {
            break reason;
        }
        logits = model
            .forward(&[token], &mut cache)
            .map_err(|e| e.to_string())?;
    };
    if let Some(t0) = first_token_at {
        timings.decode_s = t0.elapsed().as_secs_f64();
    }
    tracing::info!(
        completion_tokens = usage.completion_tokens,
        ?reason,
        ttft_s = timings.time_to_first_token_s,
        "request finished"
    );
    let _ = job.events.send(GenerationEvent::Finished {
        reason,
        usage,
        timings,
    });
    Ok(())
}
