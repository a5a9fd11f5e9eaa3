//! Building a `response` from the pieces of its one choice, and the
//! events that tell a stream how it was built.
//!
//! The streamed and the whole answer are made by the same [`Assembler`]:
//! a whole answer is the last snapshot of a stream nobody read, so the
//! two cannot disagree.

use mlxcel_engine_api::{FinishReason, Usage};

use crate::choices::Piece;
use crate::openai::response_object::{
    EventBody, FunctionCallItem, IncompleteDetails, ItemStatus, OutputItem, OutputMessage,
    OutputText, ResponseError, ResponseObject, ResponseStatus, StreamEvent,
};

/// A response being built: the snapshot, the item being generated, and the
/// number of the next event.
#[derive(Debug, Clone)]
pub struct Assembler {
    response: ResponseObject,
    /// Index in `output` of the item still generating.
    open: Option<usize>,
    sequence: u64,
    finish: Option<FinishReason>,
}

impl Assembler {
    /// Starts from `response` (status `in_progress`, no output, no usage).
    pub fn new(response: ResponseObject) -> Self {
        Self {
            response,
            open: None,
            sequence: 0,
            finish: None,
        }
    }

    /// The snapshot so far.
    pub fn response(&self) -> &ResponseObject {
        &self.response
    }

    /// `response.created` and `response.in_progress`.
    pub fn opening(&mut self) -> Vec<StreamEvent> {
        vec![
            self.snapshot_event("response.created"),
            self.snapshot_event("response.in_progress"),
        ]
    }

    /// The events of `piece`: an item opened (the one before it closed),
    /// text or arguments added. Reasoning text and prompt logprobs are not
    /// part of a response.
    pub fn piece(&mut self, piece: Piece) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        match piece {
            Piece::Text { text, .. } if !text.is_empty() => {
                let index = match self.open_message() {
                    Some(index) => index,
                    None => {
                        self.close(ItemStatus::Completed, &mut events);
                        self.open_item(OutputItem::Message(new_message()), &mut events)
                    }
                };
                let OutputItem::Message(message) = &mut self.response.output[index] else {
                    return events;
                };
                if let Some(part) = message.content.first_mut() {
                    part.text.push_str(&text);
                }
                let item_id = message.id.clone();
                events.push(self.event(
                    "response.output_text.delta",
                    EventBody::TextDelta {
                        item_id,
                        output_index: index,
                        content_index: 0,
                        delta: text,
                        logprobs: Vec::new(),
                    },
                ));
            }
            Piece::ToolCallStart { id, name, .. } => {
                self.close(ItemStatus::Completed, &mut events);
                let call = FunctionCallItem {
                    kind: "function_call",
                    id: format!("fc_{}", uuid::Uuid::new_v4().simple()),
                    call_id: id,
                    name,
                    arguments: String::new(),
                    status: ItemStatus::InProgress,
                };
                self.open_item(OutputItem::FunctionCall(call), &mut events);
            }
            Piece::ToolCallArguments { arguments, .. } => {
                let Some(index) = self.open else {
                    tracing::warn!("function call arguments before any call; dropped");
                    return events;
                };
                let OutputItem::FunctionCall(call) = &mut self.response.output[index] else {
                    tracing::warn!("function call arguments inside a message; dropped");
                    return events;
                };
                call.arguments.push_str(&arguments);
                let item_id = call.id.clone();
                events.push(self.event(
                    "response.function_call_arguments.delta",
                    EventBody::ArgumentsDelta {
                        item_id,
                        output_index: index,
                        delta: arguments,
                    },
                ));
            }
            Piece::Finish { reason, .. } => self.finish = Some(reason),
            Piece::Text { .. } | Piece::PromptLogprobs { .. } => {}
        }
        events
    }

    /// The end: the open item closes (an empty message is made if nothing
    /// was generated), the status is `completed`, or `incomplete` when the
    /// token budget ran out, and the last event carries the whole response.
    pub fn finish(&mut self, usage: Usage) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        if self.response.output.is_empty() {
            self.open_item(OutputItem::Message(new_message()), &mut events);
        }
        let cut = self.finish == Some(FinishReason::Length);
        let status = if cut {
            ItemStatus::Incomplete
        } else {
            ItemStatus::Completed
        };
        self.close(status, &mut events);
        self.response.usage = Some(usage.into());
        let kind = if cut {
            self.response.status = ResponseStatus::Incomplete;
            self.response.incomplete_details = Some(IncompleteDetails {
                reason: "max_output_tokens",
            });
            "response.incomplete"
        } else {
            self.response.status = ResponseStatus::Completed;
            "response.completed"
        };
        events.push(self.snapshot_event(kind));
        events
    }

    /// A failure: the open item is left incomplete, the status is
    /// `failed` with `message`, and `response.failed` ends the stream.
    pub fn fail(&mut self, message: String) -> StreamEvent {
        if let Some(index) = self.open.take() {
            set_status(&mut self.response.output[index], ItemStatus::Incomplete);
        }
        self.response.status = ResponseStatus::Failed;
        self.response.error = Some(ResponseError {
            code: "server_error",
            message,
        });
        self.snapshot_event("response.failed")
    }

    /// The output item still generating, if it is a message.
    fn open_message(&self) -> Option<usize> {
        self.open
            .filter(|&i| matches!(self.response.output[i], OutputItem::Message(_)))
    }

    /// Adds `item` (status in progress) and announces it; a message also
    /// gets its one, empty, text part. Returns its index.
    fn open_item(&mut self, item: OutputItem, events: &mut Vec<StreamEvent>) -> usize {
        let index = self.response.output.len();
        let part = matches!(item, OutputItem::Message(_)).then(|| OutputText::new(String::new()));
        let item_id = item.id().to_owned();
        events.push(self.event(
            "response.output_item.added",
            EventBody::Item {
                output_index: index,
                item: item.clone(),
            },
        ));
        self.response.output.push(item);
        self.open = Some(index);
        if let Some(part) = part {
            if let OutputItem::Message(message) = &mut self.response.output[index] {
                message.content.push(part.clone());
            }
            events.push(self.event(
                "response.content_part.added",
                EventBody::Part {
                    item_id,
                    output_index: index,
                    content_index: 0,
                    part,
                },
            ));
        }
        index
    }

    /// Closes the open item, if any, with `status`: the done events of its
    /// text or arguments, then `response.output_item.done`.
    fn close(&mut self, status: ItemStatus, events: &mut Vec<StreamEvent>) {
        let Some(index) = self.open.take() else {
            return;
        };
        set_status(&mut self.response.output[index], status);
        let item = self.response.output[index].clone();
        match &item {
            OutputItem::Message(message) => {
                for (content_index, part) in message.content.iter().enumerate() {
                    events.push(self.event(
                        "response.output_text.done",
                        EventBody::TextDone {
                            item_id: message.id.clone(),
                            output_index: index,
                            content_index,
                            text: part.text.clone(),
                            logprobs: Vec::new(),
                        },
                    ));
                    events.push(self.event(
                        "response.content_part.done",
                        EventBody::Part {
                            item_id: message.id.clone(),
                            output_index: index,
                            content_index,
                            part: part.clone(),
                        },
                    ));
                }
            }
            OutputItem::FunctionCall(call) => events.push(self.event(
                "response.function_call_arguments.done",
                EventBody::ArgumentsDone {
                    item_id: call.id.clone(),
                    output_index: index,
                    name: call.name.clone(),
                    arguments: call.arguments.clone(),
                },
            )),
        }
        events.push(self.event(
            "response.output_item.done",
            EventBody::Item {
                output_index: index,
                item,
            },
        ));
    }

    fn snapshot_event(&mut self, kind: &'static str) -> StreamEvent {
        let response = Box::new(self.response.clone());
        self.event(kind, EventBody::Response { response })
    }

    fn event(&mut self, kind: &'static str, body: EventBody) -> StreamEvent {
        let sequence_number = self.sequence;
        self.sequence += 1;
        StreamEvent {
            kind,
            sequence_number,
            body,
        }
    }
}

/// An empty assistant message, in progress.
fn new_message() -> OutputMessage {
    OutputMessage {
        kind: "message",
        id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
        status: ItemStatus::InProgress,
        role: "assistant",
        content: Vec::new(),
    }
}

fn set_status(item: &mut OutputItem, status: ItemStatus) {
    match item {
        OutputItem::Message(message) => message.status = status,
        OutputItem::FunctionCall(call) => call.status = status,
    }
}
