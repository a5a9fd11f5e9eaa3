//! Building an Anthropic `message` from the pieces of its one choice, and
//! the events that tell a stream how it was built.
//!
//! The streamed and the whole answer come from the same [`Assembler`]: a
//! whole answer is the last snapshot of a stream nobody read, so the two
//! cannot disagree.

use mlxcel_engine_api::{FinishReason, Usage};
use serde_json::{Map, Value};

use super::wire::{
    BlockDelta, ContentBlock, Message, MessageDeltaBody, MessageUsage, StopReason, StreamEvent,
};
use crate::choices::Piece;

/// A message being built.
#[derive(Debug, Clone)]
pub struct Assembler {
    message: Message,
    /// Index in `content` of the block still generating.
    open: Option<usize>,
    /// The JSON text of the open `tool_use` block's arguments.
    arguments: String,
    /// Reasoning becomes `thinking` blocks (else it is dropped).
    thinking: bool,
}

impl Assembler {
    /// Starts from `message` (no content, no stop reason, zero usage);
    /// `thinking`: the request enabled extended thinking.
    pub fn new(message: Message, thinking: bool) -> Self {
        Self {
            message,
            open: None,
            arguments: String::new(),
            thinking,
        }
    }

    /// The snapshot so far.
    pub fn message(&self) -> &Message {
        &self.message
    }

    /// `message_start`, then a `ping`.
    pub fn opening(&self) -> Vec<StreamEvent> {
        vec![
            StreamEvent::MessageStart {
                message: self.message.clone(),
            },
            StreamEvent::Ping {},
        ]
    }

    /// The events of `piece`: a block opened (the one before it closed),
    /// text, reasoning or arguments added, the stop reason recorded.
    pub fn piece(&mut self, piece: Piece) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        match piece {
            Piece::Text {
                text, reasoning, ..
            } => {
                if self.thinking && !reasoning.is_empty() {
                    let index = self.open_block(
                        |b| matches!(b, ContentBlock::Thinking { .. }),
                        || ContentBlock::Thinking {
                            thinking: String::new(),
                            signature: String::new(),
                        },
                        &mut events,
                    );
                    if let ContentBlock::Thinking { thinking, .. } =
                        &mut self.message.content[index]
                    {
                        thinking.push_str(&reasoning);
                    }
                    events.push(StreamEvent::ContentBlockDelta {
                        index,
                        delta: BlockDelta::ThinkingDelta {
                            thinking: reasoning,
                        },
                    });
                }
                if !text.is_empty() {
                    let index = self.open_block(
                        |b| matches!(b, ContentBlock::Text { .. }),
                        || ContentBlock::Text {
                            text: String::new(),
                        },
                        &mut events,
                    );
                    if let ContentBlock::Text { text: all, .. } = &mut self.message.content[index] {
                        all.push_str(&text);
                    }
                    events.push(StreamEvent::ContentBlockDelta {
                        index,
                        delta: BlockDelta::TextDelta { text },
                    });
                }
            }
            Piece::ToolCallStart { id, name, .. } => {
                self.close(&mut events);
                // The engine's ids are `call_...`; Anthropic's `toolu_...`.
                let id = format!("toolu_{}", id.strip_prefix("call_").unwrap_or(&id));
                self.push_block(
                    ContentBlock::ToolUse {
                        id,
                        name,
                        input: Value::Object(Map::new()),
                    },
                    &mut events,
                );
            }
            Piece::ToolCallArguments { arguments, .. } => {
                let Some(index) = self
                    .open
                    .filter(|&i| matches!(self.message.content[i], ContentBlock::ToolUse { .. }))
                else {
                    tracing::warn!("tool call arguments outside a tool_use block; dropped");
                    return events;
                };
                self.arguments.push_str(&arguments);
                events.push(StreamEvent::ContentBlockDelta {
                    index,
                    delta: BlockDelta::InputJsonDelta {
                        partial_json: arguments,
                    },
                });
            }
            Piece::Finish {
                reason,
                stop_sequence,
                ..
            } => {
                self.message.stop_reason = Some(match reason {
                    FinishReason::Length => StopReason::MaxTokens,
                    FinishReason::ToolCalls => StopReason::ToolUse,
                    FinishReason::Stop if stop_sequence.is_some() => StopReason::StopSequence,
                    FinishReason::Stop => StopReason::EndTurn,
                });
                self.message.stop_sequence = stop_sequence;
            }
            Piece::PromptLogprobs { .. } => {}
        }
        events
    }

    /// The end: the open block closes, the usage is set, then
    /// `message_delta` and `message_stop`.
    pub fn finish(&mut self, usage: Usage) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        self.close(&mut events);
        let cached = usage.cached_tokens.min(usage.prompt_tokens);
        self.message.usage = MessageUsage {
            input_tokens: usage.prompt_tokens - cached,
            output_tokens: usage.completion_tokens,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: cached,
        };
        if self.message.stop_reason.is_none() {
            self.message.stop_reason = Some(StopReason::EndTurn);
        }
        events.push(StreamEvent::MessageDelta {
            delta: MessageDeltaBody {
                stop_reason: self.message.stop_reason,
                stop_sequence: self.message.stop_sequence.clone(),
            },
            usage: self.message.usage,
        });
        events.push(StreamEvent::MessageStop {});
        events
    }

    /// The index of the open block if `is_kind` holds for it, else of a
    /// new block made by `new` (the open one closed first).
    fn open_block(
        &mut self,
        is_kind: impl Fn(&ContentBlock) -> bool,
        new: impl FnOnce() -> ContentBlock,
        events: &mut Vec<StreamEvent>,
    ) -> usize {
        if let Some(index) = self.open.filter(|&i| is_kind(&self.message.content[i])) {
            return index;
        }
        self.close(events);
        self.push_block(new(), events)
    }

    /// Adds `block` as the open one and announces it.
    fn push_block(&mut self, block: ContentBlock, events: &mut Vec<StreamEvent>) -> usize {
        let index = self.message.content.len();
        events.push(StreamEvent::ContentBlockStart {
            index,
            content_block: block.clone(),
        });
        self.message.content.push(block);
        self.open = Some(index);
        index
    }

    /// Closes the open block, if any: a `tool_use` gets its arguments as
    /// `input` (`{}` when they are no JSON object, e.g. cut by
    /// `max_tokens`).
    fn close(&mut self, events: &mut Vec<StreamEvent>) {
        let Some(index) = self.open.take() else {
            return;
        };
        let arguments = std::mem::take(&mut self.arguments);
        if let ContentBlock::ToolUse { input, name, .. } = &mut self.message.content[index] {
            match serde_json::from_str::<Value>(&arguments) {
                Ok(value @ Value::Object(_)) => *input = value,
                _ => tracing::warn!(
                    tool = %name,
                    arguments_len = arguments.len(),
                    "tool_use arguments are not a complete JSON object; input is {{}}"
                ),
            }
        }
        events.push(StreamEvent::ContentBlockStop { index });
    }
}
