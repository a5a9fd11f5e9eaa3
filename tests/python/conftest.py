"""Shared fixtures of the Python API tests: one real mlxcel server per session.

The server binary comes from ``MLXCEL_SERVER_BIN`` (default
``target/release/mlxcel-server``) and the model from ``MLXCEL_TEST_MODEL``
(default ``models/SmolLM2-135M-Instruct``); both are resolved against the
repository root. A missing binary or model is a failure, not a skip.

The server listens on a free port (``--port 0``; the address is read from its
``listening on`` log line), requires a random API key, and generates at most
``DEFAULT_MAX_TOKENS`` tokens for requests that do not say otherwise, so
tests stay fast on a CPU.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MAX_TOKENS = 4
STARTUP_TIMEOUT_S = 180.0
SHUTDOWN_TIMEOUT_S = 20.0
LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass(frozen=True)
class MlxcelServer:
    """A running server: where it is, its key and the model it serves."""

    base_url: str
    """``http://127.0.0.1:<port>``, without a trailing slash."""
    api_key: str
    """The ``--api-key`` it requires (``Authorization: Bearer <api_key>``)."""
    model: str
    """The served model id (``GET /v1/models``)."""
    log_path: Path
    """The server's stderr log."""
    model_dir: Path
    """The checkpoint it serves (for peers such as mlx_lm to load)."""

    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header the server requires."""
        return {"Authorization": f"Bearer {self.api_key}"}


def _path_from_env(name: str, default: str) -> Path:
    path = Path(os.environ.get(name) or default)
    return path if path.is_absolute() else REPO / path


def _get_json(url: str, headers: dict[str, str], timeout: float = 5.0) -> dict:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def _wait_until_listening(
    process: subprocess.Popen, log_path: Path, deadline: float
) -> str:
    """Copies the server's stderr to ``log_path`` and returns its address."""
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert process.stderr is not None
        with log_path.open("w", encoding="utf-8", errors="replace") as log:
            for line in process.stderr:
                log.write(line)
                log.flush()
                match = LISTENING.search(line)
                if match and not found:
                    found.append(match.group(1))
                    ready.set()
        ready.set()

    threading.Thread(target=pump, name="mlxcel-server-log", daemon=True).start()
    ready.wait(timeout=max(0.0, deadline - time.monotonic()))
    if not found:
        log = log_path.read_text(encoding="utf-8", errors="replace")
        pytest.fail(f"mlxcel-server did not start listening; its log:\n{log[-4000:]}")
    return found[0]


def _wait_for_health(base_url: str, deadline: float) -> None:
    while True:
        try:
            if _get_json(f"{base_url}/health", {}).get("status") == "ok":
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{base_url}/health never answered ok")
        time.sleep(0.2)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def mlxcel_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlxcelServer]:
    """Starts ``mlxcel-server`` once per test session and stops it after."""
    binary = _path_from_env("MLXCEL_SERVER_BIN", "target/release/mlxcel-server")
    model = _path_from_env("MLXCEL_TEST_MODEL", "models/SmolLM2-135M-Instruct")
    if not binary.is_file():
        pytest.fail(f"no server binary at {binary}: cargo build --release --bin mlxcel-server")
    if not model.is_dir():
        pytest.fail(f"no test model at {model}: run scripts/setup.sh")
    api_key = "sk-mlxcel-test-" + secrets.token_hex(16)
    log_path = tmp_path_factory.mktemp("mlxcel-server") / "server.log"
    command = [
        str(binary),
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", "0",
        "--api-key", api_key,
        "--default-max-tokens", str(DEFAULT_MAX_TOKENS),
        # /v1/embeddings answers 200 too (Schemathesis checks its schema).
        "--embeddings",
    ]
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")}
    env.pop("MLXCEL_API_KEY", None)
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        base_url = _wait_until_listening(process, log_path, deadline).rstrip("/")
        _wait_for_health(base_url, deadline)
        headers = {"Authorization": f"Bearer {api_key}"}
        served = _get_json(f"{base_url}/v1/models", headers)["data"][0]["id"]
        yield MlxcelServer(
            base_url=base_url, api_key=api_key, model=served, log_path=log_path, model_dir=model
        )
    finally:
        _stop(process)


@pytest.fixture(scope="session")
def base_url(mlxcel_server: MlxcelServer) -> str:
    """The running server's ``http://host:port``."""
    return mlxcel_server.base_url


@pytest.fixture(scope="session")
def api_key(mlxcel_server: MlxcelServer) -> str:
    """The running server's API key."""
    return mlxcel_server.api_key
