#!/usr/bin/env bash
# Single-stream prefill and decode on a GPU, mlxcel under several flag sets
# against mlx_lm's plain decode, same machine, same call, same random-weight
# checkpoints of real shapes (benches/gpu_models.py). The modes run
# interleaved (mode 1, mode 2, ..., then again), `--runs 3` each in one
# process, so a drift of the machine shows in every mode alike.
#
#   MLXCEL_DIR=target/release PY=python3 TOKENIZER=models/SmolLM2-135M-Instruct \
#     MODELS="smollm2-135m gemma3-270m" PT=1024 GT=256 ROUNDS=2 \
#     MODES="--speculative off|--speculative off --no-decode-pipeline|" \
#     bash benches/gpu_decode_modes.sh | tee decode.log
#
# MODES: flag sets separated by `|` (an empty one is the defaults). Each
# mlxcel run prints its prompt and generation speed lines; mlx_lm's line is
# scripts/bench_mlx_lm.py's (3 runs after a warm-up). MLX_LM=0 skips it.
set -uo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
MLXCEL_DIR=${MLXCEL_DIR:-$HERE/target/release}
PY=${PY:-python3}
MODELS=${MODELS:-smollm2-135m}
MODEL_ROOT=${MODEL_ROOT:-/tmp/mlxcel-gpu-models}
TOKENIZER=${TOKENIZER:-$HERE/models/SmolLM2-135M-Instruct}
PT=${PT:-1024}; GT=${GT:-256}; ROUNDS=${ROUNDS:-2}
MODES=${MODES:---speculative off}
IFS='|' read -r -a modes <<< "$MODES"
echo "### machine $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) commit ${COMMIT:-$(git -C "$HERE" rev-parse --short HEAD 2>/dev/null)} date $(date -u +%F)"
for m in $MODELS; do
  M=$MODEL_ROOT/$m
  [ -d "$M" ] || "$PY" "$HERE/benches/gpu_models.py" "$m" "$M" --tokenizer "$TOKENIZER" --group-size "${GS:-64}"
  P=$("$PY" -c "
import sys; sys.path.insert(0, '$HERE/scripts'); from bench_mlx_lm import prompt_ids
from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained('$M')
print(t.decode(prompt_ids(t, $PT)), end='')" 2>/dev/null)
  for round in $(seq "$ROUNDS"); do
    for mode in "${modes[@]}"; do
      echo "### $m round $round mlxcel [$mode]"
      # shellcheck disable=SC2086
      timeout "${RUN_TIMEOUT:-300}" "$MLXCEL_DIR/mlxcel" generate -m "$M" --no-chat-template --ignore-eos \
        -p "$P" -n "$GT" --runs 3 $mode 2>&1 | grep -E "Prompt:|Generation:|rror|anic"
    done
  done
  if [ "${MLX_LM:-1}" != 0 ]; then
    echo "### $m mlx_lm"
    timeout "${RUN_TIMEOUT:-300}" "$PY" "$HERE/scripts/bench_mlx_lm.py" --model "$M" --prompt-tokens "$PT" \
      --gen-tokens "$GT" --runs 3 --blas default 2>&1 | tail -1
  fi
done
