//! Greedy parity with mlx_lm: for every golden in tests/goldens (made by
//! scripts/make_goldens.py with mlx_lm 0.32.2 on the same checkpoint, float32),
//! our prompt tokens and our 32 greedy completion tokens equal the peer's.

mod common;

use common::{goldens, model_dir, GOLDEN_MAX_TOKENS};
use mlxcel_engine::api::{
    ChatMessage, FinishReason, GenerationEvent, GenerationRequest, InferenceService, Prompt,
    SamplingParams,
};
use mlxcel_engine::{Engine, EngineConfig};

fn run(engine: &Engine, messages: Vec<ChatMessage>) -> (Vec<u32>, String, FinishReason, usize) {
    let mut stream = engine
        .submit(GenerationRequest::new(
            Prompt::Chat(messages),
            SamplingParams::greedy(),
            GOLDEN_MAX_TOKENS,
        ))
        .expect("submit");
    let (mut ids, mut text) = (Vec::new(), String::new());
    while let Some(event) = stream.blocking_recv() {
        match event {
            GenerationEvent::Delta { token, text: t, .. } => {
                if !engine.eos_token_ids().contains(&token) {
                    ids.push(token);
                }
                text.push_str(&t);
            }
            GenerationEvent::Finished { reason, usage, .. } => {
                return (ids, text, reason, usage.completion_tokens)
            }
            GenerationEvent::Failed { message, .. } => panic!("failed: {message}"),
            other @ (GenerationEvent::PromptLogprobs { .. }
            | GenerationEvent::ToolCallStart { .. }
            | GenerationEvent::ToolCallArguments { .. }
            | GenerationEvent::Embedding { .. }) => {
                panic!("unexpected tool call {other:?}")
            }
        }
    }
    panic!("stream ended without Finished");
}

#[test]
fn greedy_tokens_equal_mlx_lm() {
    let engine = Engine::start(EngineConfig::new(model_dir())).expect("engine");
    let goldens = goldens();
    assert!(goldens.len() >= 8, "at least 8 goldens");
    let mut failures = Vec::new();
    for g in &goldens {
        let messages: Vec<ChatMessage> = g
            .messages
            .iter()
            .map(|(role, content)| ChatMessage::text(role.clone(), content.clone()))
            .collect();
        let prompt = engine
            .tokenize_prompt(&Prompt::Chat(messages.clone()), &[])
            .expect("tokenize");
        assert_eq!(prompt, g.prompt_ids, "{}: prompt tokens", g.name);
        let (ids, text, reason, completion_tokens) = run(&engine, messages);
        let want_reason = match g.finish_reason.as_str() {
            "stop" => FinishReason::Stop,
            _ => FinishReason::Length,
        };
        // Usage counts the EOS token when generation stopped on it.
        let want_completion =
            g.completion_ids.len() + usize::from(want_reason == FinishReason::Stop);
        if ids != g.completion_ids || reason != want_reason || completion_tokens != want_completion
        {
            failures.push(format!(
                "{}: got {ids:?} ({reason:?}, {completion_tokens})\n  want {:?} ({want_reason:?}, {want_completion})",
                g.name, g.completion_ids
            ));
            continue;
        }
        // The text: equal to the peer's decode wherever it is valid UTF-8
        // (the peer's decode shows a broken tail as U+FFFD, which our
        // streaming detokenizer flushes the same way at the end).
        assert_eq!(text, g.completion_text, "{}: text", g.name);
        eprintln!("{}: {} tokens equal", g.name, ids.len());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
