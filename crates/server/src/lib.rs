//! mlxcel's HTTP layer: OpenAI-compatible routes over an
//! [`InferenceService`] (see docs/architecture.md, crates/server).
//!
//! [`router`] builds the whole application without a socket, so tests drive
//! it with `tower::ServiceExt::oneshot`; [`serve`] runs it on a listener with
//! graceful shutdown. Every request body is parsed at the edge into a
//! [`validate::ValidatedChatRequest`] or a
//! [`validate::ValidatedCompletionRequest`]; every error a client sees is an
//! [`error::ApiError`], turned into the OpenAI error body in one place.
//! With an API key configured, [`auth`] refuses every request but
//! `GET /health` that lacks it; [`cors`] lets browsers of allowed origins
//! call the API. `GET /openapi.json` describes every route ([`openapi`]).
//! `POST /v1/responses` (the Responses API) runs through the chat path and
//! keeps its answers in a bounded in-memory store
//! ([`HttpConfig::responses_store_size`]); `POST /tokenize` and
//! `POST /detokenize` count and decode against the served tokenizer.
//! `POST /v1/messages` and `POST /v1/messages/count_tokens` ([`anthropic`],
//! Anthropic's Messages API) run through the same chat path and answer
//! errors in Anthropic's shape. `POST /v1/embeddings` ([`embeddings`])
//! embeds text or token ids with the served model.
//! [`shutdown`] lets open requests finish (or fail, at the deadline) when
//! [`serve`] stops.

pub mod anthropic;
pub mod auth;
mod choices;
mod completions;
pub mod cors;
pub mod embeddings;
pub mod error;
mod extract;
mod infill;
pub mod metrics;
pub mod openai;
pub mod openapi;
mod responses;
mod routes;
pub mod shutdown;
mod sse;
mod tokenize;
pub mod validate;

use std::future::{Future, IntoFuture};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::DefaultBodyLimit;
use axum::http::{Method, Request};
use axum::response::sse::KeepAlive;
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use mlxcel_engine_api::InferenceService;
use tower_http::decompression::RequestDecompressionLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

/// The defaults of [`HttpConfig::default`] that flags restate (clap's
/// `default_value_t` names these constants, so a default is written once).
pub mod defaults {
    /// `max_tokens` of a request that sets none (`--default-max-tokens`).
    pub const MAX_TOKENS: usize = 512;
    /// Responses kept for `previous_response_id` (`--responses-store-size`).
    pub const RESPONSES_STORE_SIZE: usize = 256;
}

/// Settings of the HTTP layer, built once from the command line. `Debug`
/// never shows the API key.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// Largest accepted request body; larger ones get 413.
    pub body_limit_bytes: usize,
    /// `max_tokens` of a request that sets neither `max_tokens` nor
    /// `max_completion_tokens` (the engine clamps it to the context).
    pub default_max_tokens: usize,
    /// Interval of SSE keep-alive comments on a quiet stream.
    pub keep_alive_interval: Duration,
    /// After the shutdown signal, how long [`serve`] lets open requests
    /// (streams included) run; then they fail with
    /// [`shutdown::SHUTDOWN_MESSAGE`] and [`serve`] returns.
    pub shutdown_grace: Duration,
    /// With `Some`, every request but `GET /health` must carry
    /// `Authorization: Bearer <key>` or `x-api-key: <key>` (see [`auth`]).
    pub api_key: Option<String>,
    /// Origins whose browser pages may call the API (see [`cors`]).
    pub allowed_origins: cors::AllowedOrigins,
    /// Most responses of `POST /v1/responses` kept for
    /// `previous_response_id` and `GET /v1/responses/{id}`; storing one
    /// more evicts the oldest. 0 turns the store off (then `store: true`
    /// and `previous_response_id` are a 400).
    pub responses_store_size: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            body_limit_bytes: 4 * 1024 * 1024,
            default_max_tokens: defaults::MAX_TOKENS,
            keep_alive_interval: Duration::from_secs(15),
            shutdown_grace: Duration::from_secs(30),
            api_key: None,
            allowed_origins: cors::AllowedOrigins::Disabled,
            responses_store_size: defaults::RESPONSES_STORE_SIZE,
        }
    }
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("body_limit_bytes", &self.body_limit_bytes)
            .field("default_max_tokens", &self.default_max_tokens)
            .field("keep_alive_interval", &self.keep_alive_interval)
            .field("shutdown_grace", &self.shutdown_grace)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("allowed_origins", &self.allowed_origins)
            .field("responses_store_size", &self.responses_store_size)
            .finish()
    }
}

/// What every handler shares: the engine behind its trait, and the config.
/// Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    /// The engine, behind [`shutdown::DrainingService`].
    service: Arc<dyn InferenceService>,
    /// Drives the shutdown of open requests (see [`shutdown`]).
    phase: tokio::sync::watch::Sender<shutdown::Phase>,
    config: HttpConfig,
    started_at: u64,
    metrics: Arc<metrics::Metrics>,
    /// Stored responses of the Responses API.
    responses: Arc<responses::store::ResponseStore>,
}

impl AppState {
    /// State over `service` with the default [`HttpConfig`].
    pub fn new(service: Arc<dyn InferenceService>) -> Self {
        Self::with_config(service, HttpConfig::default())
    }

    /// State over `service` with `config`. Requests reach `service` through
    /// a [`shutdown::DrainingService`] that [`serve`] drives.
    pub fn with_config(service: Arc<dyn InferenceService>, config: HttpConfig) -> Self {
        let (phase, phase_rx) = tokio::sync::watch::channel(shutdown::Phase::Serving);
        Self {
            inner: Arc::new(Inner {
                service: Arc::new(shutdown::DrainingService::new(service, phase_rx)),
                phase,
                responses: Arc::new(responses::store::ResponseStore::new(
                    config.responses_store_size,
                )),
                config,
                started_at: openai::unix_now(),
                metrics: Arc::new(metrics::Metrics::new()),
            }),
        }
    }

    /// The engine.
    pub fn service(&self) -> &dyn InferenceService {
        self.inner.service.as_ref()
    }

    /// An owned handle to the engine (for blocking work off the runtime).
    pub fn service_handle(&self) -> Arc<dyn InferenceService> {
        Arc::clone(&self.inner.service)
    }

    /// The HTTP settings.
    pub fn config(&self) -> &HttpConfig {
        &self.inner.config
    }

    /// Unix seconds at which this state was made (the model's `created`).
    pub fn started_at(&self) -> u64 {
        self.inner.started_at
    }

    /// The server's Prometheus metrics.
    pub fn metrics(&self) -> &Arc<metrics::Metrics> {
        &self.inner.metrics
    }

    /// The store of the Responses API.
    fn responses(&self) -> &Arc<responses::store::ResponseStore> {
        &self.inner.responses
    }

    fn keep_alive(&self) -> KeepAlive {
        KeepAlive::new().interval(self.inner.config.keep_alive_interval)
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("model_id", &self.service().model_id())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// Every route of the API, in one table: [`router`] is built from it and
/// the `openapi` tests compare it with the generated document's operations
/// both ways, so the document and the router cannot drift apart. Paths use axum's syntax
/// (`/v1/models/{*id}` is `/v1/models/{id}` in the document).
fn api_routes() -> Vec<(Method, &'static str, MethodRouter<AppState>)> {
    vec![
        (
            Method::POST,
            "/v1/chat/completions",
            post(completions::chat_completions),
        ),
        (
            Method::POST,
            "/v1/completions",
            post(completions::completions),
        ),
        (
            Method::POST,
            "/v1/responses",
            post(responses::create_response),
        ),
        (
            Method::GET,
            "/v1/responses/{id}",
            get(responses::retrieve_response),
        ),
        (
            Method::DELETE,
            "/v1/responses/{id}",
            axum::routing::delete(responses::delete_response),
        ),
        (Method::POST, "/infill", post(infill::infill)),
        (Method::POST, "/v1/embeddings", post(embeddings::embeddings)),
        (
            Method::POST,
            "/v1/messages",
            post(anthropic::create_message),
        ),
        (
            Method::POST,
            "/v1/messages/count_tokens",
            post(anthropic::count_tokens),
        ),
        (Method::POST, "/tokenize", post(tokenize::tokenize)),
        (Method::POST, "/detokenize", post(tokenize::detokenize)),
        (Method::GET, "/v1/models", get(routes::list_models)),
        (Method::GET, "/v1/models/{*id}", get(routes::retrieve_model)),
        (Method::GET, "/v1/cache/stats", get(routes::cache_stats)),
        (Method::POST, "/v1/cache/reset", post(routes::cache_reset)),
        (Method::GET, "/metrics", get(routes::metrics)),
        (Method::GET, "/health", get(routes::health)),
        (Method::GET, "/openapi.json", get(openapi::openapi_json)),
    ]
}

/// The method and path (axum syntax) of every route [`router`] serves.
pub fn route_table() -> Vec<(Method, &'static str)> {
    api_routes()
        .into_iter()
        .map(|(method, path, _)| (method, path))
        .collect()
}

/// The whole HTTP application. Every request gets an `x-request-id` (the
/// client's, or a new UUID), echoed in the response and recorded on the
/// request's tracing span (with the body's `user`, when it has one).
///
/// Layers, outermost first: request id and tracing, gzip request bodies
/// decoded (other encodings are a 415), the body limit (on the decoded
/// body), CORS (so preflights need no key and refusals carry CORS headers),
/// request counting (refusals are counted too), the refusal of
/// state-changing requests from origins that are not allowed, the API key
/// check, then routing.
pub fn router(state: AppState) -> Router {
    let config = state.config();
    let body_limit = config.body_limit_bytes;
    let cors = config.allowed_origins.layer();
    let api_key = config.api_key.as_deref().map(auth::ApiKey::new);
    let trace = TraceLayer::new_for_http()
        .make_span_with(|request: &Request<Body>| {
            let request_id = request
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-");
            tracing::info_span!(
                "http_request",
                request_id,
                method = %request.method(),
                path = %request.uri().path(),
                user = tracing::field::Empty,
            )
        })
        .on_response(DefaultOnResponse::new().level(Level::INFO));
    let mut app = api_routes()
        .into_iter()
        .fold(Router::new(), |app, (_, path, handler)| {
            app.route(path, handler)
        })
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed);
    if let Some(key) = api_key {
        app = app.layer(axum::middleware::from_fn_with_state(
            Arc::new(key),
            auth::require_api_key,
        ));
    }
    app = app.layer(axum::middleware::from_fn_with_state(
        config.allowed_origins.clone(),
        cors::refuse_other_origins,
    ));
    app = app.layer(axum::middleware::from_fn_with_state(
        state.clone(),
        routes::count_request,
    ));
    if let Some(cors) = cors {
        app = app.layer(cors);
    }
    app.layer(DefaultBodyLimit::max(body_limit))
        .layer(
            RequestDecompressionLayer::new()
                .gzip(true)
                .pass_through_unaccepted(true),
        )
        .layer(axum::middleware::from_fn(refuse_unknown_encodings))
        // Errors to the Messages routes in Anthropic's shape, whichever
        // layer made them.
        .layer(axum::middleware::from_fn(anthropic::error::reshape_errors))
        // Layers run outermost last: set the id, then trace, then echo it.
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(trace)
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .with_state(state)
}

/// Middleware: a request body in a `Content-Encoding` other than `gzip`
/// (decoded by the next layer) or `identity` is a 415 with the OpenAI error
/// body, not a body read as garbage.
async fn refuse_unknown_encodings(
    request: Request<Body>,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if let Some(value) = request.headers().get(axum::http::header::CONTENT_ENCODING) {
        let known = value.to_str().is_ok_and(|v| {
            let v = v.trim();
            v.eq_ignore_ascii_case("gzip") || v.eq_ignore_ascii_case("identity")
        });
        if !known {
            let shown = String::from_utf8_lossy(value.as_bytes()).into_owned();
            return error::ApiError::UnsupportedContentEncoding(shown).into_response();
        }
    }
    next.run(request).await
}

/// Serves [`router`] on `listener` until `shutdown` completes, then stops
/// accepting connections and lets open requests finish, for at most
/// [`HttpConfig::shutdown_grace`]: then each open request fails with
/// [`shutdown::SHUTDOWN_MESSAGE`] (an error body, or an error event that ends
/// its stream), and `serve` returns once their answers are written (a
/// connection that still lingers a moment later is closed).
pub async fn serve<F>(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: F,
) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    /// How long the answers of the requests failed at the deadline may
    /// take to be written before their connections are closed.
    const AFTER_DEADLINE: Duration = Duration::from_secs(2);
    let grace = state.config().shutdown_grace;
    let phase = state.inner.phase.clone();
    let mut draining = phase.subscribe();
    let signal = async move {
        shutdown.await;
        tracing::info!(?grace, "shutdown signal received; draining open requests");
        phase.send_replace(shutdown::Phase::Draining);
    };
    let server = axum::serve(listener, router(state.clone()))
        .with_graceful_shutdown(signal)
        .into_future();
    tokio::pin!(server);
    let deadline = async move {
        // An error means the sender is gone without a signal: never expire.
        if draining
            .wait_for(|p| *p != shutdown::Phase::Serving)
            .await
            .is_err()
        {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        result = &mut server => return result,
        () = deadline => {}
    }
    let open = state.service().stats();
    tracing::warn!(
        ?grace,
        running = open.running,
        waiting = open.waiting,
        "open requests outlived the shutdown timeout; failing them"
    );
    state.inner.phase.send_replace(shutdown::Phase::Expired);
    match tokio::time::timeout(AFTER_DEADLINE, &mut server).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!("connections still open after the shutdown timeout; closing them");
            Ok(())
        }
    }
}
