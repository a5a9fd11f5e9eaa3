//! Graceful shutdown of the requests themselves.
//!
//! [`crate::serve`] stops accepting connections when its shutdown future
//! completes, and lets open requests run to their end for at most
//! [`crate::HttpConfig::shutdown_grace`]. Every request's event stream goes
//! through [`DrainingService`], which is how the deadline reaches them: when
//! it passes, each open request receives a [`GenerationEvent::Failed`] with
//! [`SHUTDOWN_MESSAGE`] (so a client gets an OpenAI error body, or an error
//! event at the end of its stream, instead of a connection reset), and its
//! engine stream is dropped, which cancels it in the engine. Requests
//! submitted after the signal are refused with a 503.

use std::sync::Arc;

use mlxcel_engine_api::{
    CacheReset, EmbeddingModel, EmbeddingRequest, EngineStats, EventStream, FailureKind,
    GenerationEvent, GenerationRequest, InferenceService, SubmitError, TokenizeRequest,
};
use tokio::sync::watch;

/// What a request still open when the shutdown deadline passes fails with.
pub const SHUTDOWN_MESSAGE: &str =
    "the server is shutting down and this request did not finish within its shutdown timeout";

/// What a request submitted after the shutdown signal is refused with (503).
pub const REFUSED_MESSAGE: &str = "the server is shutting down";

/// Where the server is on its way down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Serving normally.
    Serving,
    /// The shutdown signal came: no new requests, open ones run on.
    Draining,
    /// The shutdown deadline passed: open requests are failed.
    Expired,
}

/// An [`InferenceService`] that refuses requests once the server drains and
/// fails the open ones when the shutdown deadline passes (see the module
/// documentation). Everything else is passed through.
pub struct DrainingService {
    inner: Arc<dyn InferenceService>,
    phase: watch::Receiver<Phase>,
}

impl DrainingService {
    /// Wraps `inner`; `phase` says where the shutdown is.
    pub fn new(inner: Arc<dyn InferenceService>, phase: watch::Receiver<Phase>) -> Self {
        Self { inner, phase }
    }
}

impl DrainingService {
    /// `events`, failed at the shutdown deadline.
    fn drained(&self, events: EventStream) -> EventStream {
        // Handlers submit from the runtime's blocking pool; a caller
        // outside any runtime (a test) gets the engine's stream as is.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return events;
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        runtime.spawn(forward(events, tx, self.phase.clone()));
        rx
    }
}

impl InferenceService for DrainingService {
    fn model_id(&self) -> &str {
        self.inner.model_id()
    }

    fn context_length(&self) -> usize {
        self.inner.context_length()
    }

    fn submit(&self, request: GenerationRequest) -> Result<EventStream, SubmitError> {
        if *self.phase.borrow() != Phase::Serving {
            return Err(SubmitError::Unavailable(REFUSED_MESSAGE.to_owned()));
        }
        let events = self.inner.submit(request)?;
        Ok(self.drained(events))
    }

    fn embedding_model(&self) -> Option<EmbeddingModel> {
        self.inner.embedding_model()
    }

    fn embed(&self, request: EmbeddingRequest) -> Result<EventStream, SubmitError> {
        if *self.phase.borrow() != Phase::Serving {
            return Err(SubmitError::Unavailable(REFUSED_MESSAGE.to_owned()));
        }
        let events = self.inner.embed(request)?;
        Ok(self.drained(events))
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, SubmitError> {
        self.inner.detokenize(tokens)
    }

    fn tokenize(&self, request: &TokenizeRequest) -> Result<Vec<u32>, SubmitError> {
        self.inner.tokenize(request)
    }

    fn stats(&self) -> EngineStats {
        self.inner.stats()
    }

    fn reset_prefix_cache(&self, keep_disk: bool) -> Result<CacheReset, SubmitError> {
        self.inner.reset_prefix_cache(keep_disk)
    }

    fn ready(&self) -> bool {
        self.inner.ready()
    }

    fn unhealthy(&self) -> Option<String> {
        self.inner.unhealthy()
    }
}

/// Passes `events` on to `tx` until the request ends, its client goes away,
/// or the shutdown deadline passes (then the request fails with
/// [`SHUTDOWN_MESSAGE`]). Returning drops `events`: the engine cancels the
/// request if it still runs.
async fn forward(
    mut events: EventStream,
    tx: tokio::sync::mpsc::UnboundedSender<GenerationEvent>,
    mut phase: watch::Receiver<Phase>,
) {
    let expired = async move {
        // An error means the server state is gone without a deadline.
        if phase.wait_for(|p| *p == Phase::Expired).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(expired);
    loop {
        tokio::select! {
            // Events already produced go out before the deadline's error.
            biased;
            event = events.recv() => match event {
                Some(event) => {
                    if tx.send(event).is_err() {
                        return;
                    }
                }
                None => return,
            },
            () = tx.closed() => return,
            () = &mut expired => {
                let _ = tx.send(GenerationEvent::Failed {
                    kind: FailureKind::Shutdown,
                    message: SHUTDOWN_MESSAGE.to_owned(),
                });
                return;
            }
        }
    }
}
