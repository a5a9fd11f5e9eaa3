#!/usr/bin/env bash
# mlxcel against mlx_lm on a GPU: same machine, same call, same random-weight
# checkpoints of real shapes (benches/gpu_models.py). Prints a log that
# benches/gpu_summary.py turns into the README's table and a JSON file.
#
#   MLXCEL_DIR=target/release PY=python3 TOKENIZER=models/SmolLM2-135M-Instruct \
#     MODELS="smollm2-135m qwen2.5-0.5b qwen2.5-1.5b" CASES="single batch serve" \
#     bash benches/gpu_bench.sh | tee gpu.log
#
# Needs a Python with MLX's GPU build and mlx-lm (`pip install "mlx[cuda13]"
# mlx-lm==0.32.2` on Linux with an NVIDIA GPU; plain `mlx` on a Mac), the
# release binaries, and `transformers` for the prompt. Cases:
#   single  one request: 1,024- and 128-token prompts, 256 new tokens
#           (mlxcel `generate --runs 3` in one process; mlx_lm's own loop,
#           scripts/bench_mlx_lm.py, 3 runs after a warm-up)
#   batch   32 rows of a 512-token prompt, 128 new tokens (mlxcel
#           `generate --batch 32`; mlx_lm `batch_generate`)
#   serve   benches/load.py at 1, 8 and 32 clients (--parallel 32)
# mlxcel decodes with --speculative off, as mlx_lm's plain loop does (the
# default, prompt lookup, drafts from a random model's repetitive output and
# would make mlxcel's numbers those of speculative decoding; load.py pins
# it off too; benches/speculative.py measures speculation).
set -uo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
MLXCEL_DIR=${MLXCEL_DIR:-$HERE/target/release}
PY=${PY:-python3}
MODELS=${MODELS:-smollm2-135m qwen2.5-0.5b}
CASES=${CASES:-single batch serve}
MODEL_ROOT=${MODEL_ROOT:-/tmp/mlxcel-gpu-models}
TOKENIZER=${TOKENIZER:-$HERE/models/SmolLM2-135M-Instruct}
GT=${GT:-256}; PTS=${PTS:-1024 128}; B=${B:-32}; BPT=${BPT:-512}; BGT=${BGT:-128}
has() { [[ " $CASES " == *" $1 "* ]]; }
prompt() {
  "$PY" -c "
import sys; sys.path.insert(0, '$HERE/scripts'); from bench_mlx_lm import prompt_ids
from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained('$1')
print(t.decode(prompt_ids(t, $2)), end='')" 2>/dev/null
}
echo "### machine $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) commit ${COMMIT:-$(git -C "$HERE" rev-parse --short HEAD 2>/dev/null)} date $(date -u +%F)"
for m in $MODELS; do
  M=$MODEL_ROOT/$m
  [ -d "$M" ] || "$PY" "$HERE/benches/gpu_models.py" "$m" "$M" --tokenizer "$TOKENIZER" --group-size "${GS:-64}"
  if has single; then
    for pt in $PTS; do
      P=$(prompt "$M" "$pt")
      echo "### $m single pt=$pt mlxcel"
      timeout 600 "$MLXCEL_DIR/mlxcel" generate -m "$M" --no-chat-template --ignore-eos -p "$P" -n "$GT" --runs 3 --speculative off ${EXTRA:-} 2>&1 \
        | grep -E "Prompt:|Generation:|Run |warm-up done|rror|anic"
      echo "### $m single pt=$pt mlx_lm"
      timeout 600 "$PY" "$HERE/scripts/bench_mlx_lm.py" --model "$M" --prompt-tokens "$pt" --gen-tokens "$GT" --runs 3 --blas default 2>&1 | tail -1
    done
  fi
  if has batch; then
    P=$(prompt "$M" "$BPT")
    echo "### $m batch32 pt=$BPT mlxcel"
    timeout 600 "$MLXCEL_DIR/mlxcel" generate -m "$M" --no-chat-template --ignore-eos -p "$P" -n "$BGT" --batch "$B" --runs 2 --no-prompt-cache --profile steps --speculative off ${EXTRA:-} 2>&1 \
      | grep -E "Prompt:|Generation:|Run |decode x$B|engine\.|model\.|rror|anic" | head -60
    echo "### $m batch32 pt=$BPT mlx_lm"
    timeout 600 "$PY" "$HERE/scripts/bench_mlx_lm.py" --model "$M" --prompt-tokens "$BPT" --gen-tokens "$BGT" --runs 2 --batch "$B" --blas default 2>&1 | tail -1
  fi
  if has serve; then
    echo "### $m serve"
    timeout 900 "$PY" "$HERE/benches/load.py" --mlxcel-bin "$MLXCEL_DIR/mlxcel-server" --model "$M" \
      --concurrency "${CONC:-1,8,32}" --max-tokens "${LT:-128}" --python "$PY" --mlx-lm-blas default \
      --mlxcel-args "--parallel 32 ${SEXTRA:-}" --mlx-lm-args "--decode-concurrency 32 --prompt-concurrency 32" \
      --timeout 300 ${LOAD_JSON:+--json "$LOAD_JSON.$m.json"} 2>&1 | tail -30
  fi
done
