//! `POST /infill`: fill-in-the-middle as llama-server serves it, for the
//! editor plugins that speak it (the prompt is built from the model's FIM
//! tokens by the engine: `mlxcel_text::fim`).

use std::time::Instant;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxcel_engine_api::{FinishReason, Usage};

use crate::choices::{collect, Choices, Piece};
use crate::completions::submit_one;
use crate::error::{ApiError, Route};
use crate::extract::JsonBody;
use crate::openai::infill::{InfillBody, InfillResponse};
use crate::openapi::{
    BadRequest, ForbiddenOrigin, InternalError, ModelNotFound, PayloadTooLarge, Unavailable,
    UnsupportedMediaType,
};
use crate::sse::{json_event, stream_response, ChunkFormat};
use crate::validate::ValidatedInfillRequest;
use crate::AppState;

/// `POST /infill`.
#[utoipa::path(
    post,
    path = "/infill",
    operation_id = "infill",
    summary = "Fill in the middle (llama-server's route)",
    description = "Generates the code between `input_prefix` and `input_suffix` from the model's fill-in-the-middle tokens (Qwen2.5-Coder `<|fim_prefix|>`, StarCoder `<fim_prefix>`, CodeLlama `<PRE>` style), `input_extra` files first. A model without FIM tokens is a 400 naming `input_suffix`. With stream true, server-sent events whose data are InfillResponse objects: content events (`stop: false`), then one with `stop: true` and the counts; no `[DONE]`.",
    request_body = InfillBody,
    responses(
        (status = 200, description = "The infill; with stream true, server-sent events of InfillResponse objects.", content(
            (InfillResponse = "application/json"),
            (InfillResponse = "text/event-stream"),
        )),
        (status = 400, response = BadRequest),
        (status = 403, response = ForbiddenOrigin),
        (status = 404, response = ModelNotFound),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 500, response = InternalError),
        (status = 503, response = Unavailable),
    ),
)]
pub async fn infill(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let service = state.service();
    let request =
        ValidatedInfillRequest::parse(body, service.model_id(), state.config().default_max_tokens)?;
    let model = service.model_id().to_owned();
    tracing::info!(
        stream = request.stream,
        max_tokens = request.generation.max_tokens,
        "infill"
    );
    let events = submit_one(&state, request.generation, Route::Infill, arrived).await?;
    let mut choices = Choices::new(vec![events], 1, true);
    let silent = request.prefill_only;
    if request.stream {
        let format = InfillChunks {
            model,
            finish: None,
            silent,
        };
        return Ok(stream_response(choices, format, state.keep_alive()));
    }
    let outputs = collect(&mut choices).await?;
    let output = outputs.into_iter().next().unwrap_or_default();
    let mut answer = last(model, output.text, output.finish_reason, choices.usage());
    if silent {
        quiet(&mut answer);
    }
    Ok(Json(answer).into_response())
}

/// The answer of an `n_predict: 0` request: no text, nothing predicted.
fn quiet(answer: &mut InfillResponse) {
    answer.content.clear();
    answer.stop_type = Some("limit");
    answer.tokens_predicted = Some(0);
}

/// The answer, or a stream's last event (with `content` empty).
fn last(
    model: String,
    content: String,
    finish: Option<FinishReason>,
    usage: Usage,
) -> InfillResponse {
    InfillResponse {
        content,
        model,
        stop: true,
        stop_type: Some(match finish {
            Some(FinishReason::Length) => "limit",
            _ => "eos",
        }),
        tokens_predicted: Some(usage.completion_tokens),
        tokens_evaluated: Some(usage.prompt_tokens),
        tokens_cached: Some(usage.cached_tokens),
    }
}

/// llama-server's stream: `{"content", "stop": false}` per piece, then
/// the answer's fields with `"stop": true`; no `[DONE]`.
struct InfillChunks {
    model: String,
    finish: Option<FinishReason>,
    /// `n_predict: 0`: no content events, the last event says none.
    silent: bool,
}

impl ChunkFormat for InfillChunks {
    fn opening(&mut self) -> Vec<Event> {
        Vec::new()
    }

    fn piece(&mut self, piece: Piece) -> Vec<Event> {
        match piece {
            Piece::Text { text, .. } if !text.is_empty() && !self.silent => {
                vec![json_event(&InfillResponse {
                    content: text,
                    model: self.model.clone(),
                    stop: false,
                    stop_type: None,
                    tokens_predicted: None,
                    tokens_evaluated: None,
                    tokens_cached: None,
                })]
            }
            Piece::Finish { reason, .. } => {
                self.finish = Some(reason);
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    fn usage(&self, _: Usage) -> Option<Event> {
        None
    }

    fn closing(&mut self, usage: Usage) -> Vec<Event> {
        let mut answer = last(self.model.clone(), String::new(), self.finish, usage);
        if self.silent {
            quiet(&mut answer);
        }
        vec![json_event(&answer)]
    }
}
