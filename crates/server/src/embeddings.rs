//! `POST /v1/embeddings`: each input runs through the engine as a
//! prefill-only request (all submitted before any is awaited, so the
//! engine batches them like any concurrent prompts) and comes back as one
//! unit-length vector: the model's final hidden states, pooled as the
//! checkpoint says (last token or mean; `--embeddings` gives any decoder
//! last-token pooling). `dimensions` keeps a vector's first numbers and
//! scales them back to unit length (Matryoshka truncation).

use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxcel_engine_api::{EmbeddingRequest, EventStream, GenerationEvent, Usage};

use crate::error::{ApiError, Route};
use crate::extract::JsonBody;
use crate::openai::embeddings::{
    EmbeddingList, EmbeddingObject, EmbeddingUsage, EmbeddingVector, EmbeddingsBody,
};
use crate::openapi::{
    BadRequest, ForbiddenOrigin, InternalError, ModelNotFound, PayloadTooLarge, Unavailable,
    UnsupportedMediaType,
};
use crate::validate::{ValidatedEmbeddingsRequest, ValidationError};
use crate::AppState;

/// `POST /v1/embeddings`.
#[utoipa::path(
    post,
    path = "/v1/embeddings",
    operation_id = "createEmbedding",
    summary = "Embeddings of text or token ids",
    description = "One unit-length vector per input: the model's final hidden states (after the final norm), pooled as the checkpoint's sentence-transformers files say (last token or mean) or, under --embeddings, the last token's. A model that serves no embeddings (no pooling files, no --embeddings) is a 400 naming `model`. Inputs of one request are batched by the engine like concurrent prompts.",
    request_body = EmbeddingsBody,
    responses(
        (status = 200, description = "One vector per input, in input order", body = EmbeddingList),
        (status = 400, response = BadRequest),
        (status = 403, response = ForbiddenOrigin),
        (status = 404, response = ModelNotFound),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 500, response = InternalError),
        (status = 503, response = Unavailable),
    ),
)]
pub async fn embeddings(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let service = state.service();
    let request = ValidatedEmbeddingsRequest::parse(body, service.model_id())?;
    let Some(model) = service.embedding_model() else {
        if !service.ready() {
            // Whether it will serve embeddings is known once it has loaded.
            return Err(ApiError::Unavailable("the model is still loading".into()));
        }
        return Err(ApiError::EngineRejected {
            message: format!(
                "The model `{}` does not serve embeddings: serve an embedding checkpoint \
                 (sentence-transformers pooling files), or start the server with --embeddings \
                 to embed with any model (last-token pooling)",
                service.model_id()
            ),
            param: Some("model".into()),
        });
    };
    if let Some(d) = request.dimensions.filter(|&d| d > model.dimensions) {
        return Err(ValidationError::ValueOutOfRange {
            param: "dimensions".into(),
            value: d.to_string(),
            range: format!("at most {}, this model's hidden size", model.dimensions),
        }
        .into());
    }
    tracing::info!(inputs = request.inputs.len(), "embeddings");
    let several = request.inputs.len() > 1;
    let mut streams = Vec::with_capacity(request.inputs.len());
    for (i, prompt) in request.inputs.into_iter().enumerate() {
        let route = Route::Embeddings {
            input: several.then_some(i),
        };
        streams.push(submit(&state, prompt, route, arrived).await?);
    }
    let mut data = Vec::with_capacity(streams.len());
    let mut usage = EmbeddingUsage {
        prompt_tokens: 0,
        total_tokens: 0,
    };
    for (index, events) in streams.into_iter().enumerate() {
        let (mut vector, used) = answer(events).await?;
        if let Some(d) = request.dimensions {
            vector.truncate(d);
            normalize(&mut vector);
        }
        usage.prompt_tokens += used.prompt_tokens;
        usage.total_tokens += used.prompt_tokens;
        data.push(EmbeddingObject {
            object: "embedding",
            index,
            embedding: if request.base64 {
                EmbeddingVector::Base64(base64_f32(&vector))
            } else {
                EmbeddingVector::Float(vector)
            },
        });
    }
    Ok(Json(EmbeddingList {
        object: "list",
        data,
        model: service.model_id().to_owned(),
        usage,
    })
    .into_response())
}

/// Submits one input off the async workers (tokenizing may take a while).
async fn submit(
    state: &AppState,
    prompt: mlxcel_engine_api::Prompt,
    route: Route,
    arrived: Instant,
) -> Result<EventStream, ApiError> {
    let handle = state.service_handle();
    let request = EmbeddingRequest {
        prompt,
        cache_prompt: true,
    };
    let events = tokio::task::spawn_blocking(move || handle.embed(request))
        .await
        .map_err(|e| ApiError::Internal(format!("submitting the request: {e}")))?
        .map_err(|e| ApiError::from_submit(e, route))?;
    Ok(state.metrics().instrument(events, arrived))
}

/// The vector and usage an input's stream ends with.
async fn answer(mut events: EventStream) -> Result<(Vec<f32>, Usage), ApiError> {
    while let Some(event) = events.recv().await {
        match event {
            GenerationEvent::Embedding { vector, usage } => return Ok((vector, usage)),
            GenerationEvent::Failed { kind, message } => {
                return Err(ApiError::GenerationFailed { kind, message })
            }
            _ => {}
        }
    }
    Err(ApiError::Internal(
        "the engine ended an embedding request without its vector".into(),
    ))
}

/// Scales `v` to unit L2 norm (a zero vector stays zero).
fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|x| f64::from(*x) * f64::from(*x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        v.iter_mut()
            .for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
}

/// Standard base64 (with padding) of `v`'s little-endian float32 bytes, as
/// OpenAI's `encoding_format: "base64"` sends them.
fn base64_f32(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for (k, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if k <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> shift & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        // 1.0f32 = 00 00 80 3f; 2.0 = 00 00 00 40.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
        assert_eq!(base64_f32(&[]), "");
    }

    #[test]
    fn truncated_vectors_are_unit_length_again() {
        let mut v = vec![3.0, 4.0, 12.0];
        v.truncate(2);
        normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
    }
}
