#!/usr/bin/env bash
# Where a step's time goes on a GPU (docs/performance.md), for one model:
# MLX primitive costs, then `mlxcel generate --profile` for prefill,
# single-stream decode and 32-row decode, cold (first run in the process)
# and warm, then mlx_lm on the same checkpoint. Prints everything.
#   MLXCEL=target/release/mlxcel MODEL=DIR bash benches/gpu_profile.sh
# PT/GT: prompt and generated tokens (1024/256); SECTIONS picks parts
# (default: probe single layers batch batchlayers mlx_lm); EXTRA: more
# `generate` flags (decode is plain: --speculative off, as mlx_lm's).
set -uo pipefail
MLXCEL=${MLXCEL:-target/release/mlxcel}
MODEL=${MODEL:?a model directory}
PT=${PT:-1024}; GT=${GT:-256}; PY=${PY:-python3}
SECTIONS=${SECTIONS:-probe single layers batch batchlayers mlx_lm}
HERE=$(cd "$(dirname "$0")/.." && pwd)
prompt() {
  "$PY" -c "
import sys; sys.path.insert(0, '$HERE/scripts'); from bench_mlx_lm import prompt_ids
from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained('$MODEL')
print(t.decode(prompt_ids(t, $1)), end='')"
}
P=$(prompt "$PT"); P512=$(prompt 512)
gen() { "$MLXCEL" generate -m "$MODEL" --no-chat-template --ignore-eos --speculative off ${EXTRA:-} "$@" 2>&1 | grep -v " INFO "; }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
has probe && "$PY" "$HERE/benches/gpu_probe.py"
if has single; then
  echo "=== one request, prompt $PT, $GT new tokens, 3 runs in one process (steps profile) ${EXTRA:-}"
  gen -p "$P" -n "$GT" --runs 3 --profile steps
fi
if has layers; then
  echo "=== one request, layers profile (a sync per region), 64 new tokens"
  gen -p "$P" -n 64 --runs 2 --profile layers
fi
if has batch; then
  echo "=== 32 rows, prompt 512, 128 new tokens (steps profile)"
  gen -p "$P512" -n 128 --batch 32 --runs 2 --profile steps
fi
if has batchlayers; then
  echo "=== 32 rows, layers profile, 32 new tokens"
  gen -p "$P512" -n 32 --batch 32 --runs 1 --profile layers
fi
if has mlx_lm; then
  echo "=== mlx_lm, prompt $PT, $GT new tokens"
  "$PY" "$HERE/scripts/bench_mlx_lm.py" --model "$MODEL" --prompt-tokens "$PT" --gen-tokens "$GT" --runs 3 --blas default 2>&1 | tail -1
fi
