//! `serve` on a real socket: it answers, and it shuts down gracefully, even
//! with a stream still open.

mod common;

use std::time::{Duration, Instant};

use common::*;
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

#[tokio::test]
async fn an_open_stream_holds_shutdown_only_for_the_grace_period() {
    let config = HttpConfig {
        shutdown_grace: Duration::from_millis(300),
        ..HttpConfig::default()
    };
    let fake = FakeService::holding_open(vec![delta("Hel")]);
    let (addr, stop, server) = start(fake.clone(), config).await;
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"stream":true}"#;
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut socket = TcpStream::connect(addr).await.unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = socket.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));

    let started = Instant::now();
    stop.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), server).await;
    result.unwrap().unwrap().unwrap();
    assert!(started.elapsed() >= Duration::from_millis(250));
}
