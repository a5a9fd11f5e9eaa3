//! Anthropic's Messages API over the fake engine: how a body becomes the
//! engine's chat request, how pieces become content blocks, and errors in
//! Anthropic's shape (from validation, the engine, the API key and origin
//! checks, and in the middle of a stream).

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use mlxcel_engine_api::{
    ChatMessage, FailureKind, FinishReason, GenerationEvent, SubmitError, Timings, ToolCall,
    ToolChoice,
};
use mlxcel_http::cors::AllowedOrigins;
use mlxcel_http::HttpConfig;
use serde_json::{json, Value};

async fn post_messages(app: axum::Router, body: Value) -> Reply {
    post_raw_to(
        app,
        "/v1/messages",
        Some("application/json"),
        body.to_string(),
    )
    .await
}

fn body() -> Value {
    json!({"model": MODEL, "max_tokens": 16,
           "messages": [{"role": "user", "content": "Hi"}]})
}

/// Asserts an Anthropic error body and returns its message.
fn anthropic_error(reply: &Reply, status: StatusCode, kind: &str) -> String {
    assert_eq!(
        reply.status,
        status,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.headers["content-type"], "application/json");
    let v = reply.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    assert_eq!(v["error"].as_object().unwrap().len(), 2, "{v}");
    v["error"]["message"].as_str().unwrap().to_owned()
}

/// `(event name, data)` of an Anthropic stream.
fn events(reply: &Reply) -> Vec<(String, Value)> {
    assert_eq!(reply.status, StatusCode::OK);
    let text = std::str::from_utf8(&reply.body).unwrap();
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap();
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
            (name.to_owned(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

fn finished_with(reason: FinishReason, stop_sequence: Option<&str>) -> GenerationEvent {
    GenerationEvent::Finished {
        index: 0,
        reason,
        usage: USAGE,
        timings: Timings::default(),
        stop_sequence: stop_sequence.map(str::to_owned),
    }
}

fn reasoning(text: &str, reasoning: &str) -> GenerationEvent {
    GenerationEvent::Delta {
        index: 0,
        token: 1,
        text: text.to_owned(),
        reasoning: reasoning.to_owned(),
        logprobs: None,
    }
}

#[tokio::test]
async fn a_conversation_becomes_the_chat_request() {
    let service = FakeService::hello();
    let request = json!({
        "model": MODEL, "max_tokens": 32, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "stop_sequences": ["END"], "metadata": {"user_id": "u-1"},
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Use tools."}],
        "tools": [{"name": "read_file", "description": "Reads a file",
                   "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
                   "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Read a.txt"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": "sig"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.txt"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": true,
                 "content": "no such file"},
                {"type": "text", "text": "Try b.txt"}]},
        ],
    });
    let reply = post_messages(app(service.clone()), request).await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let r = service.last_request();
    let mlxcel_engine_api::Prompt::Chat(messages) = &r.prompt else {
        panic!("a chat prompt: {:?}", r.prompt);
    };
    assert_eq!(
        messages,
        &vec![
            ChatMessage::text("system", "Be brief.\n\nUse tools."),
            ChatMessage::text("user", "Read a.txt"),
            ChatMessage {
                role: "assistant".into(),
                content: Some("Reading.".into()),
                tool_calls: vec![ToolCall {
                    id: "toolu_1".into(),
                    name: "read_file".into(),
                    arguments: r#"{"path":"a.txt"}"#.into(),
                }],
                reasoning_content: Some("I should read it.".into()),
                ..ChatMessage::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: Some("Error: no such file".into()),
                tool_call_id: Some("toolu_1".into()),
                name: Some("read_file".into()),
                ..ChatMessage::default()
            },
            ChatMessage::text("user", "Try b.txt"),
        ]
    );
    assert_eq!(r.max_tokens, 32);
    assert_eq!(r.sampling.temperature, 0.5);
    assert_eq!(r.sampling.top_p, 0.9);
    assert_eq!(r.sampling.top_k, 40);
    assert_eq!(r.stop, vec!["END".to_owned()]);
    assert_eq!(r.tools.len(), 1);
    assert_eq!(r.tools[0].name, "read_file");
    assert_eq!(r.tool_choice, ToolChoice::Auto);
    assert!(!r.parallel_tool_calls);
    assert_eq!(r.chat_template_kwargs["enable_thinking"], json!(false));
    assert_eq!(r.n, 1);
}

#[tokio::test]
async fn tool_choices_map_to_the_engine_choices() {
    let tools = json!([{"name": "f", "input_schema": {"type": "object"}},
                       {"name": "g", "input_schema": {"type": "object"}}]);
    for (choice, expected) in [
        (json!({"type": "any"}), ToolChoice::Required),
        (
            json!({"type": "tool", "name": "g"}),
            ToolChoice::Function("g".into()),
        ),
        (json!({"type": "none"}), ToolChoice::None),
        (json!({"type": "auto"}), ToolChoice::Auto),
    ] {
        let service = FakeService::hello();
        let mut request = body();
        request["tools"] = tools.clone();
        request["tool_choice"] = choice.clone();
        let reply = post_messages(app(service.clone()), request).await;
        assert_eq!(reply.status, StatusCode::OK, "{choice}");
        assert_eq!(service.last_request().tool_choice, expected, "{choice}");
        assert!(service.last_request().parallel_tool_calls);
    }
}

#[tokio::test]
async fn pieces_become_blocks_and_the_stop_sequence_is_named() {
    let script = vec![
        reasoning("", "Think "),
        reasoning("", "more."),
        reasoning("The answer", ""),
        GenerationEvent::ToolCallStart {
            index: 0,
            id: "call_abc".into(),
            name: "f".into(),
        },
        tool_args_at(0, "{\"x\": "),
        tool_args_at(0, "1}"),
        finished_with(FinishReason::ToolCalls, None),
    ];
    let mut request = body();
    request["tools"] = json!([{"name": "f", "input_schema": {"type": "object"}}]);
    request["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    request["max_tokens"] = json!(2048);
    let reply = post_messages(app(FakeService::new(script.clone())), request.clone()).await;
    assert_eq!(reply.status, StatusCode::OK);
    let m = reply.json();
    assert_eq!(
        m["content"],
        json!([
            {"type": "thinking", "thinking": "Think more.", "signature": ""},
            {"type": "text", "text": "The answer"},
            {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"x": 1}},
        ])
    );
    assert_eq!(m["stop_reason"], "tool_use");
    // USAGE: 7 prompt tokens, 2 of them cached, 3 generated.
    assert_eq!(
        m["usage"],
        json!({"input_tokens": 5, "output_tokens": 3, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": 2})
    );
    // Streamed: the same blocks, one start/stop pair each, in order.
    request["stream"] = json!(true);
    let reply = post_messages(app(FakeService::new(script.clone())), request.clone()).await;
    let names: Vec<String> = events(&reply).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let all = events(&reply);
    assert_eq!(
        all[3].1["delta"],
        json!({"type": "thinking_delta", "thinking": "Think "})
    );
    assert_eq!(
        all[10].1["delta"],
        json!({"type": "input_json_delta", "partial_json": "{\"x\": "})
    );
    assert_eq!(
        all[13].1["delta"],
        json!({"stop_reason": "tool_use", "stop_sequence": null})
    );
    assert_eq!(all[13].1["usage"]["output_tokens"], 3);
    // Without thinking, reasoning is not returned.
    request.as_object_mut().unwrap().remove("thinking");
    request["stream"] = json!(false);
    let service = FakeService::new(script);
    let reply = post_messages(app(service.clone()), request).await;
    let m = reply.json();
    assert_eq!(
        m["content"][0],
        json!({"type": "text", "text": "The answer"})
    );
    assert_eq!(m["content"].as_array().unwrap().len(), 2);
    assert_eq!(
        service.last_request().chat_template_kwargs["enable_thinking"],
        json!(false)
    );

    let stopped = vec![
        delta("Hello"),
        finished_with(FinishReason::Stop, Some("END")),
    ];
    let m = post_messages(app(FakeService::new(stopped)), body())
        .await
        .json();
    assert_eq!(m["stop_reason"], "stop_sequence");
    assert_eq!(m["stop_sequence"], "END");
    let plain = vec![delta("Hello"), finished_with(FinishReason::Stop, None)];
    let m = post_messages(app(FakeService::new(plain)), body())
        .await
        .json();
    assert_eq!(m["stop_reason"], "end_turn");
    assert_eq!(m["stop_sequence"], Value::Null);
}

#[tokio::test]
async fn a_mid_stream_failure_ends_with_an_error_event() {
    let service = FakeService::new(vec![
        delta("Hel"),
        GenerationEvent::Failed {
            kind: FailureKind::OutOfMemory,
            message: "boom".into(),
        },
    ]);
    let mut request = body();
    request["stream"] = json!(true);
    let reply = post_messages(app(service), request).await;
    let all = events(&reply);
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "error"
        ]
    );
    let error = &all[4].1;
    assert_eq!(error["type"], "error");
    assert_eq!(error["error"]["type"], "overloaded_error");
    assert!(error["error"]["message"].as_str().unwrap().contains("boom"));
}

#[tokio::test]
async fn errors_are_anthropic_shaped() {
    // Validation, naming the field.
    let mut bad = body();
    bad["messages"][0]["content"] = json!([{"type": "document", "source": {}}]);
    let message = anthropic_error(
        &post_messages(app(FakeService::hello()), bad).await,
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
    );
    assert!(message.contains("messages[0].content[0].type"), "{message}");
    let mut bad = body();
    bad["max_tokens"] = json!("many");
    let message = anthropic_error(
        &post_messages(app(FakeService::hello()), bad).await,
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
    );
    assert!(message.contains("max_tokens"), "{message}");
    // The engine's refusals.
    let refusing = FakeService::refusing(SubmitError::ContextLengthExceeded {
        prompt_tokens: 9000,
        context_length: 4096,
    });
    let message = anthropic_error(
        &post_messages(app(refusing), body()).await,
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
    );
    assert!(message.starts_with("messages: "), "{message}");
    let gone = FakeService::refusing(SubmitError::Unavailable("shutting down".into()));
    anthropic_error(
        &post_messages(app(gone), body()).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded_error",
    );
    // Not JSON, not a JSON content type.
    let reply = post_raw_to(
        app(FakeService::hello()),
        "/v1/messages",
        Some("application/json"),
        "{",
    )
    .await;
    anthropic_error(&reply, StatusCode::BAD_REQUEST, "invalid_request_error");
    let reply = post_raw_to(
        app(FakeService::hello()),
        "/v1/messages/count_tokens",
        Some("text/plain"),
        "hi",
    )
    .await;
    anthropic_error(
        &reply,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
    );
    // The key, checked before routing.
    let config = HttpConfig {
        api_key: Some("sk-1".into()),
        allowed_origins: AllowedOrigins::List(vec!["https://ok.example".into()]),
        ..HttpConfig::default()
    };
    let reply = post_raw_to(
        app_with(FakeService::hello(), config.clone()),
        "/v1/messages",
        Some("application/json"),
        body().to_string(),
    )
    .await;
    anthropic_error(&reply, StatusCode::UNAUTHORIZED, "authentication_error");
    assert_eq!(reply.headers["www-authenticate"], "Bearer");
    let request = Request::post("/v1/messages")
        .header("content-type", "application/json")
        .header("x-api-key", "sk-1")
        .header("origin", "https://evil.example")
        .body(Body::from(body().to_string()))
        .unwrap();
    let reply = send(app_with(FakeService::hello(), config.clone()), request).await;
    anthropic_error(&reply, StatusCode::FORBIDDEN, "permission_error");
    let request = Request::post("/v1/messages")
        .header("content-type", "application/json")
        .header("x-api-key", "sk-1")
        .body(Body::from(body().to_string()))
        .unwrap();
    assert_eq!(
        send(app_with(FakeService::hello(), config), request)
            .await
            .status,
        StatusCode::OK
    );
    // Other routes keep OpenAI's shape.
    let reply = post_raw(app(FakeService::hello()), Some("application/json"), "{").await;
    reply.error(StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn count_tokens_counts_the_rendered_request() {
    let service = FakeService::hello();
    let mut request = body();
    request.as_object_mut().unwrap().remove("max_tokens");
    request["tools"] = json!([{"name": "f", "input_schema": {"type": "object"}}]);
    let reply = post_raw_to(
        app(service.clone()),
        "/v1/messages/count_tokens",
        Some("application/json"),
        request.to_string(),
    )
    .await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let v = reply.json();
    // The fake renders "user: Hi\n" (9 characters, one id each) and a
    // 3-token generation prompt.
    assert_eq!(v, json!({"input_tokens": 12}));
    // Nothing is generated.
    assert_eq!(service.request_count(), 0);
}

#[tokio::test]
async fn adaptive_thinking_reasons_and_display_omitted_hides_it() {
    let script = vec![
        reasoning("", "Hmm."),
        reasoning("Yes", ""),
        finished_with(FinishReason::Stop, None),
    ];
    for (thinking, reason, blocks) in [
        (
            json!({"type": "adaptive"}),
            true,
            json!([{"type": "thinking", "thinking": "Hmm.", "signature": ""}, {"type": "text", "text": "Yes"}]),
        ),
        (
            json!({"type": "adaptive", "display": "omitted"}),
            true,
            json!([{"type": "text", "text": "Yes"}]),
        ),
        (
            json!({"type": "disabled"}),
            false,
            json!([{"type": "text", "text": "Yes"}]),
        ),
    ] {
        let service = FakeService::new(script.clone());
        let mut request = body();
        request["thinking"] = thinking.clone();
        let m = post_messages(app(service.clone()), request).await.json();
        assert_eq!(m["content"], blocks, "{thinking}");
        assert_eq!(
            service.last_request().chat_template_kwargs["enable_thinking"],
            json!(reason),
            "{thinking}"
        );
    }
    for (thinking, param) in [
        (json!({"type": "enabled"}), "thinking.budget_tokens"),
        (
            json!({"type": "adaptive", "budget_tokens": 2048}),
            "thinking.budget_tokens",
        ),
        (
            json!({"type": "enabled", "budget_tokens": 1024}),
            "thinking.budget_tokens",
        ),
        (
            json!({"type": "disabled", "display": "omitted"}),
            "thinking.display",
        ),
        (json!({"type": "between_tools"}), "thinking.type"),
    ] {
        let mut request = body();
        request["thinking"] = thinking.clone();
        let reply = post_messages(app(FakeService::hello()), request).await;
        let message = anthropic_error(&reply, StatusCode::BAD_REQUEST, "invalid_request_error");
        assert!(message.contains(param), "{thinking}: {message}");
    }
}

#[tokio::test]
async fn consecutive_turns_are_combined_and_prefill_is_refused() {
    let service = FakeService::hello();
    let mut request = body();
    request["messages"] = json!([
        {"role": "user", "content": "One."},
        {"role": "user", "content": [{"type": "text", "text": "Two."}]},
        {"role": "assistant", "content": "Three."},
        {"role": "assistant", "content": [{"type": "text", "text": "Four."}]},
        {"role": "user", "content": "Five."},
    ]);
    let reply = post_messages(app(service.clone()), request).await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let mlxcel_engine_api::Prompt::Chat(messages) = service.last_request().prompt else {
        panic!("a chat prompt");
    };
    assert_eq!(
        messages,
        vec![
            ChatMessage::text("user", "One.\n\nTwo."),
            ChatMessage::text("assistant", "Three.\n\nFour."),
            ChatMessage::text("user", "Five."),
        ]
    );
    let mut prefill = body();
    prefill["messages"] = json!([
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi"},
    ]);
    let reply = post_messages(app(FakeService::hello()), prefill).await;
    let message = anthropic_error(&reply, StatusCode::BAD_REQUEST, "invalid_request_error");
    assert!(
        message.contains("messages[1].role") && message.contains("prefill"),
        "{message}"
    );
}
