//! The handle to a running engine ([`Engine`]), which front ends use
//! through [`InferenceService`]: it builds each request's job on the
//! caller's thread (so bad requests fail fast with a 400 and never reach
//! the model) and sends it to the engine thread.

use std::sync::{mpsc, Arc, Mutex};

use mlxcel_kv::{GroupAdmission, StorageBackend};
use mlxcel_mlx::Dtype;
use mlxcel_model::WeightMode;

use crate::api::{
    CacheReset, EmbeddingModel, EmbeddingRequest, EngineStats, EventStream, GenerationRequest,
    InferenceService, Pooling, Prompt, RequestField, SubmitError, TokenizeRequest, ToolDefinition,
};
use crate::request::{Encoding, RequestBuilder};
use crate::runner::RunnerHealth;
use crate::worker::Message;

/// Handle to a running engine. Cheap to share (`Arc`); dropping the last
/// handle stops the engine thread after its current request.
pub struct Engine {
    pub(crate) model_id: String,
    /// Builds each request's job (text, limits).
    pub(crate) requests: RequestBuilder,
    /// `None` once dropped (closing the channel stops the engine thread).
    pub(crate) jobs: Option<mpsc::Sender<Message>>,
    /// Joined on drop, so no MLX work outlives the handle.
    pub(crate) thread: Option<std::thread::JoinHandle<()>>,
    pub(crate) stats: Arc<Mutex<EngineStats>>,
    /// The runner's health, when it can break (tensor parallelism):
    /// requests are refused once it is broken.
    pub(crate) health: Option<Arc<RunnerHealth>>,
    /// What was loaded, for logs and `/v1/models`.
    pub info: EngineInfo,
}

/// What [`Engine::start`] loaded.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// `config.json`'s `model_type`.
    pub model_type: String,
    /// Compute dtype.
    pub dtype: Dtype,
    /// Quantized weights kept quantized or dequantized.
    pub weight_mode: WeightMode,
    /// Running on a GPU.
    pub gpu: bool,
    /// Seconds from start to ready (before any warm-up).
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
        self.requests
            .encode(prompt, tools, &serde_json::Map::new(), Encoding::RUN)
    }

    /// End-of-sequence token ids generation stops at.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.requests.text.eos
    }

    fn send(&self, message: Message) -> Result<(), SubmitError> {
        self.jobs
            .as_ref()
            .and_then(|jobs| jobs.send(message).ok())
            .ok_or_else(|| SubmitError::Unavailable("the engine has stopped".into()))
    }
}

impl InferenceService for Engine {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn context_length(&self) -> usize {
        self.requests.limits.context_length
    }

    fn submit(&self, request: GenerationRequest) -> Result<EventStream, SubmitError> {
        if let Some(reason) = self.unhealthy() {
            return Err(SubmitError::Unavailable(reason));
        }
        let (job, stream) = self.requests.job(request)?;
        self.send(Message::Job(Box::new(job)))?;
        Ok(stream)
    }

    fn embedding_model(&self) -> Option<EmbeddingModel> {
        self.requests
            .limits
            .embedding
            .map(|(pooling, dimensions)| EmbeddingModel {
                pooling: match pooling {
                    mlxcel_model::pooling::Pooling::LastToken => Pooling::LastToken,
                    mlxcel_model::pooling::Pooling::Mean => Pooling::Mean,
                },
                dimensions,
            })
    }

    fn embed(&self, request: EmbeddingRequest) -> Result<EventStream, SubmitError> {
        if let Some(reason) = self.unhealthy() {
            return Err(SubmitError::Unavailable(reason));
        }
        let (job, stream) = self.requests.embedding_job(request)?;
        self.send(Message::Job(Box::new(job)))?;
        Ok(stream)
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, SubmitError> {
        self.requests.check_token_ids(tokens)?;
        self.requests
            .text
            .tokenizer
            .decode(tokens, false)
            .map_err(|e| SubmitError::InvalidRequest {
                message: e.to_string(),
                field: Some(RequestField::Prompt),
            })
    }

    fn tokenize(&self, request: &TokenizeRequest) -> Result<Vec<u32>, SubmitError> {
        self.requests.tokenize(request)
    }

    fn stats(&self) -> EngineStats {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn unhealthy(&self) -> Option<String> {
        self.health.as_ref().and_then(|h| h.broken())
    }

    fn reset_prefix_cache(&self, keep_disk: bool) -> Result<CacheReset, SubmitError> {
        let gone = || SubmitError::Unavailable("the engine has stopped".into());
        let (reply, outcome) = mpsc::channel();
        self.send(Message::ResetPrefixCache { reply, keep_disk })?;
        outcome.recv().map_err(|_| gone())
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
