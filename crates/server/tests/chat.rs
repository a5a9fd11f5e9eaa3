//! Non-streamed chat completions against a fake engine.

mod common;

use axum::http::StatusCode;
use common::*;
use mlxcel_engine_api::{
    ChatMessage, FinishReason, GenerationEvent, GenerationRequest, Prompt, RequestField,
    SamplingParams, SubmitError, ToolChoice,
};
use mlxcel_http::openai::unix_now;
use serde_json::json;

#[tokio::test]
async fn answers_with_the_full_chat_completion_object() {
    let fake = FakeService::hello();
    let before = unix_now();
    let reply = post_json(app(fake.clone()), hello_request()).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["content-type"], "application/json");
    let body = reply.json();

    let id = body["id"].as_str().unwrap();
    assert!(
        id.starts_with("chatcmpl-") && id.len() > "chatcmpl-".len() + 16,
        "{id}"
    );
    let created = body["created"].as_u64().unwrap();
    assert!(created >= before && created <= unix_now() + 1);
    let expected = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": MODEL,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "finish_reason": "stop",
            "logprobs": null,
        }],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    });
    assert_eq!(body, expected);
}

#[tokio::test]
async fn completion_ids_are_unique() {
    let fake = FakeService::hello();
    let a = post_json(app(fake.clone()), hello_request()).await.json();
    let b = post_json(app(fake), hello_request()).await.json();
    assert_ne!(a["id"], b["id"]);
}

#[tokio::test]
async fn reports_length_as_the_finish_reason() {
    let fake = FakeService::new(hello_script(FinishReason::Length));
    let body = post_json(app(fake), hello_request()).await.json();
    assert_eq!(body["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn defaults_reach_the_engine_when_fields_are_absent() {
    let fake = FakeService::hello();
    post_json(app(fake.clone()), hello_request()).await;
    assert_eq!(
        fake.last_request(),
        GenerationRequest {
            prompt: Prompt::Chat(vec![ChatMessage::text("user", "Hi")]),
            sampling: SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                min_p: 0.0,
                seed: None,
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                repetition_penalty: 1.0,
            },
            max_tokens: 512,
            ignore_eos: false,
            min_tokens: 0,
            chat_template_kwargs: serde_json::Map::new(),
            cache_prompt: true,
            speculative: true,
            stop: vec![],
            logit_bias: vec![],
            logprobs: None,
            prompt_logprobs: None,
            n: 1,
            response_format: None,
            tools: vec![],
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
        }
    );
}

#[tokio::test]
async fn sampling_parameters_pass_through_exactly() {
    let fake = FakeService::hello();
    let body = json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again"},
        ],
        "max_tokens": 100,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 42,
        "n": 1,
        "user": "user-1234",
        "stream": false,
    });
    let reply = post_json(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK);
    let request = fake.last_request();
    assert_eq!(
        request.sampling,
        SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            min_p: 0.05,
            seed: Some(42),
            ..SamplingParams::default()
        }
    );
    assert_eq!(request.max_tokens, 100);
    let Prompt::Chat(messages) = request.prompt else {
        panic!("expected a chat prompt");
    };
    let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"]);
    assert_eq!(messages[3].content.as_deref(), Some("Again"));
}

#[tokio::test]
async fn greedy_and_edge_values_are_accepted() {
    let fake = FakeService::hello();
    let body = json!({
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 1, "seed": -1,
    });
    assert_eq!(
        post_json(app(fake.clone()), body).await.status,
        StatusCode::OK
    );
    let sampling = fake.last_request().sampling;
    assert_eq!(sampling.temperature, 0.0);
    assert_eq!(sampling.min_p, 1.0);
    assert_eq!(sampling.seed, Some(u64::MAX));
}

#[tokio::test]
async fn max_completion_tokens_sets_the_limit() {
    let fake = FakeService::hello();
    let mut body = hello_request();
    body["max_completion_tokens"] = json!(33);
    post_json(app(fake.clone()), body.clone()).await;
    assert_eq!(fake.last_request().max_tokens, 33);

    body["max_tokens"] = json!(33);
    assert_eq!(
        post_json(app(fake.clone()), body).await.status,
        StatusCode::OK
    );
    assert_eq!(fake.last_request().max_tokens, 33);
}

#[tokio::test]
async fn text_content_parts_are_concatenated() {
    let fake = FakeService::hello();
    let body = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello, "},
        {"type": "text", "text": "world"},
    ]}]});
    assert_eq!(
        post_json(app(fake.clone()), body).await.status,
        StatusCode::OK
    );
    let Prompt::Chat(messages) = fake.last_request().prompt else {
        panic!("expected a chat prompt");
    };
    assert_eq!(messages[0].content.as_deref(), Some("Hello, world"));
}

#[tokio::test]
async fn unsupported_fields_with_default_values_are_accepted() {
    let fake = FakeService::hello();
    let body = json!({
        "messages": [{"role": "user", "content": "Hi", "name": null}],
        "stop": null,
        "tools": [],
        "logprobs": false,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "max_tokens": null,
        "store": false,
        "service_tier": "auto",
        "modalities": ["text"],
        "functions": [],
        "metadata": {},
    });
    let reply = post_json(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json());
    assert_eq!(fake.last_request().max_tokens, 512);
}

#[tokio::test]
async fn engine_failure_is_a_500_with_the_openai_body() {
    let fake = FakeService::new(vec![
        delta("Hel"),
        GenerationEvent::Failed {
            kind: mlxcel_engine_api::FailureKind::Model,
            message: "forward failed".into(),
        },
    ]);
    let reply = post_json(app(fake), hello_request()).await;
    let error = reply.error(StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(error["type"], "server_error");
    assert_eq!(error["param"], json!(null));
    assert!(error["message"]
        .as_str()
        .unwrap()
        .contains("forward failed"));
}

#[tokio::test]
async fn a_stream_that_ends_without_finishing_is_a_500() {
    let fake = FakeService::new(vec![delta("Hel")]);
    let error = post_json(app(fake), hello_request())
        .await
        .error(StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(error["type"], "server_error");
}

#[tokio::test]
async fn engine_refusal_is_a_400_naming_its_param() {
    let fake = FakeService::refusing(SubmitError::InvalidRequest {
        message: "prompt is longer than the context (5000 > 4096)".into(),
        field: Some(RequestField::Prompt),
    });
    let error = post_json(app(fake), hello_request())
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["param"], "messages");
    assert_eq!(
        error["message"],
        "prompt is longer than the context (5000 > 4096)"
    );
}

#[tokio::test]
async fn a_prompt_longer_than_the_context_is_a_400_with_its_code() {
    let fake = FakeService::refusing(SubmitError::ContextLengthExceeded {
        prompt_tokens: 5000,
        context_length: 4096,
    });
    let error = post_json(app(fake), hello_request())
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["code"], "context_length_exceeded");
    assert_eq!(error["param"], "messages");
    assert_eq!(
        error["message"],
        "the prompt has 5000 tokens; this model's context is 4096 tokens"
    );
}

#[tokio::test]
async fn unavailable_engine_is_a_503() {
    let fake = FakeService::refusing(SubmitError::Unavailable("shutting down".into()));
    let error = post_json(app(fake), hello_request())
        .await
        .error(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error["type"], "server_error");
    assert_eq!(error["code"], "service_unavailable");
}

#[tokio::test]
async fn invalid_requests_never_reach_the_engine() {
    let fake = FakeService::hello();
    let mut body = hello_request();
    body["temperature"] = json!(3);
    post_json(app(fake.clone()), body).await;
    assert_eq!(fake.request_count(), 0);
}

#[tokio::test]
async fn every_response_carries_a_request_id() {
    let fake = FakeService::hello();
    let reply = post_json(app(fake.clone()), hello_request()).await;
    let id = reply.headers["x-request-id"].to_str().unwrap();
    assert!(!id.is_empty());

    let request = axum::http::Request::get("/health")
        .header("x-request-id", "client-id-1")
        .body(axum::body::Body::empty())
        .unwrap();
    let reply = send(app(fake), request).await;
    assert_eq!(reply.headers["x-request-id"], "client-id-1");
}

#[tokio::test]
async fn developer_role_is_the_system_role() {
    let fake = FakeService::hello();
    let body = json!({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"}
    ]});
    let reply = post_json(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        fake.last_request().prompt,
        Prompt::Chat(vec![
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", "Hi"),
        ])
    );
}
