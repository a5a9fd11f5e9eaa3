//! The bounded in-memory store of responses, for `previous_response_id`
//! and `GET`/`DELETE /v1/responses/{id}`.
//!
//! It holds at most `capacity` responses by id (`--responses-store-size`);
//! storing one more evicts the oldest. A stored response keeps the one it
//! continued alive (by reference, not by copy) even once that one has
//! left the store, so a conversation continues for as long as its latest
//! response is stored. Nothing is written to disk: a restart forgets every
//! response.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::openai::response_object::{OutputItem, ResponseObject};
use crate::validate::ConversationItem;

/// One stored response: the conversation it continued, its own input and
/// output items, and the response object as answered.
#[derive(Debug)]
pub struct StoredResponse {
    /// The response it continued (`previous_response_id`).
    pub parent: Option<Arc<StoredResponse>>,
    /// Its input items, then its output items.
    pub items: Vec<ConversationItem>,
    /// The response object.
    pub response: ResponseObject,
}

impl StoredResponse {
    /// A response continuing `parent`, made of `input` and the output of
    /// `response`.
    pub fn new(
        parent: Option<Arc<StoredResponse>>,
        mut input: Vec<ConversationItem>,
        response: ResponseObject,
    ) -> Self {
        input.extend(response.output.iter().map(output_item));
        Self {
            parent,
            items: input,
            response,
        }
    }

    /// Every item of the conversation up to and including this response,
    /// oldest first.
    pub fn conversation(&self) -> Vec<&ConversationItem> {
        let mut chain = vec![self];
        while let Some(parent) = chain.last().and_then(|r| r.parent.as_deref()) {
            chain.push(parent);
        }
        chain.iter().rev().flat_map(|r| r.items.iter()).collect()
    }
}

impl Drop for StoredResponse {
    /// Unlinks the chain of parents one by one: dropping a long
    /// conversation must not recurse once per turn.
    fn drop(&mut self) {
        let mut next = self.parent.take();
        while let Some(parent) = next {
            next = match Arc::try_unwrap(parent) {
                Ok(mut parent) => parent.parent.take(),
                Err(_) => None,
            };
        }
    }
}

/// An output item as the next turn's prompt reads it.
fn output_item(item: &OutputItem) -> ConversationItem {
    match item {
        OutputItem::Message(message) => ConversationItem::Message {
            role: "assistant",
            text: message.content.iter().map(|p| p.text.as_str()).collect(),
        },
        OutputItem::FunctionCall(call) => ConversationItem::FunctionCall {
            call_id: call.call_id.clone(),
            name: call.name.clone(),
            arguments: call.arguments.clone(),
        },
    }
}

/// Responses by id, oldest evicted first.
#[derive(Debug)]
pub struct ResponseStore {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<String, Arc<StoredResponse>>,
    /// Ids in the order stored.
    order: VecDeque<String>,
}

impl ResponseStore {
    /// A store of at most `capacity` responses (0: it stores nothing).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Whether it stores anything.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // The map stays consistent even if a holder panicked.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `response` under its id, evicting the oldest beyond the
    /// capacity.
    pub fn insert(&self, response: StoredResponse) {
        if !self.enabled() {
            return;
        }
        let id = response.response.id.clone();
        let evicted: Vec<Arc<StoredResponse>> = {
            let mut inner = self.lock();
            if inner.by_id.insert(id.clone(), Arc::new(response)).is_none() {
                inner.order.push_back(id);
            }
            let mut evicted = Vec::new();
            while inner.by_id.len() > self.capacity {
                let Some(oldest) = inner.order.pop_front() else {
                    break;
                };
                evicted.extend(inner.by_id.remove(&oldest));
            }
            evicted
        };
        // Dropped outside the lock: a long conversation takes a while.
        drop(evicted);
    }

    /// The stored response `id`.
    pub fn get(&self, id: &str) -> Option<Arc<StoredResponse>> {
        self.lock().by_id.get(id).cloned()
    }

    /// Forgets response `id`; false when it was not stored. Responses that
    /// continued it keep their conversation.
    pub fn delete(&self, id: &str) -> bool {
        let removed = {
            let mut inner = self.lock();
            let removed = inner.by_id.remove(id);
            if removed.is_some() {
                inner.order.retain(|stored| stored != id);
            }
            removed
        };
        removed.is_some()
    }

    /// Responses stored now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().by_id.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::response_object::{
        FunctionCallItem, ItemStatus, OutputMessage, OutputText, ResponseStatus,
    };

    fn response(id: &str, output: Vec<OutputItem>) -> ResponseObject {
        ResponseObject {
            id: id.to_owned(),
            object: "response",
            created_at: 0,
            status: ResponseStatus::Completed,
            background: false,
            error: None,
            incomplete_details: None,
            instructions: None,
            max_output_tokens: None,
            max_tool_calls: None,
            model: "m".into(),
            output,
            parallel_tool_calls: true,
            previous_response_id: None,
            reasoning: serde_json::Value::Null,
            service_tier: "default",
            store: true,
            temperature: 1.0,
            text: serde_json::Value::Null,
            tool_choice: serde_json::Value::Null,
            tools: Vec::new(),
            top_logprobs: 0,
            top_p: 1.0,
            truncation: "disabled",
            usage: None,
            user: None,
            metadata: Default::default(),
        }
    }

    fn user(text: &str) -> ConversationItem {
        ConversationItem::Message {
            role: "user",
            text: text.to_owned(),
        }
    }

    fn said(text: &str) -> OutputItem {
        OutputItem::Message(OutputMessage {
            kind: "message",
            id: "msg_1".into(),
            status: ItemStatus::Completed,
            role: "assistant",
            content: vec![OutputText::new(text.to_owned())],
        })
    }

    #[test]
    fn the_oldest_response_is_evicted_beyond_the_capacity() {
        let store = ResponseStore::new(2);
        for id in ["a", "b", "c"] {
            store.insert(StoredResponse::new(
                None,
                vec![user(id)],
                response(id, vec![]),
            ));
        }
        assert_eq!(store.len(), 2);
        assert!(store.get("a").is_none());
        assert!(store.get("b").is_some() && store.get("c").is_some());
        // A deleted id leaves room, and is not evicted a second time.
        assert!(store.delete("b"));
        assert!(!store.delete("b"));
        store.insert(StoredResponse::new(None, vec![], response("d", vec![])));
        assert_eq!(store.len(), 2);
        assert!(store.get("c").is_some() && store.get("d").is_some());
    }

    #[test]
    fn a_store_of_size_zero_keeps_nothing() {
        let store = ResponseStore::new(0);
        assert!(!store.enabled());
        store.insert(StoredResponse::new(None, vec![], response("a", vec![])));
        assert!(store.get("a").is_none());
    }

    /// A conversation is the chain of its responses' items, oldest first,
    /// and lives on while its latest response is stored, even once the
    /// earlier ones were evicted.
    #[test]
    fn a_continued_conversation_outlives_the_eviction_of_its_start() {
        let store = ResponseStore::new(1);
        let call = OutputItem::FunctionCall(FunctionCallItem {
            kind: "function_call",
            id: "fc_1".into(),
            call_id: "call_1".into(),
            name: "f".into(),
            arguments: "{}".into(),
            status: ItemStatus::Completed,
        });
        store.insert(StoredResponse::new(
            None,
            vec![user("hi")],
            response("a", vec![call]),
        ));
        let first = store.get("a");
        let output = ConversationItem::FunctionCallOutput {
            call_id: "call_1".into(),
            output: "42".into(),
        };
        store.insert(StoredResponse::new(
            first,
            vec![output.clone()],
            response("b", vec![said("ok")]),
        ));
        assert!(store.get("a").is_none(), "evicted");
        let second = store.get("b").unwrap();
        let items: Vec<ConversationItem> = second.conversation().into_iter().cloned().collect();
        assert_eq!(
            items,
            vec![
                user("hi"),
                ConversationItem::FunctionCall {
                    call_id: "call_1".into(),
                    name: "f".into(),
                    arguments: "{}".into(),
                },
                output,
                ConversationItem::Message {
                    role: "assistant",
                    text: "ok".into(),
                },
            ]
        );
    }

    /// Dropping a conversation of many turns does not recurse per turn.
    #[test]
    fn a_long_chain_drops_without_deep_recursion() {
        let mut last: Option<Arc<StoredResponse>> = None;
        for i in 0..200_000 {
            let id = format!("r{i}");
            last = Some(Arc::new(StoredResponse::new(
                last,
                vec![],
                response(&id, vec![]),
            )));
        }
        drop(last);
    }
}
