//! Tensor-parallel serving (docs/distributed.md) on this CPU, over the
//! `ring` backend on loopback, against the single-process server as the
//! peer: the same greedy replies for the chat goldens' prompts, sent one
//! by one and all at once (the batching differential), and for a request
//! of two choices (forked sequences, copy-on-write blocks); a rank killed
//! mid-request makes rank 0 answer an error and report unhealthy, and so
//! does a rank that stops answering (the collective timeout).
//!
//! The model is `target/tiny-models/llama_chat` (`scripts/setup.sh`): a
//! random-weight Llama of mlx_lm's class with SmolLM2's tokenizer and 4
//! query / 2 K/V heads, so it splits over 2 ranks (SmolLM2's 9 and 3 do not).

mod common;

use common::goldens;
use common::http::{get, post_json};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MAX_TOKENS: usize = 16;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tiny_model() -> PathBuf {
    let dir = common::tiny_models_root().join("llama_chat");
    assert!(
        dir.join("tokenizer.json").exists(),
        "{} missing: run scripts/setup.sh",
        dir.display()
    );
    dir
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Processes of one test (a server, its ranks, or mlx.launch), killed
/// when the test ends; rank 0's log is read for its port and readiness.
struct Group {
    children: Vec<Child>,
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl Drop for Group {
    fn drop(&mut self) {
        for c in &mut self.children {
            // Each child leads its own process group: mlx.launch's ranks go
            // with it.
            if let Ok(pid) = libc::pid_t::try_from(c.id()) {
                // SAFETY: signals the process group of our own child.
                unsafe { libc::killpg(pid, libc::SIGKILL) };
            }
            let _ = c.wait();
        }
    }
}

impl Group {
    /// Spawns `commands` (the first one logs to a pipe read here, the
    /// others to null) and waits until the first says it is ready.
    fn spawn(commands: Vec<Command>) -> Group {
        let mut children = Vec::new();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        for (i, mut command) in commands.into_iter().enumerate() {
            std::os::unix::process::CommandExt::process_group(&mut command, 0);
            command.env("RUST_LOG", "info").stdout(Stdio::null());
            command.stderr(if i == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            });
            let mut child = command.spawn().expect("spawn");
            if let Some(stderr) = child.stderr.take() {
                let sink = Arc::clone(&log);
                let port_tx = port_tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stderr).lines() {
                        let Ok(line) = line else { break };
                        if let Some(addr) = line.split("listening on http://").nth(1) {
                            let port = addr.trim().rsplit(':').next().and_then(|p| p.parse().ok());
                            let _ = port_tx.send(port);
                        }
                        let ready = line.contains("ready: serving requests");
                        sink.lock().unwrap().push(line);
                        if ready {
                            let _ = port_tx.send(None);
                        }
                    }
                });
            }
            children.push(child);
        }
        let mut group = Group {
            children,
            port: 0,
            log,
        };
        loop {
            match port_rx.recv_timeout(Duration::from_secs(120)) {
                Ok(Some(port)) => group.port = port,
                Ok(None) => break,
                Err(_) => panic!("not ready:\n{}", group.log_text()),
            }
        }
        group
    }

    fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

fn server(extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlxcel-server"));
    c.args(["-m", tiny_model().to_str().expect("utf-8")])
        .args(["--port", "0", "--parallel", "4"])
        .args(extra);
    c
}

/// Two ranks as `mlx.launch --backend ring -n 2` starts them on one host,
/// but spawned here, so that a test can kill or stop rank 1 alone.
fn two_ranks(extra: &[&str]) -> Group {
    let dir =
        std::env::temp_dir().join(format!("mlxcel-tp-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let hostfile = dir.join("hosts.json");
    let hosts = format!(
        r#"[["127.0.0.1:{}"],["127.0.0.1:{}"]]"#,
        free_port(),
        free_port()
    );
    std::fs::write(&hostfile, hosts).expect("hostfile");
    let ranks = (0..2)
        .map(|rank| {
            let mut c = server(&["--tensor-parallel", "--distributed-backend", "ring"]);
            c.args(extra)
                .env("MLX_RANK", rank.to_string())
                .env("MLX_HOSTFILE", &hostfile);
            c
        })
        .collect();
    Group::spawn(ranks)
}

fn chat(messages: &[(String, String)], n: usize) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    json!({
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "n": n,
    })
}

/// Each choice's text.
fn texts(port: u16, body: &Value) -> Vec<String> {
    let r = post_json(port, "/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap_or("").to_owned())
        .collect()
}

#[test]
fn two_ranks_under_mlx_launch_answer_as_one_process() {
    let prompts: Vec<Vec<(String, String)>> =
        goldens().into_iter().take(4).map(|g| g.messages).collect();
    let single = Group::spawn(vec![server(&[])]);
    let expected: Vec<String> = prompts
        .iter()
        .map(|m| texts(single.port, &chat(m, 1)).remove(0))
        .collect();
    drop(single);
    let mut launch = Command::new(repo().join(".venv/bin/mlx.launch"));
    launch
        .args(["--backend", "ring", "-n", "2", "--starting-port"])
        .arg(free_port().to_string())
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_mlxcel-server"))
        .args(["-m", tiny_model().to_str().expect("utf-8")])
        .args(["--port", "0", "--parallel", "4", "--tensor-parallel"]);
    let tp = Group::spawn(vec![launch]);
    assert!(
        tp.log_text()
            .contains("joined the tensor-parallel group rank=0 ranks=2"),
        "{}",
        tp.log_text()
    );
    // One by one.
    for (m, want) in prompts.iter().zip(&expected) {
        assert_eq!(&texts(tp.port, &chat(m, 1)).remove(0), want);
    }
    // Again, from the prefix cache.
    let again = post_json(tp.port, "/v1/chat/completions", &chat(&prompts[0], 1)).json();
    assert_eq!(
        again["choices"][0]["message"]["content"],
        expected[0].as_str()
    );
    let cached = &again["usage"]["prompt_tokens_details"]["cached_tokens"];
    assert!(cached.as_u64().is_some_and(|c| c > 0), "{again}");
    // All at once: rows of different lengths batched in one step.
    let port = tp.port;
    let handles: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|m| std::thread::spawn(move || texts(port, &chat(&m, 1)).remove(0)))
        .collect();
    let together: Vec<String> = handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .collect();
    assert_eq!(together, expected);
    // Two choices share the prompt's blocks; each copies the partial one.
    assert_eq!(
        texts(tp.port, &chat(&prompts[0], 2)),
        vec![expected[0].clone(); 2]
    );
}

/// Starts a streamed chat that runs until `max_tokens` and returns the
/// stream after its first delta.
fn start_long_stream(port: u16) -> (TcpStream, Vec<u8>) {
    let body = json!({
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 1500,
        "temperature": 0,
        "stream": true,
        // EOS (<|endoftext|>, <|im_end|>) never wins: it runs to the end.
        "logit_bias": {"0": -100, "2": -100},
    })
    .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"content\":") {
        let n = s.read(&mut buf).expect("read the first delta");
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    (s, seen)
}

/// Reads the rest of the stream (bounded by the socket timeout: a hang
/// fails the test) and checks that it ends with an error event; then that
/// `/health` says unhealthy and new requests get 503.
fn expect_error_then_unhealthy(group: &Group, mut stream: TcpStream, mut seen: Vec<u8>, why: &str) {
    stream
        .read_to_end(&mut seen)
        .unwrap_or_else(|e| panic!("the stream hung ({e}):\n{}", group.log_text()));
    let text = String::from_utf8_lossy(&seen);
    assert!(text.contains("\"error\""), "no error event:\n{text}");
    assert!(text.contains(why), "error does not say {why:?}:\n{text}");
    assert!(!text.contains("\"finish_reason\":\"length\""), "{text}");
    let health = get(group.port, "/health");
    assert_eq!(health.status, 503);
    assert_eq!(health.json(), json!({"status": "unhealthy"}));
    let refused = post_json(
        group.port,
        "/v1/chat/completions",
        &chat(&[("user".into(), "Hi".into())], 1),
    );
    assert_eq!(
        refused.status,
        503,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
}

/// A killed rank fails the request in flight with a `group_broken` error,
/// never a hang: its closed connection fails the collective ("tensor
/// parallelism: a step failed"), or, when the kill lands while MLX's ring
/// backend waits in a way that does not see the close, the watchdog ends
/// the step ("did not finish in 10 s (--tensor-parallel-timeout)"; seen
/// once in a clean-clone run, with the default 60 s).
#[test]
fn a_rank_killed_mid_request_fails_it_with_an_error() {
    let mut group = two_ranks(&["--tensor-parallel-timeout", "10"]);
    let (stream, seen) = start_long_stream(group.port);
    group.children[1].kill().expect("kill rank 1");
    expect_error_then_unhealthy(&group, stream, seen, "\"code\":\"group_broken\"");
}

#[test]
fn a_rank_that_stops_answering_trips_the_timeout() {
    let group = two_ranks(&["--tensor-parallel-timeout", "2"]);
    let (stream, seen) = start_long_stream(group.port);
    let pid = libc::pid_t::try_from(group.children[1].id()).expect("pid");
    // SAFETY: stops our own child process (it is killed on drop).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    expect_error_then_unhealthy(&group, stream, seen, "--tensor-parallel-timeout");
}
