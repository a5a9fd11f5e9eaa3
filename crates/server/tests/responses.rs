//! `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`, against the
//! fake engine: what the engine is asked (the chat path's request), the
//! response object, the typed event stream, and the store.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use common::*;
use mlxcel_engine_api::{
    ChatMessage, FinishReason, GenerationEvent, Prompt, ResponseFormat, ToolCall, ToolChoice,
};
use mlxcel_http::HttpConfig;
use serde_json::{json, Value};

async fn create(app: Router, body: Value) -> Reply {
    post_raw_to(
        app,
        "/v1/responses",
        Some("application/json"),
        body.to_string(),
    )
    .await
}

/// A call of `get_weather` whose arguments come in two fragments.
fn call_script() -> Vec<GenerationEvent> {
    vec![
        tool_call_at(0, "call_1", "get_weather"),
        tool_args_at(0, r#"{"city": "#),
        tool_args_at(0, r#""Paris"}"#),
        finished(FinishReason::ToolCalls),
    ]
}

fn weather_tool() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}})
}

/// `(event, data)` of every SSE event, in order.
fn events(reply: &Reply) -> Vec<(String, Value)> {
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.headers["content-type"], "text/event-stream");
    let text = std::str::from_utf8(&reply.body).unwrap();
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((name.to_owned(), serde_json::from_str(data).unwrap()))
        })
        .collect()
}

#[tokio::test]
async fn a_text_answer_is_one_message_with_usage() {
    let service = FakeService::hello();
    let reply = create(
        app(service.clone()),
        json!({"model": MODEL, "input": "Hi", "instructions": "Be brief.",
               "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 3,
               "metadata": {"k": "v"}}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    assert!(body["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(body["object"], "response");
    assert_eq!(body["status"], "completed");
    assert_eq!(body["model"], MODEL);
    assert_eq!(body["instructions"], "Be brief.");
    assert_eq!(body["max_output_tokens"], 9);
    assert_eq!(body["temperature"], 0.5);
    assert_eq!(body["metadata"], json!({"k": "v"}));
    assert_eq!(body["store"], true);
    assert_eq!(body["text"], json!({"format": {"type": "text"}}));
    assert_eq!(body["tool_choice"], "auto");
    let output = body["output"].as_array().unwrap();
    assert_eq!(output.len(), 1);
    assert_eq!(output[0]["type"], "message");
    assert_eq!(output[0]["role"], "assistant");
    assert_eq!(output[0]["status"], "completed");
    assert_eq!(
        output[0]["content"],
        json!([{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}])
    );
    assert_eq!(
        body["usage"],
        json!({"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2},
               "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": 10})
    );
    let request = service.last_request();
    assert_eq!(
        request.prompt,
        Prompt::Chat(vec![
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", "Hi"),
        ])
    );
    assert_eq!(request.max_tokens, 9);
    assert_eq!(request.sampling.temperature, 0.5);
    assert_eq!(request.sampling.top_p, 0.9);
    assert_eq!(request.sampling.seed, Some(3));
    assert_eq!(request.n, 1);
}

/// Input items become the chat messages a chat request would send:
/// parts joined, developer read as system, function calls joined to the
/// assistant message before them, outputs as tool messages named after
/// their function. Tools, a named tool choice and a json_schema format
/// become the chat path's tools and grammar.
#[tokio::test]
async fn input_items_tools_and_format_become_the_chat_request() {
    let service = FakeService::hello();
    let schema = json!({"type": "object", "properties": {"t": {"type": "string"}}});
    let reply = create(
        app(service.clone()),
        json!({
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}]},
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
                 "arguments": "{\"city\": \"Paris\"}", "status": "completed"},
                {"type": "function_call_output", "call_id": "call_a", "output": "Sunny"},
            ],
            "tools": [weather_tool()],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": false,
            "text": {"format": {"type": "json_schema", "name": "t", "schema": schema, "strict": true}},
        }),
    )
    .await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let request = service.last_request();
    let call = ToolCall {
        id: "call_a".into(),
        name: "get_weather".into(),
        arguments: r#"{"city": "Paris"}"#.into(),
    };
    assert_eq!(
        request.prompt,
        Prompt::Chat(vec![
            ChatMessage::text("system", "Use tools."),
            ChatMessage::text("user", "Weather in Paris?"),
            ChatMessage {
                tool_calls: vec![call],
                ..ChatMessage::text("assistant", "Let me look.")
            },
            ChatMessage {
                tool_call_id: Some("call_a".into()),
                name: Some("get_weather".into()),
                ..ChatMessage::text("tool", "Sunny")
            },
        ])
    );
    assert_eq!(request.tools.len(), 1);
    assert_eq!(request.tools[0].name, "get_weather");
    assert_eq!(
        request.tool_choice,
        ToolChoice::Function("get_weather".into())
    );
    assert!(!request.parallel_tool_calls);
    assert_eq!(
        request.response_format,
        Some(ResponseFormat::JsonSchema(schema.clone()))
    );
    let body = reply.json();
    assert_eq!(
        body["tool_choice"],
        json!({"type": "function", "name": "get_weather"})
    );
    assert_eq!(body["text"]["format"]["schema"], schema);
    assert_eq!(body["tools"][0]["name"], "get_weather");
    assert_eq!(body["parallel_tool_calls"], false);
}

#[tokio::test]
async fn a_function_call_is_an_output_item() {
    let service = FakeService::new(call_script());
    let reply = create(
        app(service),
        json!({"input": "Weather in Paris?", "tools": [weather_tool()]}),
    )
    .await;
    let body = reply.json();
    assert_eq!(body["status"], "completed");
    let item = &body["output"][0];
    assert_eq!(body["output"].as_array().unwrap().len(), 1);
    assert_eq!(item["type"], "function_call");
    assert!(item["id"].as_str().unwrap().starts_with("fc_"));
    assert_eq!(item["call_id"], "call_1");
    assert_eq!(item["name"], "get_weather");
    assert_eq!(item["arguments"], r#"{"city": "Paris"}"#);
    assert_eq!(item["status"], "completed");
}

#[tokio::test]
async fn a_cut_answer_is_incomplete() {
    let service = FakeService::new(hello_script(FinishReason::Length));
    let body = create(app(service), json!({"input": "Hi"})).await.json();
    assert_eq!(body["status"], "incomplete");
    assert_eq!(
        body["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(body["output"][0]["status"], "incomplete");
    assert_eq!(body["output"][0]["content"][0]["text"], "Hello");
}

/// The documented order, numbered from 0: created, in_progress, the
/// message's added events, its deltas, its done events, then the call's
/// added, argument deltas, done events, then completed with the whole
/// response, which equals the non-streamed one but for ids and times.
#[tokio::test]
async fn the_stream_is_the_typed_events_in_order() {
    let script = vec![
        delta("Let me "),
        delta("check."),
        tool_call_at(0, "call_1", "get_weather"),
        tool_args_at(0, r#"{"city": "#),
        tool_args_at(0, r#""Paris"}"#),
        finished(FinishReason::ToolCalls),
    ];
    let body = json!({"input": "Weather?", "tools": [weather_tool()]});
    let whole = create(app(FakeService::new(script.clone())), body.clone())
        .await
        .json();
    let mut streamed_body = body;
    streamed_body["stream"] = json!(true);
    let reply = create(app(FakeService::new(script)), streamed_body).await;
    let events = events(&reply);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (kind, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], *kind);
        assert_eq!(data["sequence_number"], i as u64);
    }
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert_eq!(events[0].1["response"]["output"], json!([]));
    assert_eq!(events[2].1["item"]["content"], json!([]));
    assert_eq!(events[4].1["delta"], "Let me ");
    assert_eq!(events[6].1["text"], "Let me check.");
    assert_eq!(events[9].1["output_index"], 1);
    assert_eq!(events[9].1["item"]["arguments"], "");
    assert_eq!(events[12].1["arguments"], r#"{"city": "Paris"}"#);
    assert_eq!(events[12].1["name"], "get_weather");
    let last = &events[14].1["response"];
    let strip = |mut r: Value| {
        for key in ["id", "created_at"] {
            r[key] = Value::Null;
        }
        for item in r["output"].as_array_mut().unwrap() {
            item["id"] = Value::Null;
        }
        r
    };
    assert_eq!(strip(last.clone()), strip(whole));
    assert!(!String::from_utf8_lossy(&reply.body).contains("[DONE]"));
}

#[tokio::test]
async fn an_engine_failure_ends_the_stream_with_response_failed() {
    let service = FakeService::new(vec![
        delta("Hel"),
        GenerationEvent::Failed {
            kind: mlxcel_engine_api::FailureKind::Model,
            message: "boom".into(),
        },
    ]);
    let reply = create(app(service), json!({"input": "Hi", "stream": true})).await;
    let events = events(&reply);
    let (kind, data) = events.last().unwrap();
    assert_eq!(kind, "response.failed");
    assert_eq!(data["response"]["status"], "failed");
    assert_eq!(data["response"]["error"]["code"], "server_error");
    assert!(data["response"]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("boom"));
}

/// `previous_response_id` puts the stored conversation (its input and
/// output, not its instructions) before the new input; the stored
/// response can be read back and deleted.
#[tokio::test]
async fn a_stored_response_continues_and_can_be_read_and_deleted() {
    let service = FakeService::scripted(vec![call_script(), hello_script(FinishReason::Stop)]);
    let app = app(service.clone());
    let first = create(
        app.clone(),
        json!({"input": "Weather in Paris?", "instructions": "Be brief.", "tools": [weather_tool()]}),
    )
    .await
    .json();
    let id = first["id"].as_str().unwrap().to_owned();
    let second = create(
        app.clone(),
        json!({"previous_response_id": id, "tools": [weather_tool()],
               "input": [{"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]}),
    )
    .await
    .json();
    assert_eq!(second["previous_response_id"], id.as_str());
    assert_eq!(second["output"][0]["content"][0]["text"], "Hello");
    assert_eq!(
        service.last_request().prompt,
        Prompt::Chat(vec![
            ChatMessage::text("user", "Weather in Paris?"),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: vec![ToolCall {
                    id: "call_1".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city": "Paris"}"#.into(),
                }],
                ..ChatMessage::default()
            },
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                name: Some("get_weather".into()),
                ..ChatMessage::text("tool", "Sunny")
            },
        ])
    );
    let read = get(app.clone(), &format!("/v1/responses/{id}")).await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(read.json(), first);
    let delete = |app: Router| {
        let uri = format!("/v1/responses/{id}");
        async move { send(app, Request::delete(uri).body(Body::empty()).unwrap()).await }
    };
    let deleted = delete(app.clone()).await;
    assert_eq!(deleted.status, StatusCode::OK);
    assert_eq!(
        deleted.json(),
        json!({"id": id, "object": "response.deleted", "deleted": true})
    );
    delete(app.clone()).await.error(StatusCode::NOT_FOUND);
    get(app.clone(), &format!("/v1/responses/{id}"))
        .await
        .error(StatusCode::NOT_FOUND);
    let error = create(app, json!({"previous_response_id": id, "input": "Hi"}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], "previous_response_id");
    assert_eq!(error["code"], "previous_response_not_found");
}

#[tokio::test]
async fn store_false_keeps_nothing_and_a_store_of_size_zero_refuses_store_true() {
    let app_ = app(FakeService::hello());
    let body = create(app_.clone(), json!({"input": "Hi", "store": false}))
        .await
        .json();
    assert_eq!(body["store"], false);
    get(
        app_,
        &format!("/v1/responses/{}", body["id"].as_str().unwrap()),
    )
    .await
    .error(StatusCode::NOT_FOUND);
    let config = HttpConfig {
        responses_store_size: 0,
        ..HttpConfig::default()
    };
    let off = app_with(FakeService::hello(), config);
    // Omitted: not stored, and said so.
    let body = create(off.clone(), json!({"input": "Hi"})).await.json();
    assert_eq!(body["store"], false);
    for (body, param) in [
        (json!({"input": "Hi", "store": true}), "store"),
        (
            json!({"input": "Hi", "previous_response_id": "resp_x"}),
            "previous_response_id",
        ),
    ] {
        let error = create(off.clone(), body)
            .await
            .error(StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], param);
    }
}

/// What mlxcel does not serve is a 400 naming the field, never ignored.
#[tokio::test]
async fn unsupported_fields_and_items_are_a_400_naming_the_param() {
    let cases = [
        (
            json!({"input": [{"type": "reasoning", "summary": []}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0].type",
        ),
        (
            json!({"input": "Hi", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (json!({"input": "Hi", "background": true}), "background"),
        (
            json!({"input": "Hi", "reasoning": {"effort": "high"}}),
            "reasoning",
        ),
        (json!({"input": "Hi", "truncation": "auto"}), "truncation"),
        (
            json!({"input": "Hi", "include": ["reasoning.encrypted_content"]}),
            "include",
        ),
        (json!({"input": "Hi", "top_logprobs": 2}), "top_logprobs"),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}),
            "input[0].call_id",
        ),
        (
            json!({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}),
            "input[0].arguments",
        ),
        (
            json!({"input": [{"role": "user", "content": "x", "output": "y"}]}),
            "input[0].output",
        ),
        (
            json!({"input": "Hi", "tools": [weather_tool()], "tool_choice": {"type": "function", "name": "other"}}),
            "tool_choice.name",
        ),
        (
            json!({"input": "Hi", "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"input": "Hi", "text": {"format": {"type": "json_schema"}}}),
            "text.format.name",
        ),
        (
            json!({"input": "Hi", "text": {"format": {"type": "text", "name": "x"}}}),
            "text.format.name",
        ),
        (
            json!({"input": "Hi", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"input": "Hi", "stream_options": {}}),
            "stream_options",
        ),
        (json!({"input": []}), "input"),
        (json!({"instructions": "x"}), "input"),
        (json!({"input": "Hi", "frobnicate": 1}), "frobnicate"),
    ];
    for (body, param) in cases {
        let service = FakeService::hello();
        let error = create(app(service.clone()), body.clone())
            .await
            .error(StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], param, "{body}: {error}");
        assert_eq!(service.request_count(), 0, "{body}");
    }
    // Defaults of the unsupported fields are accepted.
    let reply = create(
        app(FakeService::hello()),
        json!({"input": "Hi", "background": false, "include": [], "truncation": "disabled",
               "service_tier": "auto", "top_logprobs": 0, "text": {"verbosity": "medium"}}),
    )
    .await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
}

#[tokio::test]
async fn another_model_is_a_404() {
    let error = create(
        app(FakeService::hello()),
        json!({"model": "gpt-4o", "input": "Hi"}),
    )
    .await
    .error(StatusCode::NOT_FOUND);
    assert_eq!(error["code"], "model_not_found");
}
