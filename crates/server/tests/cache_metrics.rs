//! `/v1/cache/stats`, `/v1/cache/reset`, `/metrics` and `cache_prompt`,
//! against the fake engine.

mod common;

use axum::http::StatusCode;
use common::*;
use mlxcel_engine_api::{FailureKind, FinishReason, GenerationEvent};
use serde_json::json;

#[tokio::test]
async fn cache_stats_reports_the_pool_and_the_prefix_cache() {
    let reply = get(app(FakeService::hello()), "/v1/cache/stats").await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    assert_eq!(body["enabled"], true);
    assert_eq!(body["block_size"], 32);
    assert_eq!(body["kv_cache_dtype"], "int8");
    assert_eq!(body["capacity_tokens"], 100 * 32);
    assert_eq!(
        body["blocks"],
        json!({"total": 100, "used": 10, "free": 90, "cached": 8, "active": 2})
    );
    assert_eq!(body["entries"], 8);
    assert_eq!(body["bytes"], 8 * 1024);
    assert_eq!(body["capacity"], 100);
    assert_eq!(
        (&body["lookups"], &body["hits"], &body["misses"]),
        (&json!(4), &json!(3), &json!(1))
    );
    assert_eq!(body["hit_rate"], 0.75);
    assert_eq!(body["tokens_reused"], 256);
    assert_eq!(
        (&body["inserts"], &body["evictions"]),
        (&json!(9), &json!(1))
    );
}

#[tokio::test]
async fn cache_reset_says_what_it_freed() {
    let reply = post_raw_to(
        app(FakeService::hello()),
        "/v1/cache/reset",
        Some("application/json"),
        String::new(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    assert_eq!(body["object"], "cache.reset");
    assert_eq!(
        (&body["blocks_freed"], &body["bytes_freed"]),
        (&json!(3), &json!(3072))
    );
    assert_eq!(body["stats"]["entries"], 8);
    let reply = get(app(FakeService::hello()), "/v1/cache/reset").await;
    reply.error(StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn the_disk_tier_shows_in_stats_and_metrics_and_reset_can_keep_it() {
    let body = get(app(FakeService::hello()), "/v1/cache/stats")
        .await
        .json();
    assert_eq!(body["disk"]["blocks"], 5);
    assert_eq!(
        (
            &body["disk"]["hits"],
            &body["disk"]["skipped"],
            &body["disk"]["writable"]
        ),
        (&json!(4), &json!(2), &json!(true))
    );
    let text = String::from_utf8(
        get(app(FakeService::hello()), "/metrics")
            .await
            .body
            .to_vec(),
    )
    .unwrap();
    assert!(
        text.contains("mlxcel_prompt_cache_disk{what=\"bytes\"} 5500"),
        "{text}"
    );
    assert!(text.contains("mlxcel_prompt_cache_disk_events_total{event=\"skipped\"} 2"));
    let reset = |body: &str| {
        post_raw_to(
            app(FakeService::hello()),
            "/v1/cache/reset",
            Some("application/json"),
            body.to_string(),
        )
    };
    let all = reset("").await.json();
    assert_eq!(
        (&all["disk_blocks_freed"], &all["disk_bytes_freed"]),
        (&json!(2), &json!(8192))
    );
    let kept = reset(r#"{"keep_disk": true}"#).await.json();
    assert_eq!(kept["disk_blocks_freed"], 0);
    reset(r#"{"keep_disk": "yes"}"#)
        .await
        .error(StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn cache_prompt_false_reaches_the_engine_and_must_be_a_boolean() {
    let service = FakeService::hello();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "cache_prompt": false});
    let reply = post_json(app(service.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(!service.last_request().cache_prompt);
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    post_json(app(service.clone()), body).await;
    assert!(service.last_request().cache_prompt, "default true");
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "cache_prompt": "no"});
    let error = post_json(app(service), body)
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], "cache_prompt");
}

#[tokio::test]
async fn usage_reports_cached_tokens_and_metrics_count_them() {
    let app = app(FakeService::new(hello_script(FinishReason::Stop)));
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let reply = post_json(app.clone(), body).await;
    assert_eq!(
        reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        2
    );
    get(app.clone(), "/v1/models").await;
    get(app.clone(), "/nope").await;
    let reply = get(app.clone(), "/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = String::from_utf8(reply.body.to_vec()).unwrap();
    let has = |line: &str| {
        assert!(
            text.lines().any(|l| l == line),
            "missing `{line}` in:\n{text}"
        )
    };
    has(r#"mlxcel_http_requests_total{endpoint="/v1/chat/completions",status="200"} 1"#);
    has(r#"mlxcel_http_requests_total{endpoint="/v1/models",status="200"} 1"#);
    has(r#"mlxcel_http_requests_total{endpoint="unmatched",status="404"} 1"#);
    has("mlxcel_prompt_tokens_total 7");
    has("mlxcel_completion_tokens_total 3");
    has("mlxcel_prompt_cached_tokens_total 2");
    has("mlxcel_time_to_first_token_seconds_count 1");
    has("mlxcel_inter_token_latency_seconds_count 2");
    has(r#"mlxcel_request_duration_seconds_count{outcome="finished"} 1"#);
    has(r#"mlxcel_kv_blocks{state="cached"} 8"#);
    has(r#"mlxcel_prefix_cache_events_total{event="hit"} 3"#);
    has("mlxcel_prefix_cache_tokens_reused_total 256");
    has(r#"mlxcel_steps_total{kind="decode"} 45"#);
    has(r#"mlxcel_steps_total{kind="pipelined"} 7"#);
    has(r#"mlxcel_attention_rows_total{path="batched"} 80"#);
    has(r#"mlxcel_sequences{state="waiting"} 1"#);
    // Counters copied from the engine don't double on a second scrape.
    let again = String::from_utf8(get(app, "/metrics").await.body.to_vec()).unwrap();
    assert!(again
        .lines()
        .any(|l| l == r#"mlxcel_steps_total{kind="decode"} 45"#));
}

#[tokio::test]
async fn metrics_count_a_shared_prompt_once_over_n_choices() {
    let app = app(FakeService::hello());
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "n": 2});
    let reply = post_json(app.clone(), body).await;
    assert_eq!(reply.json()["usage"]["completion_tokens"], 6);
    let text = String::from_utf8(get(app, "/metrics").await.body.to_vec()).unwrap();
    for line in [
        "mlxcel_prompt_tokens_total 7",
        "mlxcel_prompt_cached_tokens_total 2",
        "mlxcel_completion_tokens_total 6",
        "mlxcel_time_to_first_token_seconds_count 1",
        // Two gaps within each choice's three deltas.
        "mlxcel_inter_token_latency_seconds_count 4",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing `{line}` in:\n{text}"
        );
    }
}

#[tokio::test]
async fn metrics_show_each_kv_group_and_failures_by_kind() {
    let app = app(FakeService::scripted(vec![
        vec![
            delta("Hel"),
            GenerationEvent::Failed {
                kind: FailureKind::OutOfMemory,
                message: "mlx: [malloc] Unable to allocate 4096 bytes".into(),
            },
        ],
        vec![GenerationEvent::Failed {
            kind: FailureKind::Model,
            message: "forward failed".into(),
        }],
    ]));
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let oom = post_json(app.clone(), body.clone()).await;
    let error = oom.error(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error["code"], "out_of_memory");
    let model = post_json(app.clone(), body).await;
    let error = model.error(StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(error["code"], "model");
    let text = String::from_utf8(get(app, "/metrics").await.body.to_vec()).unwrap();
    for line in [
        r#"mlxcel_request_failures_total{kind="out_of_memory"} 1"#,
        r#"mlxcel_request_failures_total{kind="model"} 1"#,
        r#"mlxcel_request_failures_total{kind="group_broken"} 0"#,
        r#"mlxcel_request_duration_seconds_count{outcome="failed"} 2"#,
        r#"mlxcel_kv_group_blocks{group="0",state="total",window="full"} 80"#,
        r#"mlxcel_kv_group_blocks{group="0",state="cached",window="full"} 8"#,
        r#"mlxcel_kv_group_blocks{group="1",state="total",window="512"} 20"#,
        r#"mlxcel_kv_group_blocks{group="1",state="free",window="512"} 18"#,
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing `{line}` in:\n{text}"
        );
    }
}
