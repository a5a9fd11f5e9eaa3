//! `chat.completion` and `chat.completion.chunk`.

use mlxcel_engine_api::{FinishReason, SampledLogprobs, TokenLogprob, ToolCall, Usage};
use serde::Serialize;
use utoipa::openapi::{RefOr, Schema};
use utoipa::ToSchema;

use super::{constant, finish_reason_schema, Completion, CompletionMeta};
use crate::choices::ChoiceOutput;

/// A non-streamed answer: the `chat.completion` object.
pub type ChatCompletion<'a> = Completion<'a, ChatChoice>;

/// One event of a streamed answer: the `chat.completion.chunk` object.
pub type ChatCompletionChunk<'a> = Completion<'a, ChunkChoice>;

/// The answer of `meta` made of `outputs` (choice `i` is `outputs[i]`);
/// `logprobs` says whether the request asked for them.
pub fn chat_completion(
    meta: &CompletionMeta,
    outputs: Vec<ChoiceOutput>,
    logprobs: bool,
    usage: Usage,
) -> ChatCompletion<'_> {
    let choices = outputs
        .into_iter()
        .enumerate()
        .map(|(index, output)| ChatChoice::new(index, output, logprobs))
        .collect();
    Completion::answer(meta, choices, usage)
}

/// One choice of a `chat.completion`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ChatChoice {
    /// Position among the choices.
    pub index: usize,
    /// The generated message.
    pub message: AssistantMessage,
    /// `null` unless the request asked for logprobs.
    #[schema(required = true)]
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    #[schema(schema_with = finished, required = true)]
    pub finish_reason: Option<FinishReason>,
}

fn finished() -> RefOr<Schema> {
    finish_reason_schema(&["stop", "length", "tool_calls"], false)
}

fn maybe_finished() -> RefOr<Schema> {
    finish_reason_schema(&["stop", "length", "tool_calls"], true)
}

fn assistant() -> RefOr<Schema> {
    constant("assistant")
}

fn function() -> RefOr<Schema> {
    constant("function")
}

fn bytes() -> RefOr<Schema> {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
    let byte = ObjectBuilder::new()
        .schema_type(Type::Integer)
        .minimum(Some(0))
        .maximum(Some(255));
    ArrayBuilder::new()
        .items(byte)
        .description(Some("Its UTF-8 bytes (which may be part of a character)."))
        .into()
}

impl ChatChoice {
    fn new(index: usize, output: ChoiceOutput, logprobs: bool) -> Self {
        // A choice that only called tools, or only reasoned (cut by
        // `max_tokens` inside its reasoning), has no content at all.
        let content = if output.text.is_empty()
            && (!output.tool_calls.is_empty() || !output.reasoning.is_empty())
        {
            None
        } else {
            Some(output.text)
        };
        let reasoning_content = (!output.reasoning.is_empty()).then_some(output.reasoning);
        Self {
            index,
            message: AssistantMessage {
                role: "assistant",
                content,
                tool_calls: output.tool_calls.into_iter().map(Into::into).collect(),
                reasoning_content,
            },
            logprobs: logprobs.then(|| ChatLogprobs::new(&output.logprobs)),
            finish_reason: output.finish_reason,
        }
    }
}

/// The generated message of a choice.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = ChatCompletionMessage)]
pub struct AssistantMessage {
    /// Always `assistant`.
    #[schema(schema_with = assistant)]
    pub role: &'static str,
    /// The generated text; `null` when the choice only called tools.
    #[schema(required = true)]
    pub content: Option<String>,
    /// The tool calls, absent when there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(min_items = 1)]
    pub tool_calls: Vec<ToolCallBody>,
    /// The reasoning (reasoning models: the reply's `<think>` block),
    /// absent when there is none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// One tool call of a message.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = ToolCall)]
pub struct ToolCallBody {
    /// The engine's `call_` id.
    #[schema(pattern = "^call_")]
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    #[schema(schema_with = function)]
    pub kind: &'static str,
    /// What is called.
    pub function: FunctionCall,
}

/// The function and arguments of a tool call.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
}

impl From<ToolCall> for ToolCallBody {
    fn from(call: ToolCall) -> Self {
        Self {
            id: call.id,
            kind: "function",
            function: FunctionCall {
                name: call.name,
                arguments: call.arguments,
            },
        }
    }
}

/// A choice's (or chunk's) `logprobs`: one entry per token.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ChatLogprobs {
    /// The tokens, in order.
    pub content: Vec<ChatTokenLogprob>,
}

impl ChatLogprobs {
    /// The entries of `tokens`.
    pub fn new(tokens: &[SampledLogprobs]) -> Self {
        let content = tokens
            .iter()
            .map(|sampled| ChatTokenLogprob {
                token: TopLogprob::from(&sampled.token),
                top_logprobs: sampled.top.iter().map(TopLogprob::from).collect(),
            })
            .collect();
        Self { content }
    }

    /// The entries of `tokens`, or `None` when there are none.
    pub fn non_empty(tokens: &[SampledLogprobs]) -> Option<Self> {
        (!tokens.is_empty()).then(|| Self::new(tokens))
    }
}

/// One sampled token with its alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[schema(as = TokenLogprob)]
pub struct ChatTokenLogprob {
    /// The token itself (`token`, `logprob`, `bytes`).
    #[serde(flatten)]
    pub token: TopLogprob,
    /// The most likely tokens at this position, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// A token's text, log-probability and bytes.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its natural-log probability.
    #[schema(maximum = 0)]
    pub logprob: f32,
    /// Its UTF-8 bytes (which may be part of a character).
    #[schema(schema_with = bytes)]
    pub bytes: Vec<u8>,
}

impl From<&TokenLogprob> for TopLogprob {
    fn from(token: &TokenLogprob) -> Self {
        Self {
            token: token.text.clone(),
            logprob: token.logprob,
            bytes: token.bytes.clone(),
        }
    }
}

/// One choice of a chunk.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ChunkChoice {
    /// Position among the choices.
    pub index: usize,
    /// What is new since the previous chunk of this choice.
    pub delta: ChunkDelta,
    /// Logprobs of the tokens that completed this chunk, or `null`.
    #[schema(required = true)]
    pub logprobs: Option<ChatLogprobs>,
    /// Set on the last chunk of the choice only.
    #[schema(schema_with = maybe_finished, required = true)]
    pub finish_reason: Option<FinishReason>,
}

/// The new part of the message; empty (`{}`) on the finishing chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct ChunkDelta {
    /// `assistant` on the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = assistant)]
    pub role: Option<&'static str>,
    /// New text; on the first chunk `""`, or `null` when the message opens
    /// with a tool call.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub content: Option<Option<String>>,
    /// A tool call's start or more of its arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
    /// More of the reasoning (reasoning models: the reply's `<think>`
    /// block), as vLLM and llama-server stream it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// A piece of a tool call in a chunk, as OpenAI streams them: the first
/// carries `id`, `type` and the function's `name` (with `arguments: ""`),
/// the next ones argument fragments only.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ToolCallDelta {
    /// The call's position among its choice's calls (from 0).
    pub index: usize,
    /// The call's id, on its first piece.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, on its first piece.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = function)]
    pub kind: Option<&'static str>,
    /// The function's name and argument text.
    pub function: FunctionDelta,
}

/// The function part of a [`ToolCallDelta`].
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct FunctionDelta {
    /// The function's name, on the call's first piece.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// More argument text (JSON, as generated).
    pub arguments: String,
}

impl ToolCallDelta {
    /// The first piece of call `position`.
    pub fn start(position: usize, id: String, name: String) -> Self {
        Self {
            index: position,
            id: Some(id),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some(name),
                arguments: String::new(),
            },
        }
    }

    /// More arguments of call `position`.
    pub fn arguments(position: usize, arguments: String) -> Self {
        Self {
            index: position,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments,
            },
        }
    }
}
