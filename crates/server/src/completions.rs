//! `POST /v1/chat/completions` and `POST /v1/completions`, streamed or not.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxcel_engine_api::{
    EventStream, GenerationRequest, InferenceService, Prompt, SubmitError, ToolChoice,
};

use crate::choices::{collect, Choices};
use crate::error::{ApiError, Route};
use crate::extract::JsonBody;
use crate::openai::chat::chat_completion;
use crate::openai::completion::{LegacyLogprobs, TextChoice};
use crate::openai::request::{ChatCompletionRequest, CompletionRequest};
use crate::openai::{Completion, CompletionMeta};
use crate::openapi::{
    BadRequest, ChatCompletionEvent, ChatCompletionObject, ForbiddenOrigin, InternalError,
    ModelNotFound, PayloadTooLarge, TextCompletionEvent, TextCompletionObject, Unavailable,
    UnsupportedMediaType,
};
use crate::sse::{stream_response, ChatChunks, TextChunks};
use crate::validate::{ValidatedChatRequest, ValidatedCompletionRequest};
use crate::AppState;

/// `POST /v1/chat/completions`.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    operation_id = "createChatCompletion",
    summary = "Chat completion",
    description = "Generates the assistant's answer to `messages` with the served model's chat template. Fields outside this schema are a 400 (`Unrecognized request argument supplied`), except OpenAI fields mlxcel lacks, accepted only with their default value.",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion; with stream true, server-sent events whose data are ChatCompletionChunk objects, ending with `data: [DONE]`.", content(
            (ChatCompletionObject = "application/json"),
            (inline(ChatCompletionEvent) = "text/event-stream"),
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
pub async fn chat_completions(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let service = state.service();
    let request =
        ValidatedChatRequest::parse(body, service.model_id(), state.config().default_max_tokens)?;
    let meta = CompletionMeta::chat(service.model_id());
    let generation = request.generation;
    record_user(request.user.as_deref());
    tracing::info!(
        id = %meta.id,
        user = request.user.as_deref().unwrap_or("-"),
        stream = request.stream.is_some(),
        n = generation.n,
        max_tokens = generation.max_tokens,
        tools = generation.tools.len(),
        prompt_cache_key = request.prompt_cache_key.as_deref().unwrap_or("-"),
        "chat completion"
    );
    let n = generation.n;
    let logprobs = generation.logprobs.is_some();
    let may_call_tools = !generation.tools.is_empty() && generation.tool_choice != ToolChoice::None;
    let events = submit_one(&state, generation, Route::Chat, arrived).await?;
    let mut choices = Choices::new(vec![events], n, request.parallel_tool_calls);
    match request.stream {
        Some(options) => {
            let format = ChatChunks {
                meta,
                choices: n,
                include_usage: options.include_usage,
                opened: vec![!may_call_tools; n],
            };
            Ok(stream_response(choices, format, state.keep_alive()))
        }
        None => {
            let outputs = collect(&mut choices).await?;
            let completion = chat_completion(&meta, outputs, logprobs, choices.usage());
            Ok(Json(completion).into_response())
        }
    }
}

/// `POST /v1/completions`.
#[utoipa::path(
    post,
    path = "/v1/completions",
    operation_id = "createCompletion",
    summary = "Text completion",
    description = "Continues each prompt as plain text (no chat template). Each prompt of a list gets n choices; choice index = prompt_index * n + i.",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion; with stream true, server-sent events whose data are TextCompletionChunk objects, ending with `data: [DONE]`.", content(
            (TextCompletionObject = "application/json"),
            (inline(TextCompletionEvent) = "text/event-stream"),
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
pub async fn completions(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let service = state.service();
    let request = ValidatedCompletionRequest::parse(body, service.model_id())?;
    let meta = CompletionMeta::text(service.model_id());
    let first = request.generations.first();
    let n = first.map_or(1, |g| g.n);
    let logprobs = first.is_some_and(|g| g.logprobs.is_some());
    record_user(request.user.as_deref());
    tracing::info!(
        id = %meta.id,
        user = request.user.as_deref().unwrap_or("-"),
        stream = request.stream.is_some(),
        prompts = request.generations.len(),
        n,
        max_tokens = first.map_or(0, |g| g.max_tokens),
        "text completion"
    );
    let handle = state.service_handle();
    let (generations, echo) = (request.generations, request.echo);
    let (echoes, streams) =
        tokio::task::spawn_blocking(move || submit_prompts(handle, generations, echo))
            .await
            .map_err(|e| ApiError::Internal(format!("submitting the request: {e}")))?
            .map_err(|(prompt, e)| ApiError::from_submit(e, Route::Completions { prompt }))?;
    let streams = streams
        .into_iter()
        .map(|events| state.metrics().instrument(events, arrived))
        .collect();
    let mut choices = Choices::new(streams, n, true);
    match request.stream {
        Some(options) => {
            let format = TextChunks::new(meta, echoes, n, options.include_usage, logprobs);
            Ok(stream_response(choices, format, state.keep_alive()))
        }
        None => {
            let outputs = collect(&mut choices).await?;
            let text_choices = outputs
                .into_iter()
                .enumerate()
                .map(|(index, output)| {
                    let echo = &echoes[index / n];
                    // Completion tokens start after the echoed text.
                    let mut offset = echo.chars().count();
                    let logprobs = logprobs.then(|| match &output.prompt_logprobs {
                        Some((first, rest)) => {
                            let mut all = LegacyLogprobs::prompt(first, rest);
                            all.extend(&output.logprobs, &mut offset);
                            all
                        }
                        None => LegacyLogprobs::new(&output.logprobs, &mut offset),
                    });
                    TextChoice {
                        index,
                        text: format!("{echo}{}", output.text),
                        logprobs,
                        finish_reason: output.finish_reason,
                    }
                })
                .collect();
            let completion = Completion::answer(&meta, text_choices, choices.usage());
            Ok(Json(completion).into_response())
        }
    }
}

/// Submits `generation` (rendering and tokenizing its prompt, up to 4 MiB,
/// is CPU work: off the async workers) and returns its events, counted by
/// the metrics from `arrived`. A refusal is named as `route` names its
/// fields.
///
/// # Errors
/// The engine's refusal ([`ApiError::from_submit`]); a blocking task that
/// could not run.
pub(crate) async fn submit_one(
    state: &AppState,
    generation: GenerationRequest,
    route: Route,
    arrived: Instant,
) -> Result<EventStream, ApiError> {
    let handle = state.service_handle();
    let events = tokio::task::spawn_blocking(move || handle.submit(generation))
        .await
        .map_err(|e| ApiError::Internal(format!("submitting the request: {e}")))?
        .map_err(|e| ApiError::from_submit(e, route))?;
    Ok(state.metrics().instrument(events, arrived))
}

/// A prompt's refusal: the index of the prompt when there were several.
type PromptRefusal = (Option<usize>, SubmitError);

/// Submits every prompt, in order, and returns the text each echoes (empty
/// without `echo`) with its event stream. All or none: if one submit fails,
/// the streams already made are dropped, which cancels their requests. The
/// error carries the index of the prompt at fault when there are several.
fn submit_prompts(
    service: Arc<dyn InferenceService>,
    generations: Vec<GenerationRequest>,
    echo: bool,
) -> Result<(Vec<String>, Vec<EventStream>), PromptRefusal> {
    let several = generations.len() > 1;
    let at = |i: usize| move |e: SubmitError| (several.then_some(i), e);
    let echoes = generations
        .iter()
        .enumerate()
        .map(|(i, generation)| match &generation.prompt {
            _ if !echo => Ok(String::new()),
            Prompt::Text(text) => Ok(text.clone()),
            Prompt::Tokens(tokens) => service.detokenize(tokens).map_err(at(i)),
            Prompt::Chat(_) | Prompt::Infill(_) => Ok(String::new()),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let streams = generations
        .into_iter()
        .enumerate()
        .map(|(i, generation)| service.submit(generation).map_err(at(i)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((echoes, streams))
}

/// Records the client's end-user id on the request's tracing span.
fn record_user(user: Option<&str>) {
    if let Some(user) = user {
        tracing::Span::current().record("user", user);
    }
}
