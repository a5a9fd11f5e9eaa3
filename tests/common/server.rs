//! The real `mlxcel-server` binary on a free port, for the end-to-end
//! tests that drive it over HTTP.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A running server; killed when dropped.
pub struct Server {
    child: Child,
    /// The port it listens on (127.0.0.1).
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the server on `model` (a checkpoint directory or a GGUF file),
/// served as `alias`, with `extra` flags, and returns once it logged
/// "ready"; `on_listening` runs with the port as soon as the server listens
/// (the model may still be loading then).
pub fn start(model: &Path, alias: &str, extra: &[&str], on_listening: impl FnOnce(u16)) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlxcel-server"))
        .args(["-m", model.to_str().expect("utf-8 path")])
        .args(["--port", "0", "--alias", alias])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn mlxcel-server");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let mut next_line = || {
        lines
            .next()
            .expect("server exited before it was ready")
            .expect("read stderr")
    };
    let port = loop {
        let line = next_line();
        if let Some(addr) = line.split("listening on http://").nth(1) {
            break addr
                .trim()
                .rsplit(':')
                .next()
                .and_then(|p| p.parse::<u16>().ok())
                .expect("port");
        }
    };
    on_listening(port);
    while !next_line().contains("ready: serving requests") {}
    // Keep draining the log so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Server { child, port }
}
