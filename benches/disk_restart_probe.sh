#!/usr/bin/env bash
# One long prompt cold, warm from RAM, then after a clean restart warm from
# the disk tier, through mlxcel-server (target/release); prints each
# request's seconds and cached tokens, and the server's own log lines for
# the save at stop and the read at admission (RUST_LOG=info).
#   bash benches/disk_restart_probe.sh [MODEL_DIR]
# MLXCEL_ARGS adds server flags (e.g. "--kv-cache-dtype int8").
set -euo pipefail
MODEL="${1:-models/SmolLM2-135M-Instruct}"
DIR="$(mktemp -d)"
LOG="$DIR/server.log"
PORT=18472
start() {
  RUST_LOG=info,tower_http=warn target/release/mlxcel-server -m "$MODEL" --port "$PORT" \
    --prompt-cache-dir "$DIR/pc" ${MLXCEL_ARGS:-} >> "$LOG" 2>&1 &
  PID=$!
  for _ in $(seq 1 120); do curl -sf "localhost:$PORT/health" >/dev/null && return; sleep 1; done
  echo "server not ready" >&2; exit 1
}
req() {
  .venv/bin/python - "$PORT" <<'PY'
import json, sys, time, urllib.request
body = {"prompt": open("README.md").read()[:6000], "max_tokens": 1, "temperature": 0}
t = time.time()
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions",
                             json.dumps(body).encode(), {"Content-Type": "application/json"})
u = json.loads(urllib.request.urlopen(req).read())["usage"]
print("prompt", u["prompt_tokens"], "cached", u["prompt_tokens_details"]["cached_tokens"],
      "seconds", round(time.time() - t, 3))
PY
}
stop() { kill -TERM "$PID"; wait "$PID" || true; }
start; req; req; stop
start; req; req; stop
grep -E "read from disk|saved to disk" "$LOG"
rm -rf "$DIR"
