#!/usr/bin/env bash
# Runs every test of mlxcel on a fresh machine: sets up the Python
# environment, OpenBLAS and the SmolLM2 test checkpoint (idempotent), then
# the whole cargo test suite in release mode (the model tests need the speed).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/setup.sh
export MLXCEL_TEST_MODEL="$REPO/models/SmolLM2-135M-Instruct"
cargo test --release --workspace "$@"
