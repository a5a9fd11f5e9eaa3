//! The route handlers, but for the completion endpoints (in
//! `completions`).

use axum::extract::rejection::PathRejection;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, Method, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::error::{ApiError, Route};
use crate::openai::{
    CacheReset, CacheResetRequest, CacheStats, Health, HealthStatus, ModelCard, ModelList,
};
use crate::openapi::{
    BadRequest, ForbiddenOrigin, InternalError, ModelNotFound, Unavailable, UnsupportedMediaType,
};
use crate::AppState;

/// `GET /v1/models`: the one served model.
#[utoipa::path(
    get,
    path = "/v1/models",
    operation_id = "listModels",
    summary = "The served model (one)",
    responses((status = 200, description = "The served model (one)", body = ModelList)),
)]
pub async fn list_models(State(state): State<AppState>) -> Response {
    let service = state.service();
    let card = ModelCard::new(
        service.model_id(),
        state.started_at(),
        service.context_length(),
    );
    Json(ModelList {
        object: "list",
        data: vec![card],
    })
    .into_response()
}

/// `GET /v1/models/{id}`; the id may contain slashes (`org/name`).
#[utoipa::path(
    get,
    path = "/v1/models/{id}",
    operation_id = "retrieveModel",
    summary = "One model by id",
    params(("id" = String, Path, description = "The model id; it may contain slashes (`org/name`).")),
    responses(
        (status = 200, description = "One model by id", body = ModelCard),
        (status = 404, response = ModelNotFound),
    ),
)]
pub async fn retrieve_model(
    State(state): State<AppState>,
    method: Method,
    uri: Uri,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    // The only rejection of a `String` path is bad percent-encoding: no model
    // has such a name.
    let Ok(Path(id)) = id else {
        return Err(not_found(method, uri).await);
    };
    let model_id = state.service().model_id();
    if id != model_id {
        return Err(ApiError::UnknownModel(id));
    }
    let card = ModelCard::new(
        model_id,
        state.started_at(),
        state.service().context_length(),
    );
    Ok(Json(card).into_response())
}

/// `GET /health`: `{"status":"ok"}` once the engine serves, `503
/// {"status":"starting"}` while the model loads and warms up, `503
/// {"status":"unhealthy"}` once it can no longer serve (a tensor-parallel
/// rank died).
#[utoipa::path(
    get,
    path = "/health",
    operation_id = "getHealth",
    summary = "Readiness probe: 200 once the model is loaded and warmed up, 503 while starting or once unhealthy; never needs an API key",
    responses(
        (status = 200, description = "The engine serves requests", body = Health),
        (status = 503, description = "The model is still loading or warming up (`starting`), or the engine can no longer serve (`unhealthy`: a tensor-parallel rank died or stopped answering)", body = Health),
    ),
)]
pub async fn health(State(state): State<AppState>) -> Response {
    if let Some(reason) = state.service().unhealthy() {
        tracing::debug!(reason, "health: unhealthy");
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: HealthStatus::Unhealthy,
            }),
        )
            .into_response();
    }
    if state.service().ready() {
        Json(Health {
            status: HealthStatus::Ok,
        })
        .into_response()
    } else {
        (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: HealthStatus::Starting,
            }),
        )
            .into_response()
    }
}

/// Any path without a route.
pub async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::RouteNotFound {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

/// A known path with the wrong method. `/v1/responses/{id}` only names a
/// response when `{id}` is one (`resp_...`): other paths there
/// (`/v1/responses/input_tokens`, `/v1/responses/compact`: OpenAI routes
/// this server does not serve) are unknown routes, a 404.
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    let path = uri.path().to_owned();
    let method = method.to_string();
    match path.strip_prefix("/v1/responses/") {
        Some(id) if !id.starts_with("resp_") => ApiError::RouteNotFound { method, path },
        _ => ApiError::MethodNotAllowed { method, path },
    }
}

/// Counts every response by matched route and status
/// (`mlxcel_http_requests_total`).
pub async fn count_request(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let endpoint = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    state
        .metrics()
        .record_request(&endpoint, response.status().as_u16());
    response
}

/// `GET /metrics`: Prometheus text format.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "getMetrics",
    summary = "Prometheus metrics",
    responses(
        (status = 200, description = "Prometheus text exposition format 0.0.4.", body = String, content_type = "text/plain"),
        (status = 500, response = InternalError),
    ),
)]
pub async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let stats = state.service().stats();
    let body = state
        .metrics()
        .render(&stats)
        .map_err(|e| ApiError::Internal(format!("rendering metrics: {e}")))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response())
}

/// `GET /v1/cache/stats`: the prefix cache and the KV pool.
#[utoipa::path(
    get,
    path = "/v1/cache/stats",
    operation_id = "getCacheStats",
    summary = "Prefix cache and KV pool statistics (mlxcel extension)",
    responses((status = 200, description = "Prefix cache and KV pool statistics (mlxcel extension)", body = CacheStats)),
)]
pub async fn cache_stats(State(state): State<AppState>) -> Response {
    Json(CacheStats::from(&state.service().stats())).into_response()
}

/// `POST /v1/cache/reset`: frees every cached block no running request
/// holds and, unless the body says `{"keep_disk": true}`, deletes the disk
/// tier's block files; says what it freed. Idempotent; safe while requests
/// run. The body is optional.
#[utoipa::path(
    post,
    path = "/v1/cache/reset",
    operation_id = "resetCache",
    summary = "Free every cached KV block no running request holds (mlxcel extension)",
    description = "Idempotent and safe while requests run. The body is optional: `{\"keep_disk\": true}` keeps the disk tier's files (`--prompt-cache-dir`).",
    request_body(content = Option<CacheResetRequest>, content_type = "application/json"),
    responses(
        (status = 200, description = "What was freed, and the statistics after it.", body = CacheReset),
        (status = 400, response = BadRequest),
        (status = 403, response = ForbiddenOrigin),
        (status = 415, response = UnsupportedMediaType),
        (status = 500, response = InternalError),
        (status = 503, response = Unavailable),
    ),
)]
pub async fn cache_reset(
    State(state): State<AppState>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let keep_disk = CacheResetRequest::parse(&body)?.keep_disk;
    let handle = state.service_handle();
    let reset = tokio::task::spawn_blocking(move || handle.reset_prefix_cache(keep_disk))
        .await
        .map_err(|e| ApiError::Internal(format!("resetting the cache: {e}")))?
        .map_err(|e| ApiError::from_submit(e, Route::Chat))?;
    let stats = state.service().stats();
    Ok(Json(CacheReset {
        object: "cache.reset",
        blocks_freed: reset.blocks_freed,
        bytes_freed: reset.bytes_freed,
        disk_blocks_freed: reset.disk_blocks_freed,
        disk_bytes_freed: reset.disk_bytes_freed,
        stats: CacheStats::from(&stats),
    })
    .into_response())
}
