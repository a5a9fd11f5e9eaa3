//! Special-token strings in text the client wrote, marked so that they are
//! encoded as plain text: a user who types `<|im_end|>` in a message must
//! not end their turn or forge another role's (see [`crate::tokenizer`]).

use mlxcel_engine_api::{ChatMessage, ToolDefinition};

use crate::tokenizer::TextTokenizer;

/// `messages`, `tools` and the chat template variables with every
/// special-token string in text the client wrote (contents, names, tool-call
/// ids and arguments, tool descriptions and schemas, variable keys and
/// values) marked so that it is encoded as plain text
/// (see [`crate::tokenizer`]); `None` when there was nothing to mark.
#[allow(clippy::type_complexity)]
pub fn mark_client_text(
    tok: &TextTokenizer,
    messages: &[ChatMessage],
    tools: &[ToolDefinition],
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Option<(
    Vec<ChatMessage>,
    Vec<ToolDefinition>,
    serde_json::Map<String, serde_json::Value>,
)> {
    let mut changed = false;
    let mut mark = |text: &mut String| {
        if let Some(marked) = tok.mark_special_text(text) {
            *text = marked;
            changed = true;
        }
    };
    let mut messages = messages.to_vec();
    for m in &mut messages {
        m.content.iter_mut().for_each(&mut mark);
        m.name.iter_mut().for_each(&mut mark);
        m.tool_call_id.iter_mut().for_each(&mut mark);
        m.reasoning_content.iter_mut().for_each(&mut mark);
        for call in &mut m.tool_calls {
            mark(&mut call.id);
            mark(&mut call.name);
            mark(&mut call.arguments);
        }
    }
    let mut tools = tools.to_vec();
    for t in &mut tools {
        mark(&mut t.name);
        t.description.iter_mut().for_each(&mut mark);
        mark_json(&mut t.parameters, &mut mark);
    }
    let kwargs = kwargs
        .iter()
        .map(|(key, value)| {
            let (mut key, mut value) = (key.clone(), value.clone());
            mark(&mut key);
            mark_json(&mut value, &mut mark);
            (key, value)
        })
        .collect();
    changed.then_some((messages, tools, kwargs))
}

/// Applies `mark` to every string of `value`, object keys included.
pub fn mark_json(value: &mut serde_json::Value, mark: &mut impl FnMut(&mut String)) {
    match value {
        serde_json::Value::String(s) => mark(s),
        serde_json::Value::Array(items) => items.iter_mut().for_each(|v| mark_json(v, mark)),
        serde_json::Value::Object(map) => {
            let entries: Vec<(String, serde_json::Value)> =
                std::mem::take(map).into_iter().collect();
            for (mut key, mut v) in entries {
                mark(&mut key);
                mark_json(&mut v, mark);
                map.insert(key, v);
            }
        }
        _ => {}
    }
}
