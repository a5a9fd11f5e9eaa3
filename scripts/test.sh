#!/usr/bin/env bash
# Runs every test of mlxcel on a fresh machine: sets up the Python
# environment, OpenBLAS and the SmolLM2 test checkpoint (idempotent), then
# the whole cargo test suite in release mode (the model tests need the speed),
# then the Python API tests (tests/python: Schemathesis over /openapi.json)
# against the release server binary.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# Each phase says how long it took (CI logs show where the time goes).
phase() { echo "[test.sh] $1: ${SECONDS}s since start"; }
bash scripts/setup.sh
phase "setup done"
export MLXCEL_TEST_MODEL="$REPO/models/SmolLM2-135M-Instruct"
cargo test --release --workspace "$@"
phase "cargo tests done"
# Cheap after the release test build: the libraries are already compiled.
cargo build --release --bin mlxcel-server
TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}"
MLXCEL_SERVER_BIN="$TARGET_DIR/release/mlxcel-server" \
  "$REPO/.venv/bin/python" -m pytest -q tests/python
phase "python tests done"
