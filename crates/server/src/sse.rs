//! The streamed answer: engine events in, `chat.completion.chunk` SSE
//! events out.
//!
//! The stream owns the request's [`EventStream`] and nothing else holds it:
//! when the client goes away, axum drops the response body, the stream and
//! the receiver with it, and the engine sees the request cancelled.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use mlxcel_engine_api::{EventStream, GenerationEvent, Usage};
use serde::Serialize;

use crate::error::{ApiError, SERIALIZATION_FAILED_BODY};
use crate::openai::{ChatCompletionChunk, ChunkDelta, CompletionMeta};
use crate::validate::StreamOptions;

/// The SSE response of a streamed chat completion.
pub fn chat_completion_stream(
    events: EventStream,
    meta: CompletionMeta,
    options: StreamOptions,
    keep_alive: KeepAlive,
) -> Response {
    let state = ChunkStream {
        events,
        meta,
        include_usage: options.include_usage,
        phase: Phase::Role,
    };
    Sse::new(into_stream(state))
        .keep_alive(keep_alive)
        .into_response()
}

fn into_stream(state: ChunkStream) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    stream::unfold(state, |mut state| async move {
        let event = state.next_event().await?;
        Some((Ok(event), state))
    })
}

/// Where the stream is in OpenAI's sequence of chunks.
#[derive(Debug)]
enum Phase {
    /// Next: the chunk with `delta.role`.
    Role,
    /// Next: content deltas, until the engine finishes or fails.
    Content,
    /// Next: the usage chunk.
    Usage(Usage),
    /// Next: `[DONE]`.
    Done,
    /// Nothing more.
    End,
}

struct ChunkStream {
    events: EventStream,
    meta: CompletionMeta,
    include_usage: bool,
    phase: Phase,
}

impl ChunkStream {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            match std::mem::replace(&mut self.phase, Phase::End) {
                Phase::Role => {
                    self.phase = Phase::Content;
                    let delta = ChunkDelta {
                        role: Some("assistant"),
                        content: Some(""),
                    };
                    return Some(self.chunk(delta, None));
                }
                Phase::Content => match self.events.recv().await {
                    Some(GenerationEvent::Delta { text, .. }) => {
                        self.phase = Phase::Content;
                        if text.is_empty() {
                            continue;
                        }
                        let delta = ChunkDelta {
                            role: None,
                            content: Some(&text),
                        };
                        return Some(self.chunk(delta, None));
                    }
                    Some(GenerationEvent::Finished { reason, usage, .. }) => {
                        tracing::debug!(id = %self.meta.id, ?reason, ?usage, "stream finished");
                        self.phase = if self.include_usage {
                            Phase::Usage(usage)
                        } else {
                            Phase::Done
                        };
                        return Some(self.chunk(ChunkDelta::default(), Some(reason)));
                    }
                    Some(GenerationEvent::Failed { message }) => {
                        return Some(error_event(ApiError::GenerationFailed(message)));
                    }
                    None => {
                        let message = "the engine ended the request without finishing it";
                        return Some(error_event(ApiError::GenerationFailed(message.to_owned())));
                    }
                },
                Phase::Usage(usage) => {
                    self.phase = Phase::Done;
                    return Some(json_event(&ChatCompletionChunk::usage(&self.meta, usage)));
                }
                Phase::Done => return Some(Event::default().data("[DONE]")),
                Phase::End => return None,
            }
        }
    }

    fn chunk(
        &self,
        delta: ChunkDelta<'_>,
        finish_reason: Option<mlxcel_engine_api::FinishReason>,
    ) -> Event {
        json_event(&ChatCompletionChunk::delta(
            &self.meta,
            delta,
            finish_reason,
            self.include_usage,
        ))
    }
}

/// The last event of a failed stream: the OpenAI error body as data.
fn error_event(error: ApiError) -> Event {
    tracing::error!(error = %error, "stream failed");
    json_event(&error.body())
}

fn json_event<T: Serialize>(value: &T) -> Event {
    Event::default().json_data(value).unwrap_or_else(|err| {
        // Serializing these plain structs cannot fail; if it ever does, the
        // client still gets an error body instead of a truncated stream.
        tracing::error!(error = %err, "could not serialize an SSE event");
        Event::default().data(SERIALIZATION_FAILED_BODY)
    })
}
