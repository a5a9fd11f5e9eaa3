//! A fake engine and request helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use mlxcel_engine_api::{
    CacheReset, EmbeddingModel, EmbeddingRequest, EngineStats, EventStream, FinishReason,
    GenerationEvent, GenerationRequest, InferenceService, Pooling, Prompt, RequestField,
    SampledLogprobs, SubmitError, Timings, TokenLogprob, TokenizeRequest, Usage,
};
use mlxcel_http::{router, AppState, HttpConfig};
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tower::ServiceExt;

pub const MODEL: &str = "org/test-model";

/// Token ids the fake's `detokenize` knows (`t0` ... `t999`).
pub const VOCAB: u32 = 1000;

/// An engine without a model: answers every request with a scripted list of
/// events and records what it was asked.
pub struct FakeService {
    /// Submission `k` gets `scripts[k]`, the last one once they run out.
    scripts: Vec<Vec<GenerationEvent>>,
    /// Keep the sender after the script, so the stream stays open.
    hold_open: bool,
    refusal: Option<SubmitError>,
    /// Submissions accepted before `refusal` applies.
    refuse_after: usize,
    /// Every request submitted, in order.
    pub requests: Mutex<Vec<GenerationRequest>>,
    /// The senders kept open (only with `hold_open`).
    pub senders: Mutex<Vec<UnboundedSender<GenerationEvent>>>,
    /// Serves embeddings of this many numbers ([`FakeService::embedding`]).
    pub embedding_dims: Option<usize>,
    /// Every embedding request, in order.
    pub embeds: Mutex<Vec<EmbeddingRequest>>,
}

impl FakeService {
    pub fn new(script: Vec<GenerationEvent>) -> Arc<Self> {
        Arc::new(Self::base(script))
    }

    /// Submission `k` gets `scripts[k]` (the last one after that).
    pub fn scripted(scripts: Vec<Vec<GenerationEvent>>) -> Arc<Self> {
        Arc::new(Self {
            scripts,
            ..Self::base(Vec::new())
        })
    }

    /// "Hel", an empty delta (held-back bytes), "lo", then Finished(stop).
    pub fn hello() -> Arc<Self> {
        Self::new(hello_script(FinishReason::Stop))
    }

    /// Sends `script` and keeps the stream open.
    pub fn holding_open(script: Vec<GenerationEvent>) -> Arc<Self> {
        Arc::new(Self {
            hold_open: true,
            ..Self::base(script)
        })
    }

    /// Refuses every request with `err`.
    pub fn refusing(err: SubmitError) -> Arc<Self> {
        Self::refusing_after(0, err)
    }

    /// Accepts `accepted` requests (sending `hello_script` and holding them
    /// open), then refuses every other with `err`.
    pub fn refusing_after(accepted: usize, err: SubmitError) -> Arc<Self> {
        Arc::new(Self {
            refusal: Some(err),
            refuse_after: accepted,
            hold_open: true,
            ..Self::base(hello_script(FinishReason::Stop))
        })
    }

    fn base(script: Vec<GenerationEvent>) -> Self {
        Self {
            scripts: vec![script],
            hold_open: false,
            refusal: None,
            refuse_after: 0,
            requests: Mutex::new(Vec::new()),
            senders: Mutex::new(Vec::new()),
            embedding_dims: None,
            embeds: Mutex::new(Vec::new()),
        }
    }

    /// An engine that embeds into `dims` numbers (last-token pooling): a
    /// prompt of `k` tokens (text: one per character) gets the unit vector
    /// along `[k, k + 1, ..., k + dims - 1]`; ids from [`VOCAB`] on are
    /// refused naming the prompt.
    pub fn embedding(dims: usize) -> Arc<Self> {
        Arc::new(Self {
            embedding_dims: Some(dims),
            ..Self::base(Vec::new())
        })
    }

    /// The fake's vector for a prompt of `k` tokens in `dims` numbers.
    pub fn fake_vector(k: usize, dims: usize) -> Vec<f32> {
        let v: Vec<f64> = (0..dims).map(|i| (k + i) as f64).collect();
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.iter().map(|x| (x / norm) as f32).collect()
    }

    pub fn last_request(&self) -> GenerationRequest {
        self.requests.lock().unwrap().last().cloned().unwrap()
    }

    pub fn request_count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
}

impl InferenceService for FakeService {
    fn model_id(&self) -> &str {
        MODEL
    }

    fn context_length(&self) -> usize {
        4096
    }

    fn submit(&self, request: GenerationRequest) -> Result<EventStream, SubmitError> {
        let n = request.n;
        let submitted = {
            let mut requests = self.requests.lock().unwrap();
            requests.push(request);
            requests.len() - 1
        };
        if let Some(err) = &self.refusal {
            if submitted >= self.refuse_after {
                return Err(err.clone());
            }
        }
        let script = &self.scripts[submitted.min(self.scripts.len() - 1)];
        let (tx, rx) = unbounded_channel();
        for event in choices_script(script, n) {
            tx.send(event).unwrap();
        }
        if self.hold_open {
            self.senders.lock().unwrap().push(tx);
        }
        Ok(rx)
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, SubmitError> {
        tokens
            .iter()
            .map(|&t| {
                if t < VOCAB {
                    Ok(format!("t{t}"))
                } else {
                    Err(SubmitError::InvalidRequest {
                        message: format!("token {t} is outside the vocabulary"),
                        field: Some(RequestField::Prompt),
                    })
                }
            })
            .collect()
    }

    /// Text: one token per character (its code point); chat: one token
    /// per character of `role: content` lines, plus 3 for the generation
    /// prompt.
    fn tokenize(&self, request: &TokenizeRequest) -> Result<Vec<u32>, SubmitError> {
        let text = match &request.prompt {
            Prompt::Text(text) => text.clone(),
            Prompt::Tokens(ids) => return Ok(ids.clone()),
            Prompt::Infill(infill) => {
                format!("{}{}{}", infill.prefix, infill.suffix, infill.middle)
            }
            Prompt::Chat(messages) => messages
                .iter()
                .map(|m| format!("{}: {}\n", m.role, m.content.as_deref().unwrap_or("")))
                .collect(),
        };
        let mut ids: Vec<u32> = text.chars().map(|c| c as u32).collect();
        if matches!(request.prompt, Prompt::Chat(_)) && request.add_generation_prompt {
            ids.extend([1, 2, 3]);
        }
        Ok(ids)
    }

    fn embedding_model(&self) -> Option<EmbeddingModel> {
        self.embedding_dims.map(|dimensions| EmbeddingModel {
            pooling: Pooling::LastToken,
            dimensions,
        })
    }

    fn embed(&self, request: EmbeddingRequest) -> Result<EventStream, SubmitError> {
        let dims = self
            .embedding_dims
            .ok_or_else(|| SubmitError::InvalidRequest {
                message: "no embeddings".into(),
                field: None,
            })?;
        self.embeds.lock().unwrap().push(request.clone());
        let k = match &request.prompt {
            Prompt::Text(text) => text.chars().count(),
            Prompt::Tokens(ids) if ids.iter().any(|&t| t >= VOCAB) => {
                return Err(SubmitError::InvalidRequest {
                    message: "token outside the vocabulary".into(),
                    field: Some(RequestField::Prompt),
                })
            }
            Prompt::Tokens(ids) => ids.len(),
            _ => 0,
        };
        if k > 4096 {
            return Err(SubmitError::ContextLengthExceeded {
                prompt_tokens: k,
                context_length: 4096,
            });
        }
        let (tx, rx) = unbounded_channel();
        tx.send(GenerationEvent::Embedding {
            vector: Self::fake_vector(k, dims),
            usage: Usage {
                prompt_tokens: k,
                completion_tokens: 0,
                cached_tokens: 0,
            },
        })
        .unwrap();
        Ok(rx)
    }

    fn reset_prefix_cache(&self, keep_disk: bool) -> Result<CacheReset, SubmitError> {
        let disk = if keep_disk { 0 } else { 2 };
        Ok(CacheReset {
            blocks_freed: 3,
            bytes_freed: 3 * 1024,
            disk_blocks_freed: disk,
            disk_bytes_freed: disk * 4096,
        })
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.senders.lock().unwrap().len(),
            waiting: 1,
            kv_storage_backend: "paged".into(),
            kv_cache_dtype: "int8".into(),
            kv_block_size: 32,
            kv_block_bytes: 1024,
            kv_blocks_total: 100,
            kv_blocks_used: 10,
            kv_blocks_free: 90,
            kv_blocks_active: 2,
            kv_blocks_cached: 8,
            prefix_cache_enabled: true,
            prefix_cache_capacity_blocks: 100,
            prefix_cache_lookups: 4,
            prefix_cache_hits: 3,
            prefix_cache_misses: 1,
            prefix_cache_tokens_queried: 400,
            prefix_cache_tokens_reused: 256,
            prefix_cache_inserts: 9,
            prefix_cache_evictions: 1,
            steps: 50,
            prefill_steps: 5,
            decode_steps: 45,
            prefill_tokens: 400,
            decode_tokens: 90,
            attention_batched_rows: 80,
            attention_per_row_rows: 10,
            pipelined_steps: 7,
            kv_groups: vec![
                mlxcel_engine_api::KvGroupStats {
                    layers: 3,
                    window: None,
                    block_bytes: 768,
                    blocks_total: 80,
                    blocks_used: 8,
                    blocks_free: 72,
                    blocks_active: 2,
                    blocks_cached: 8,
                },
                mlxcel_engine_api::KvGroupStats {
                    layers: 1,
                    window: Some(512),
                    block_bytes: 256,
                    blocks_total: 20,
                    blocks_used: 2,
                    blocks_free: 18,
                    blocks_active: 0,
                    blocks_cached: 0,
                },
            ],
            disk: Some(mlxcel_engine_api::DiskCacheStats {
                blocks: 5,
                bytes: 5 * 1100,
                capacity_bytes: 1 << 20,
                hits: 4,
                snapshots: 0,
                snapshot_hits: 0,
                writes: 6,
                write_bytes: 6 * 1100,
                evictions: 1,
                skipped: 2,
                foreign: 3,
                write_errors: 0,
                writable: true,
            }),
            ..EngineStats::default()
        }
    }
}

/// `script` as sent for a request of `n` choices: a script that names only
/// choice 0 is played once per choice (choice 0's events, then choice 1's,
/// ...); one that names other choices is sent as it is.
fn choices_script(script: &[GenerationEvent], n: usize) -> Vec<GenerationEvent> {
    let index_of = |event: &GenerationEvent| match event {
        GenerationEvent::Delta { index, .. }
        | GenerationEvent::PromptLogprobs { index, .. }
        | GenerationEvent::ToolCallStart { index, .. }
        | GenerationEvent::ToolCallArguments { index, .. }
        | GenerationEvent::Finished { index, .. } => *index,
        GenerationEvent::Failed { .. } | GenerationEvent::Embedding { .. } => 0,
    };
    if n == 1 || script.iter().any(|e| index_of(e) != 0) {
        return script.to_vec();
    }
    (0..n)
        .flat_map(|choice| {
            script.iter().cloned().map(move |mut event| {
                match &mut event {
                    GenerationEvent::Delta { index, .. }
                    | GenerationEvent::PromptLogprobs { index, .. }
                    | GenerationEvent::ToolCallStart { index, .. }
                    | GenerationEvent::ToolCallArguments { index, .. }
                    | GenerationEvent::Finished { index, .. } => *index = choice,
                    GenerationEvent::Failed { .. } | GenerationEvent::Embedding { .. } => {}
                }
                event
            })
        })
        .collect()
}

pub const USAGE: Usage = Usage {
    prompt_tokens: 7,
    completion_tokens: 3,
    cached_tokens: 2,
};

pub fn delta(text: &str) -> GenerationEvent {
    delta_at(0, text)
}

/// Text of choice `index`.
pub fn delta_at(index: usize, text: &str) -> GenerationEvent {
    GenerationEvent::Delta {
        index,
        token: 1,
        text: text.to_owned(),
        reasoning: String::new(),
        logprobs: None,
    }
}

/// Text of choice `index` completed by token `token`, with its logprobs.
pub fn delta_lp(
    index: usize,
    token: u32,
    text: &str,
    logprobs: SampledLogprobs,
) -> GenerationEvent {
    GenerationEvent::Delta {
        index,
        token,
        text: text.to_owned(),
        reasoning: String::new(),
        logprobs: Some(logprobs),
    }
}

/// A token's logprob entry; its bytes are its text's.
pub fn token_lp(id: u32, text: &str, logprob: f32) -> TokenLogprob {
    TokenLogprob {
        id,
        text: text.to_owned(),
        bytes: text.as_bytes().to_vec(),
        logprob,
    }
}

/// Sampled token `(id, text, logprob)` with alternatives `top`.
pub fn sampled(token: (u32, &str, f32), top: &[(u32, &str, f32)]) -> SampledLogprobs {
    SampledLogprobs {
        token: token_lp(token.0, token.1, token.2),
        top: top
            .iter()
            .map(|&(id, text, lp)| token_lp(id, text, lp))
            .collect(),
    }
}

/// The start of tool call `id` of choice `index`.
pub fn tool_call_at(index: usize, id: &str, name: &str) -> GenerationEvent {
    GenerationEvent::ToolCallStart {
        index,
        id: id.to_owned(),
        name: name.to_owned(),
    }
}

/// More arguments of choice `index`'s latest tool call.
pub fn tool_args_at(index: usize, arguments: &str) -> GenerationEvent {
    GenerationEvent::ToolCallArguments {
        index,
        arguments: arguments.to_owned(),
    }
}

pub fn finished(reason: FinishReason) -> GenerationEvent {
    finished_at(0, reason, USAGE)
}

/// Choice `index` finished with `usage`.
pub fn finished_at(index: usize, reason: FinishReason, usage: Usage) -> GenerationEvent {
    GenerationEvent::Finished {
        index,
        reason,
        usage,
        timings: Timings::default(),
        stop_sequence: None,
    }
}

pub fn hello_script(reason: FinishReason) -> Vec<GenerationEvent> {
    vec![delta("Hel"), delta(""), delta("lo"), finished(reason)]
}

pub fn app(service: Arc<FakeService>) -> Router {
    router(AppState::new(service))
}

pub fn app_with(service: Arc<FakeService>, config: HttpConfig) -> Router {
    router(AppState::with_config(service, config))
}

/// A response read to its end.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|err| {
            panic!("not JSON ({err}): {}", String::from_utf8_lossy(&self.body))
        })
    }

    /// Asserts an OpenAI error body and returns its `error` object.
    pub fn error(&self, status: StatusCode) -> Value {
        assert_eq!(
            self.status,
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.headers["content-type"], "application/json",
            "error bodies are JSON"
        );
        let body = self.json();
        let error = body["error"].clone();
        // Key order depends on serde_json's `preserve_order` feature.
        let mut keys: Vec<&String> = error.as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(keys, ["code", "message", "param", "type"], "body: {body}");
        assert!(!error["message"].as_str().unwrap().is_empty());
        error
    }
}

pub async fn send(app: Router, request: Request<Body>) -> Reply {
    let response = app.oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        headers,
        body,
    }
}

pub async fn post_json(app: Router, body: Value) -> Reply {
    post_raw(app, Some("application/json"), body.to_string()).await
}

/// Posts `body` to `/v1/completions`.
pub async fn post_completion(app: Router, body: Value) -> Reply {
    post_raw_to(
        app,
        "/v1/completions",
        Some("application/json"),
        body.to_string(),
    )
    .await
}

pub async fn post_raw(app: Router, content_type: Option<&str>, body: impl Into<Body>) -> Reply {
    post_raw_to(app, "/v1/chat/completions", content_type, body).await
}

pub async fn post_raw_to(
    app: Router,
    uri: &str,
    content_type: Option<&str>,
    body: impl Into<Body>,
) -> Reply {
    let mut request = Request::post(uri);
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    send(app, request.body(body.into()).unwrap()).await
}

pub async fn get(app: Router, uri: &str) -> Reply {
    send(app, Request::get(uri).body(Body::empty()).unwrap()).await
}

/// The `data:` payloads of an SSE body, in order (keep-alive comments
/// skipped).
pub fn sse_data(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    text.split("\n\n")
        .filter(|event| !event.trim().is_empty())
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|line| line.strip_prefix("data: "))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// The JSON payloads of an SSE body, which must end with `[DONE]`.
pub fn sse_json(reply: &Reply) -> Vec<Value> {
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.headers["content-type"], "text/event-stream");
    let mut data = sse_data(&reply.body);
    assert_eq!(data.pop().as_deref(), Some("[DONE]"), "last event");
    data.iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// A minimal valid request body.
pub fn hello_request() -> Value {
    serde_json::json!({"messages": [{"role": "user", "content": "Hi"}]})
}
