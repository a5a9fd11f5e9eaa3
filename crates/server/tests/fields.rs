//! Every request field of the wire spec reaches the engine as the
//! `GenerationRequest` it means; each new rule refuses with its `param`
//! before anything is submitted.

mod common;

use axum::http::StatusCode;
use common::*;
use mlxcel_engine_api::{
    ChatMessage, GenerationRequest, Prompt, ResponseFormat, SamplingParams, ToolCall, ToolChoice,
    ToolDefinition,
};
use serde_json::{json, Value};

#[tokio::test]
async fn a_full_chat_request_reaches_the_engine() {
    let fake = FakeService::hello();
    let body = json!({
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?", "name": "ann"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C"},
            {"role": "assistant", "content": "It is 18C.", "tool_calls": [],
             "reasoning_content": "The tool said 18C."},
        ],
        "max_completion_tokens": 50,
        "temperature": 0.5,
        "stop": ["\n\n", "END"],
        "presence_penalty": 0.5,
        "frequency_penalty": -1.5,
        "repetition_penalty": 1.25,
        "logit_bias": {"50256": -100, "7": 2.5},
        "logprobs": true,
        "top_logprobs": 3,
        "n": 3,
        "user": "user-42",
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "weather", "description": "d", "strict": true,
            "schema": {"type": "object", "properties": {"t": {"type": "number"}}},
        }},
        "tools": [
            {"type": "function", "function": {
                "name": "get_weather", "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": null,
            }},
            {"type": "function", "function": {"name": "get-time_2"}},
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": true,
        "cache_prompt": false,
    });
    let reply = post_json(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json());
    let expected = GenerationRequest {
        prompt: Prompt::Chat(vec![
            ChatMessage::text("system", "Use tools."),
            ChatMessage {
                name: Some("ann".into()),
                ..ChatMessage::text("user", "Weather in Paris?")
            },
            ChatMessage {
                role: "assistant".into(),
                content: None,
                tool_calls: vec![ToolCall {
                    id: "call_1".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into(),
                }],
                tool_call_id: None,
                name: None,
                reasoning_content: None,
            },
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                name: Some("get_weather".into()),
                ..ChatMessage::text("tool", "18C")
            },
            ChatMessage {
                reasoning_content: Some("The tool said 18C.".into()),
                ..ChatMessage::text("assistant", "It is 18C.")
            },
        ]),
        sampling: SamplingParams {
            temperature: 0.5,
            presence_penalty: 0.5,
            frequency_penalty: -1.5,
            repetition_penalty: 1.25,
            ..SamplingParams::default()
        },
        max_tokens: 50,
        ignore_eos: false,
        min_tokens: 0,
        chat_template_kwargs: serde_json::Map::new(),
        cache_prompt: false,
        speculative: true,
        stop: vec!["\n\n".into(), "END".into()],
        logit_bias: vec![(7, 2.5), (50256, -100.0)],
        logprobs: Some(3),
        prompt_logprobs: None,
        n: 3,
        response_format: Some(ResponseFormat::JsonSchema(
            json!({"type": "object", "properties": {"t": {"type": "number"}}}),
        )),
        tools: vec![
            ToolDefinition {
                name: "get_weather".into(),
                description: Some("Current weather".into()),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            },
            ToolDefinition {
                name: "get-time_2".into(),
                description: None,
                parameters: json!({"type": "object", "properties": {}}),
            },
        ],
        tool_choice: ToolChoice::Function("get_weather".into()),
        parallel_tool_calls: true,
    };
    assert_eq!(fake.last_request(), expected);
}

/// The engine's request for a chat body with `field` set to `value`.
async fn chat_with(field: &str, value: Value) -> GenerationRequest {
    let fake = FakeService::hello();
    let mut body = hello_request();
    body[field] = value;
    body["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
    let reply = post_json(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json());
    fake.last_request()
}

#[tokio::test]
async fn each_choice_of_format_and_tool_choice() {
    let format = |v| async move { chat_with("response_format", v).await.response_format };
    assert_eq!(format(json!({"type": "text"})).await, None);
    assert_eq!(
        format(json!({"type": "json_object"})).await,
        Some(ResponseFormat::JsonObject)
    );
    assert_eq!(
        format(json!({"type": "json_schema", "json_schema": {"name": "x"}})).await,
        Some(ResponseFormat::JsonSchema(json!({})))
    );
    let choice = |v| async move { chat_with("tool_choice", v).await.tool_choice };
    assert_eq!(choice(json!("none")).await, ToolChoice::None);
    assert_eq!(choice(json!("auto")).await, ToolChoice::Auto);
    assert_eq!(choice(json!("required")).await, ToolChoice::Required);
    assert_eq!(chat_with("stop", json!("##")).await.stop, ["##"]);
    assert_eq!(chat_with("n", json!(16)).await.n, 16);
    assert_eq!(chat_with("top_logprobs", json!(null)).await.logprobs, None);
}

#[tokio::test]
async fn a_full_completion_request_reaches_the_engine() {
    let fake = FakeService::hello();
    let body = json!({
        "model": MODEL,
        "prompt": [1, 2],
        "suffix": "",
        "max_tokens": 8,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 4,
        "min_p": 0.1,
        "seed": 9,
        "stop": "\n",
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "repetition_penalty": 2,
        "logit_bias": {"3": 100},
        "logprobs": 5,
        "echo": false,
        "n": 2,
        "best_of": 2,
        "stream": false,
        "user": "u",
        "cache_prompt": true,
    });
    let reply = post_completion(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json());
    let expected = GenerationRequest {
        stop: vec!["\n".into()],
        logit_bias: vec![(3, 100.0)],
        logprobs: Some(5),
        n: 2,
        ..GenerationRequest::new(
            Prompt::Tokens(vec![1, 2]),
            SamplingParams {
                temperature: 0.0,
                top_p: 0.5,
                top_k: 4,
                min_p: 0.1,
                seed: Some(9),
                presence_penalty: -2.0,
                frequency_penalty: 2.0,
                repetition_penalty: 2.0,
            },
            8,
        )
    };
    assert_eq!(fake.last_request(), expected);
}

/// Posts `body` to `uri` and checks a 400 naming `param`, with nothing
/// submitted.
async fn assert_refused(uri: &str, body: Value, param: &str) {
    let fake = FakeService::hello();
    let reply = post_raw_to(
        app(fake.clone()),
        uri,
        Some("application/json"),
        body.to_string(),
    )
    .await;
    let error = reply.error(StatusCode::BAD_REQUEST);
    assert_eq!(error["type"], "invalid_request_error", "{body}");
    assert_eq!(error["param"], param, "{body} -> {error}");
    assert_eq!(fake.request_count(), 0, "{body} reached the engine");
}

fn chat(fields: Value) -> Value {
    let mut body = hello_request();
    for (key, value) in fields.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

fn completion(fields: Value) -> Value {
    let mut body = json!({"prompt": "Hi"});
    for (key, value) in fields.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

fn tool(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name}})
}

#[tokio::test]
async fn each_new_chat_rule_names_its_param() {
    let cases = [
        // MisplacedMessageField
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages[0].tool_calls",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}),
            "messages[0].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]}),
            "messages[0].reasoning_content",
        ),
        // Missing: a tool message without its call id; null content
        // without tool calls.
        (
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            "messages[0].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": null}]}),
            "messages[0].content",
        ),
        // UnsupportedToolType on a message's tool call
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [
                {"id": "c", "type": "code", "function": {"name": "f", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls[0].type",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        // StopCount, EmptyStop
        (chat(json!({"stop": ["a", "b", "c", "d", "e"]})), "stop"),
        (chat(json!({"stop": ""})), "stop"),
        (chat(json!({"stop": ["a", ""]})), "stop[1]"),
        (chat(json!({"stop": ["a", 1]})), "stop[1]"),
        // PenaltyOutOfRange, RepetitionPenaltyOutOfRange
        (chat(json!({"presence_penalty": 2.5})), "presence_penalty"),
        (
            chat(json!({"frequency_penalty": -2.5})),
            "frequency_penalty",
        ),
        (chat(json!({"repetition_penalty": 0})), "repetition_penalty"),
        (
            chat(json!({"repetition_penalty": 2.5})),
            "repetition_penalty",
        ),
        // LogitBiasKey, LogitBiasOutOfRange, wrong value type
        (chat(json!({"logit_bias": {"abc": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {"-1": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {"4294967296": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {"07": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {"5": 101}})), "logit_bias"),
        (chat(json!({"logit_bias": {"5": "x"}})), "logit_bias.5"),
        (chat(json!({"logit_bias": [1]})), "logit_bias"),
        // TopLogprobsWithoutLogprobs, TopLogprobsOutOfRange
        (chat(json!({"top_logprobs": 2})), "top_logprobs"),
        (
            chat(json!({"logprobs": false, "top_logprobs": 2})),
            "top_logprobs",
        ),
        (
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        (chat(json!({"logprobs": 1})), "logprobs"),
        // NOutOfRange
        (chat(json!({"n": 17})), "n"),
        // UnsupportedResponseFormat and its shape
        (
            chat(json!({"response_format": {"type": "yaml"}})),
            "response_format.type",
        ),
        (chat(json!({"response_format": {}})), "response_format.type"),
        (
            chat(json!({"response_format": {"type": "json_schema"}})),
            "response_format.json_schema",
        ),
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
            ),
            "response_format.json_schema.name",
        ),
        (
            chat(json!({"response_format": {"type": "json_schema",
                        "json_schema": {"name": "x", "schema": "object"}}})),
            "response_format.json_schema.schema",
        ),
        (
            chat(json!({"response_format": {"type": "json_object", "extra": 1}})),
            "response_format.extra",
        ),
        // UnsupportedToolType, InvalidToolName, tool shapes
        (
            chat(json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})),
            "tools[0].type",
        ),
        (
            chat(json!({"tools": [tool("f"), tool("bad name")]})),
            "tools[1].function.name",
        ),
        (chat(json!({"tools": [tool("")]})), "tools[0].function.name"),
        (
            chat(json!({"tools": [tool(&"a".repeat(65))]})),
            "tools[0].function.name",
        ),
        (
            chat(
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}),
            ),
            "tools[0].function.parameters",
        ),
        (
            chat(json!({"tools": [{"type": "function"}]})),
            "tools[0].function",
        ),
        (chat(json!({"tools": {"f": 1}})), "tools"),
        // UnsupportedToolChoice, ToolChoiceWithoutTools, UnknownToolChoice
        (
            chat(json!({"tools": [tool("f")], "tool_choice": "any"})),
            "tool_choice",
        ),
        (chat(json!({"tool_choice": "required"})), "tool_choice"),
        (
            chat(json!({"tool_choice": {"type": "function", "function": {"name": "f"}}})),
            "tool_choice",
        ),
        (
            chat(json!({"tools": [tool("f")],
                        "tool_choice": {"type": "function", "function": {"name": "g"}}})),
            "tool_choice.function.name",
        ),
        (
            chat(json!({"tools": [tool("f")],
                        "tool_choice": {"type": "tool", "function": {"name": "f"}}})),
            "tool_choice.type",
        ),
        // parallel_tool_calls type
        (
            chat(json!({"parallel_tool_calls": "no"})),
            "parallel_tool_calls",
        ),
        // A completions-only field.
        (chat(json!({"echo": true})), "echo"),
    ];
    for (body, param) in cases {
        assert_refused("/v1/chat/completions", body, param).await;
    }
}

#[tokio::test]
async fn each_completion_rule_names_its_param() {
    let cases = [
        (json!({}), "prompt"),
        (json!({"prompt": null}), "prompt"),
        (json!({"prompt": 5}), "prompt"),
        // EmptyPrompt
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": [[1], []]}), "prompt[1]"),
        // Mixed lists
        (json!({"prompt": ["a", 1]}), "prompt[1]"),
        (json!({"prompt": [1, "a"]}), "prompt[1]"),
        (json!({"prompt": [[1], 2]}), "prompt[1]"),
        (json!({"prompt": [{"a": 1}]}), "prompt[0]"),
        // TokenIdOutOfRange
        (json!({"prompt": [1, -1]}), "prompt[1]"),
        (json!({"prompt": [[1, 4294967296u64]]}), "prompt[0][1]"),
        // MaxTokensTooSmall; no max_completion_tokens here
        (completion(json!({"max_tokens": 0})), "max_tokens"),
        (
            completion(json!({"max_completion_tokens": 5})),
            "max_completion_tokens",
        ),
        // LogprobsOutOfRange
        (completion(json!({"logprobs": 6})), "logprobs"),
        (completion(json!({"logprobs": -1})), "logprobs"),
        (completion(json!({"logprobs": true})), "logprobs"),
        (completion(json!({"echo": "yes"})), "echo"),
        // BestOfNotN
        (completion(json!({"best_of": 2})), "best_of"),
        (completion(json!({"n": 2, "best_of": 3})), "best_of"),
        // Shared rules, on this endpoint too
        (completion(json!({"n": 0})), "n"),
        (
            completion(json!({"stop": ["a", "b", "c", "d", "e"]})),
            "stop",
        ),
        (
            completion(json!({"presence_penalty": 3})),
            "presence_penalty",
        ),
        (completion(json!({"logit_bias": {"x": 1}})), "logit_bias"),
        (
            completion(json!({"stream_options": {"include_usage": true}})),
            "stream_options",
        ),
        (completion(json!({"temperature": 5})), "temperature"),
        // a suffix (fill-in-the-middle) with echo, or with token ids;
        // chat-only fields are unknown here
        (completion(json!({"suffix": "end", "echo": true})), "suffix"),
        (
            completion(json!({"suffix": "end", "prompt": [1, 2]})),
            "prompt",
        ),
        (completion(json!({"messages": []})), "messages"),
        (completion(json!({"tools": []})), "tools"),
        (completion(json!({"model": 3})), "model"),
    ];
    for (body, param) in cases {
        assert_refused("/v1/completions", body, param).await;
    }
}

#[tokio::test]
async fn unknown_model_on_completions_is_a_404() {
    let fake = FakeService::hello();
    let error = post_completion(app(fake.clone()), completion(json!({"model": "x"})))
        .await
        .error(StatusCode::NOT_FOUND);
    assert_eq!(error["code"], "model_not_found");
    assert_eq!(fake.request_count(), 0);
}

#[tokio::test]
async fn a_tool_message_must_answer_an_earlier_call() {
    let call = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]});
    let cases = [
        // No call at all, a call id nobody made, and an answer before its call.
        (
            vec![
                json!({"role": "user", "content": "hi"}),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "18C"}),
            ],
            "messages[1].tool_call_id",
        ),
        (
            vec![
                call.clone(),
                json!({"role": "tool", "tool_call_id": "call_2", "content": "18C"}),
            ],
            "messages[1].tool_call_id",
        ),
        (
            vec![
                json!({"role": "tool", "tool_call_id": "call_1", "content": "18C"}),
                call.clone(),
            ],
            "messages[0].tool_call_id",
        ),
    ];
    for (messages, param) in cases {
        let fake = FakeService::hello();
        let reply = post_json(app(fake.clone()), json!({"messages": messages})).await;
        let error = reply.error(StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], param, "{error}");
        assert_eq!(fake.request_count(), 0);
    }
    let fake = FakeService::hello();
    let reply = post_json(
        app(fake.clone()),
        json!({"messages": [call, {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
}

/// Issue 13 item 11: what current clients and the vLLM / llama-server
/// ecosystem send either works or is a 400 naming it.
#[tokio::test]
async fn ecosystem_fields_work_or_name_themselves() {
    // Accepted and carried to the engine.
    assert!(chat_with("stop", json!([])).await.stop.is_empty());
    assert!(chat_with("ignore_eos", json!(true)).await.ignore_eos);
    assert_eq!(chat_with("min_tokens", json!(3)).await.min_tokens, 3);
    let kwargs = chat_with("chat_template_kwargs", json!({"enable_thinking": false})).await;
    assert_eq!(
        Value::Object(kwargs.chat_template_kwargs),
        json!({"enable_thinking": false})
    );
    // Accepted, nothing stored or changed: the request is the plain one.
    let plain = chat_with("user", json!(null)).await;
    for (field, value) in [
        ("metadata", json!({"team": "a", "run": "7"})),
        ("store", json!(true)),
        ("store", json!(false)),
        ("prompt_cache_key", json!("session-1")),
        ("top_k", json!(0)),
    ] {
        assert_eq!(
            chat_with(field, value.clone()).await,
            plain,
            "{field}: {value}"
        );
    }
    let streamed = |options: Value| {
        let mut body = hello_request();
        body["stream"] = json!(true);
        body["stream_options"] = options;
        body
    };
    for options in [
        json!({"include_usage": true, "include_obfuscation": false}),
        json!({"include_obfuscation": true}),
        json!({"continuous_usage_stats": false}),
    ] {
        let reply = post_json(app(FakeService::hello()), streamed(options.clone())).await;
        assert_eq!(reply.status, StatusCode::OK, "{options}");
        assert!(!String::from_utf8_lossy(&reply.body).contains("obfuscation"));
    }
    // Completions take the vLLM sampling extras too.
    let fake = FakeService::hello();
    let body = completion(json!({"ignore_eos": true, "min_tokens": 2, "stop": []}));
    let reply = post_completion(app(fake.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json());
    let request = fake.last_request();
    assert!(request.ignore_eos && request.min_tokens == 2 && request.stop.is_empty());

    // Refused, each naming itself.
    let cases = [
        (
            chat(json!({"min_tokens": 20, "max_tokens": 10})),
            "min_tokens",
        ),
        (chat(json!({"min_tokens": -1})), "min_tokens"),
        (chat(json!({"ignore_eos": "yes"})), "ignore_eos"),
        (chat(json!({"store": "yes"})), "store"),
        (chat(json!({"prompt_cache_key": 7})), "prompt_cache_key"),
        (chat(json!({"metadata": {"k": 1}})), "metadata.k"),
        (
            chat(json!({"metadata": {"k": "v".repeat(513)}})),
            "metadata.k",
        ),
        (chat(json!({"metadata": [1]})), "metadata"),
        (
            chat(json!({"chat_template_kwargs": [1]})),
            "chat_template_kwargs",
        ),
        (
            chat(json!({"chat_template_kwargs": {"messages": []}})),
            "chat_template_kwargs.messages",
        ),
        (
            chat(json!({"stream": true, "stream_options": {"continuous_usage_stats": true}})),
            "stream_options.continuous_usage_stats",
        ),
        (
            chat(json!({"stream": true, "stream_options": {"include_obfuscation": 1}})),
            "stream_options.include_obfuscation",
        ),
    ];
    for (body, param) in cases {
        assert_refused("/v1/chat/completions", body, param).await;
    }
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    assert_refused(
        "/v1/chat/completions",
        chat(json!({"metadata": many})),
        "metadata",
    )
    .await;
    assert_refused(
        "/v1/completions",
        completion(json!({"min_tokens": 17})),
        "min_tokens",
    )
    .await;
}

/// `tool_choice` objects of other types than `function` (OpenAI's
/// `allowed_tools` and `custom`) are refused for their type, naming it, as
/// the Responses API does; not for a missing `function`.
#[tokio::test]
async fn other_tool_choice_types_are_refused_by_name() {
    let choices = [
        json!({"type": "allowed_tools", "allowed_tools": {"mode": "auto",
               "tools": [{"type": "function", "function": {"name": "f"}}]}}),
        json!({"type": "custom", "custom": {"name": "f"}}),
    ];
    for choice in choices {
        let kind = choice["type"].as_str().unwrap().to_owned();
        let body = chat(json!({"tools": [tool("f")], "tool_choice": choice}));
        let fake = FakeService::hello();
        let reply = post_raw_to(
            app(fake.clone()),
            "/v1/chat/completions",
            Some("application/json"),
            body.to_string(),
        )
        .await;
        let error = reply.error(StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], "tool_choice.type", "{error}");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("'{kind}'")) && message.contains("only 'function'"),
            "{message}"
        );
        assert_eq!(fake.request_count(), 0);
    }
    // A function choice still needs its function.
    assert_refused(
        "/v1/chat/completions",
        chat(json!({"tools": [tool("f")], "tool_choice": {"type": "function"}})),
        "tool_choice.function",
    )
    .await;
}
