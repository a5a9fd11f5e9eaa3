//! `serve` on a real socket: it answers, and it shuts down gracefully: open
//! requests finish within the grace period, or fail with an error at its end.

mod common;

use std::time::{Duration, Instant};

use common::*;
use mlxcel_engine_api::{FailureKind, FinishReason};
use mlxcel_http::{serve, AppState, HttpConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

async fn start(
    fake: std::sync::Arc<FakeService>,
    config: HttpConfig,
) -> (
    std::net::SocketAddr,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let state = AppState::with_config(fake, config);
    let server = tokio::spawn(serve(listener, state, async move {
        let _ = stop_rx.await;
    }));
    (addr, stop_tx, server)
}

#[tokio::test]
async fn answers_then_shuts_down() {
    let (addr, stop, server) = start(FakeService::hello(), HttpConfig::default()).await;
    let mut socket = TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with(r#"{"status":"ok"}"#), "{response}");

    stop.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), server).await;
    result.unwrap().unwrap().unwrap();
}

/// Sends `body` to `/v1/chat/completions` on a new connection.
async fn post_chat(addr: std::net::SocketAddr, body: &str) -> TcpStream {
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut socket = TcpStream::connect(addr).await.unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    socket
}

#[tokio::test]
async fn an_open_stream_holds_shutdown_only_for_the_grace_period_then_gets_an_error() {
    let config = HttpConfig {
        shutdown_grace: Duration::from_millis(300),
        ..HttpConfig::default()
    };
    let fake = FakeService::holding_open(vec![delta("Hel")]);
    let (addr, stop, server) = start(fake.clone(), config).await;
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"stream":true}"#;
    let mut socket = post_chat(addr, body).await;
    let mut buf = vec![0u8; 4096];
    let n = socket.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");

    let started = Instant::now();
    stop.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), server).await;
    result.unwrap().unwrap().unwrap();
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(250), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");

    // The stream ended with the OpenAI error body, then the connection.
    let mut rest = Vec::new();
    socket.read_to_end(&mut rest).await.unwrap();
    let rest = String::from_utf8_lossy(&rest);
    let stream = format!("{head}{rest}");
    assert!(stream.contains(r#""content":"Hel""#), "{stream}");
    assert!(
        stream.contains(mlxcel_http::shutdown::SHUTDOWN_MESSAGE),
        "{stream}"
    );
    assert!(stream.contains(r#""type":"server_error""#), "{stream}");
}

#[tokio::test]
async fn an_open_request_gets_an_error_body_at_the_deadline() {
    let config = HttpConfig {
        shutdown_grace: Duration::from_millis(200),
        ..HttpConfig::default()
    };
    let fake = FakeService::holding_open(vec![delta("Hel")]);
    let (addr, stop, server) = start(fake.clone(), config).await;
    let body = r#"{"messages":[{"role":"user","content":"Hi"}]}"#;
    let mut socket = post_chat(addr, body).await;
    // The request is in the engine before the signal.
    while fake.request_count() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), server).await;
    result.unwrap().unwrap().unwrap();
    let mut response = Vec::new();
    socket.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 500"), "{response}");
    assert!(
        response.contains(mlxcel_http::shutdown::SHUTDOWN_MESSAGE),
        "{response}"
    );
}

#[tokio::test]
async fn a_request_that_ends_within_the_grace_period_is_answered() {
    let config = HttpConfig {
        shutdown_grace: Duration::from_secs(5),
        ..HttpConfig::default()
    };
    let fake = FakeService::holding_open(vec![delta("Hel")]);
    let (addr, stop, server) = start(fake.clone(), config).await;
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"stream":true}"#;
    let mut socket = post_chat(addr, body).await;
    let mut buf = vec![0u8; 4096];
    let n = socket.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    stop.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The engine finishes the request while the server drains.
    for sender in fake.senders.lock().unwrap().drain(..) {
        sender.send(finished(FinishReason::Stop)).unwrap();
    }
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(5), server).await;
    result.unwrap().unwrap().unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    let mut rest = Vec::new();
    socket.read_to_end(&mut rest).await.unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains(r#""finish_reason":"stop""#), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert!(!rest.contains("shutting down"), "{rest}");
}

#[test]
fn requests_after_the_signal_are_refused_and_open_ones_fail_at_the_deadline() {
    use mlxcel_engine_api::{
        GenerationEvent, GenerationRequest, InferenceService, Prompt, SamplingParams, SubmitError,
    };
    use mlxcel_http::shutdown::{DrainingService, Phase, REFUSED_MESSAGE, SHUTDOWN_MESSAGE};
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _inside = runtime.enter();
    let (phase, phase_rx) = tokio::sync::watch::channel(Phase::Serving);
    let fake = FakeService::holding_open(vec![delta("Hel")]);
    let service = DrainingService::new(fake.clone(), phase_rx);
    let request =
        || GenerationRequest::new(Prompt::Text("Hi".into()), SamplingParams::default(), 8);
    let mut open = service.submit(request()).unwrap();
    phase.send_replace(Phase::Draining);
    match service.submit(request()) {
        Err(SubmitError::Unavailable(message)) => assert_eq!(message, REFUSED_MESSAGE),
        other => panic!("{other:?}"),
    }
    assert_eq!(fake.request_count(), 1);
    phase.send_replace(Phase::Expired);
    runtime.block_on(async {
        assert!(matches!(
            open.recv().await,
            Some(GenerationEvent::Delta { .. })
        ));
        match open.recv().await {
            Some(GenerationEvent::Failed { kind, message }) => {
                assert_eq!(kind, FailureKind::Shutdown);
                assert_eq!(message, SHUTDOWN_MESSAGE)
            }
            other => panic!("{other:?}"),
        }
        assert!(open.recv().await.is_none());
    });
}
