//! The `mlxcel-server` process as a service manager sees it: it stops on
//! SIGTERM (open requests drained, bounded by `--shutdown-timeout`) and
//! exits with status 0 right after.

mod common;

use common::http::post_json;
use common::model_dir;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running server; killed if a test ends without stopping it.
struct Server {
    child: Child,
    port: u16,
    /// Every log line so far.
    log: Arc<Mutex<Vec<String>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `mlxcel-server` on the test model and a free port with
    /// `extra` flags; returns once it is ready.
    fn start(extra: &[&str]) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_mlxcel-server"));
        command
            .args(["-m", model_dir().to_str().expect("utf-8 path")])
            .args(["--port", "0"]);
        Self::spawn(command.args(extra))
    }

    /// Spawns `command` (the binary and its flags) and waits until it is
    /// ready.
    fn spawn(command: &mut Command) -> Server {
        let mut child = command
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn mlxcel-server");
        let stderr = child.stderr.take().expect("stderr");
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&log);
        // Keeps reading the log, so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let port = line.split("listening on http://").nth(1).map(|addr| {
                    addr.trim()
                        .rsplit(':')
                        .next()
                        .and_then(|p| p.parse::<u16>().ok())
                });
                let ready = line.contains("ready: serving requests");
                // Logged before it is announced: a test that reads the log
                // once the server is ready finds the ready line in it.
                sink.lock().unwrap().push(line);
                if let Some(port) = port {
                    let _ = port_tx.send(port);
                }
                if ready {
                    let _ = port_tx.send(None);
                }
            }
        });
        let mut server = Server {
            child,
            port: 0,
            log,
        };
        let deadline = Duration::from_secs(120);
        loop {
            match port_rx.recv_timeout(deadline) {
                Ok(Some(port)) => server.port = port,
                Ok(None) => break,
                Err(_) => panic!("server not ready:\n{}", server.log_text()),
            }
        }
        assert_ne!(server.port, 0, "{}", server.log_text());
        server
    }

    fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid");
        // SAFETY: sends a signal to our own child process.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// Waits at most `limit` for the process to exit.
    fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

/// A chat request that never meets EOS (`<|im_end|>` and
/// `<|endoftext|>` forbidden), so it runs to `max_tokens`.
fn endless_chat(max_tokens: usize, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "logit_bias": {"0": -100, "2": -100},
        "stream": stream,
    })
}

/// A streamed request on its own connection, read as it arrives.
struct OpenStream {
    reader: BufReader<TcpStream>,
}

impl OpenStream {
    /// Sends `body` (a streamed chat) and returns once its first content
    /// chunk arrived, so the request is being generated.
    fn start(port: u16, body: &Value) -> OpenStream {
        let mut socket = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        socket
            .set_read_timeout(Some(Duration::from_secs(120)))
            .expect("timeout");
        let body = body.to_string();
        write!(
            socket,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("write");
        let mut reader = BufReader::new(socket);
        let mut line = String::new();
        loop {
            line.clear();
            assert_ne!(reader.read_line(&mut line).expect("read"), 0, "closed");
            let chunk = line
                .strip_prefix("data: ")
                .and_then(|data| serde_json::from_str::<Value>(data).ok());
            let text = chunk
                .as_ref()
                .and_then(|c| c["choices"][0]["delta"]["content"].as_str());
            if text.is_some_and(|t| !t.is_empty()) {
                return OpenStream { reader };
            }
        }
    }

    /// The rest of the stream, to the end of the connection.
    fn rest(mut self) -> String {
        let mut rest = Vec::new();
        self.reader.read_to_end(&mut rest).expect("read");
        String::from_utf8_lossy(&rest).into_owned()
    }
}

/// The issue's scenario: a server that served concurrent requests stops on
/// SIGTERM. The stream open at the signal runs to its end (drain), then
/// the process exits with status 0 at once.
#[test]
fn sigterm_drains_open_requests_and_exits_zero() {
    let mut server = Server::start(&["--parallel", "4"]);
    let port = server.port;
    let served: Vec<_> = (0..6)
        .map(|i| {
            std::thread::spawn(move || {
                let body = json!({
                    "messages": [{"role": "user", "content": format!("Say the number {i}.")}],
                    "max_tokens": 8,
                });
                post_json(port, "/v1/chat/completions", &body)
            })
        })
        .collect();
    for request in served {
        let response = request.join().expect("client thread");
        assert_eq!(response.status, 200);
        assert_eq!(response.json()["object"], "chat.completion");
    }

    let open = OpenStream::start(port, &endless_chat(40, true));
    let signalled = Instant::now();
    server.signal(libc::SIGTERM);
    let rest = open.rest();
    let drained = Instant::now();
    // The stream ran to max_tokens, untouched by the shutdown.
    assert!(rest.contains(r#""finish_reason":"length""#), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert!(!rest.contains("error"), "{rest}");

    let status = server.wait_exit(Duration::from_secs(5));
    let exited = drained.elapsed();
    let status = status
        .unwrap_or_else(|| panic!("still running 5 s after the drain:\n{}", server.log_text()));
    assert_eq!(status.code(), Some(0), "{}", server.log_text());
    eprintln!(
        "SIGTERM to exit: {:?} (drain {:?}, exit after the drain {exited:?})",
        signalled.elapsed(),
        drained - signalled
    );
    // "within a second" after the drain, with room for a loaded machine.
    assert!(exited < Duration::from_secs(3), "{exited:?}");
    let log = server.log_text();
    assert!(log.contains("SIGTERM received"), "{log}");
    assert!(log.contains("server stopped"), "{log}");
}

/// A request still open when `--shutdown-timeout` passes ends with an
/// error, and the process still exits with status 0.
#[test]
fn requests_outliving_the_shutdown_timeout_get_an_error() {
    let mut server = Server::start(&["--shutdown-timeout", "1"]);
    let open = OpenStream::start(server.port, &endless_chat(4000, true));
    let signalled = Instant::now();
    server.signal(libc::SIGTERM);
    let rest = open.rest();
    let cut = signalled.elapsed();
    assert!(
        rest.contains(mlxcel_http::shutdown::SHUTDOWN_MESSAGE),
        "{rest}"
    );
    assert!(!rest.contains("finish_reason\":\"length"), "{rest}");
    assert!(cut >= Duration::from_millis(900), "{cut:?}");
    assert!(cut < Duration::from_secs(4), "{cut:?}");
    let status = server
        .wait_exit(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("still running:\n{}", server.log_text()));
    assert_eq!(status.code(), Some(0), "{}", server.log_text());
    eprintln!(
        "SIGTERM to exit with a 1 s timeout: {:?}",
        signalled.elapsed()
    );
}

/// A second signal ends the process at once (status 1), without waiting
/// for the open request; SIGINT (Ctrl-C) stops it like SIGTERM.
#[test]
fn a_second_signal_exits_at_once() {
    let mut server = Server::start(&[]);
    let open = OpenStream::start(server.port, &endless_chat(4000, true));
    server.signal(libc::SIGINT);
    std::thread::sleep(Duration::from_millis(300));
    assert!(server.child.try_wait().expect("try_wait").is_none());
    let signalled = Instant::now();
    server.signal(libc::SIGINT);
    let status = server
        .wait_exit(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("still running:\n{}", server.log_text()));
    assert_eq!(status.code(), Some(1), "{}", server.log_text());
    assert!(signalled.elapsed() < Duration::from_secs(2));
    let log = server.log_text();
    assert!(log.contains("SIGINT received"), "{log}");
    assert!(log.contains("second signal"), "{log}");
    drop(open);
}

/// `--config FILE` sets flags, the command line wins over it, and an
/// unknown key stops the server before it starts, naming the key and line.
#[test]
fn a_config_file_sets_flags_and_the_command_line_wins() {
    let dir = std::env::temp_dir().join(format!("mlxcel-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("server.toml");
    let model = model_dir();
    std::fs::write(
        &file,
        format!(
            "# test configuration\nmodel = {:?}\nport = 0\nalias = \"from-config\"\n\
             default-max-tokens = 5\nparallel = 2\n",
            model.to_str().expect("utf-8 path")
        ),
    )
    .expect("write config");
    let mut command = Command::new(env!("CARGO_BIN_EXE_mlxcel-server"));
    command
        .arg("--config")
        .arg(&file)
        .args(["--default-max-tokens", "3"]);
    let server = Server::spawn(&mut command);
    check_ready_line(&server, "from-config");
    let models = common::http::get(server.port, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "from-config", "{models}");
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"2": -100}});
    let chat = post_json(server.port, "/v1/chat/completions", &body);
    assert_eq!(chat.status, 200);
    let chat = chat.json();
    // 3 from the command line, not the file's 5.
    assert_eq!(chat["usage"]["completion_tokens"], 3, "{chat}");
    assert_eq!(chat["choices"][0]["finish_reason"], "length");
    assert_eq!(chat["model"], "from-config");
    drop(server);

    std::fs::write(&file, "port = 0\n\nkv-cache-bugdet = \"1G\"\n").expect("write config");
    let out = Command::new(env!("CARGO_BIN_EXE_mlxcel-server"))
        .arg("--config")
        .arg(&file)
        .output()
        .expect("run mlxcel-server");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr.trim(),
        format!(
            "error: {}:3: unknown key `kv-cache-bugdet`: not a flag of mlxcel-server",
            file.display()
        )
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--version` of both binaries: the version, the commit `build.rs`
/// recorded (the checkout's `HEAD`), the MLX version and the device.
#[test]
fn version_names_the_commit_the_mlx_version_and_the_device() {
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    let commit = env!("MLXCEL_GIT_COMMIT");
    if let Some(head) = &head {
        assert_eq!(commit, head);
    }
    let device = if mlxcel_mlx::gpu_available() {
        "gpu"
    } else {
        "cpu"
    };
    for (binary, name) in [
        (env!("CARGO_BIN_EXE_mlxcel"), "mlxcel"),
        (env!("CARGO_BIN_EXE_mlxcel-server"), "mlxcel-server"),
    ] {
        let out = Command::new(binary).arg("--version").output().expect("run");
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(lines[0], format!("{name} {}", env!("CARGO_PKG_VERSION")));
        assert_eq!(lines[1], format!("commit: {commit}"));
        assert_eq!(lines[2], format!("mlx: {}", mlxcel_mlx::version()));
        let named = mlxcel_mlx::device_name(device == "gpu").expect("device name");
        assert_eq!(lines[3], format!("device: {device}, {named}"));

        let out = Command::new(binary).arg("-V").output().expect("run");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("{name} {} (commit {commit})", env!("CARGO_PKG_VERSION"))
        );
    }
}

/// The ready line names the address, the model, the device and the KV
/// cache's size, as `/v1/cache/stats` and MLX report them.
fn check_ready_line(server: &Server, model: &str) {
    let log = server.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("ready: serving requests"))
        .expect("ready line");
    let stats = common::http::get(server.port, "/v1/cache/stats").json();
    let total = stats["blocks"]["total"].as_u64().expect("blocks.total");
    let tokens = total * stats["block_size"].as_u64().expect("block_size");
    let bytes = total * stats["block_bytes"].as_u64().expect("block_bytes");
    assert!(tokens > 0, "{stats}");
    assert_eq!(stats["capacity_tokens"], tokens, "{stats}");
    let kv_dtype = stats["kv_cache_dtype"].as_str().expect("kv_cache_dtype");
    let gpu = mlxcel_mlx::gpu_available();
    let device = format!(
        "device={}, {}",
        if gpu { "gpu" } else { "cpu" },
        mlxcel_mlx::device_name(gpu).expect("device name")
    );
    for field in [
        format!("address=http://127.0.0.1:{}", server.port),
        format!("model=\"{model}\""),
        device,
        format!("kv_tokens={tokens}"),
        format!("kv_bytes={bytes}"),
        format!("kv_dtype={kv_dtype}"),
    ] {
        assert!(line.contains(&field), "{field} not in {line}");
    }
}

/// SIGTERM as soon as the server listens, while the model still loads:
/// the handlers are in place before the listener, and the process exits
/// with status 0 without waiting for the load.
#[test]
fn sigterm_while_loading_exits_zero() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlxcel-server"))
        .args(["-m", model_dir().to_str().expect("utf-8 path")])
        .args(["--port", "0"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn mlxcel-server");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut log = Vec::new();
    loop {
        let line = lines.next().expect("log line").expect("read");
        let listening = line.contains("listening on http://");
        log.push(line);
        if listening {
            break;
        }
    }
    let pid = libc::pid_t::try_from(child.id()).expect("pid");
    // SAFETY: sends a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let signalled = Instant::now();
    log.extend(lines.map_while(Result::ok));
    let status = child.wait().expect("wait");
    let log = log.join("\n");
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(signalled.elapsed() < Duration::from_secs(5), "{log}");
    assert!(log.contains("SIGTERM received"), "{log}");
    assert!(!log.contains("ready: serving requests"), "{log}");
}

/// SmolLM2's own template, with a reasoning model's generation prompt:
/// the reply opens inside `<think>`, or (`enable_thinking: false`, as
/// Qwen3's template does) after an empty block.
const THINK_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n\
{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\
{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n\
{% else %}<think>\n{% endif %}{% endif %}";

/// `--reasoning-parser auto` on a template that writes `<think>`: a reply
/// generated inside the block is `reasoning_content` (streamed or not),
/// exactly the text a plain completion of the same prompt generates; with
/// thinking off the reply is content. SmolLM2 does not write `</think>`
/// (checked), so the first reply is reasoning to its end.
#[test]
fn a_think_block_is_returned_as_reasoning_content() {
    let dir = std::env::temp_dir().join(format!("mlxcel-think-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let template = dir.join("think.jinja");
    std::fs::write(&template, THINK_TEMPLATE).expect("template");
    let server = Server::start(&["--chat-template", template.to_str().expect("utf-8")]);
    let messages = json!([{"role": "user", "content": "What is 2 + 2?"}]);
    let chat = |extra: Value| -> Value {
        let mut body = json!({"messages": messages, "max_tokens": 12, "temperature": 0});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = post_json(server.port, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        r.json()
    };
    let completion = |prompt: &str| -> String {
        let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0});
        let r = post_json(server.port, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        r.json()["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_owned()
    };
    let prompt = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n";

    let thinking = chat(json!({}));
    let message = &thinking["choices"][0]["message"];
    let raw = completion(&format!("{prompt}<think>\n"));
    assert!(
        !raw.contains("</think>"),
        "the golden assumes no end tag: {raw:?}"
    );
    assert_eq!(
        message["reasoning_content"],
        json!(raw.trim()),
        "{thinking}"
    );
    assert_eq!(message["content"], Value::Null, "{thinking}");
    eprintln!("reasoning: {}", message["reasoning_content"]);

    // Streamed: the same reasoning in `reasoning_content` deltas, no text.
    let body = json!({"messages": messages, "max_tokens": 12, "temperature": 0, "stream": true});
    let r = post_json(server.port, "/v1/chat/completions", &body);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for line in String::from_utf8_lossy(&r.body).lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).expect("chunk");
        let delta = &chunk["choices"][0]["delta"];
        reasoning += delta["reasoning_content"].as_str().unwrap_or("");
        content += delta["content"].as_str().unwrap_or("");
    }
    assert_eq!(reasoning, raw.trim());
    assert_eq!(content, "", "only the role chunk's empty content");

    // Thinking off: the template closes the block; the reply is content.
    let plain = chat(json!({"chat_template_kwargs": {"enable_thinking": false}}));
    let message = &plain["choices"][0]["message"];
    assert_eq!(message.get("reasoning_content"), None, "{plain}");
    let raw = completion(&format!("{prompt}<think>\n\n</think>\n\n"));
    assert_eq!(message["content"], json!(raw), "{plain}");
    std::fs::remove_dir_all(&dir).ok();
}
