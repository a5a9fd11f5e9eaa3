#!/usr/bin/env bash
# Quantized KV on the device (NVIDIA H200, MLX CUDA): run after the
# device's install step (MLX's CUDA build, mlx-lm, the mlxcel binaries in
# /tmp, see docs/performance.md), from the checkout, with the real SmolLM2 carried as
# the EXTRA tar smol.tar. `correctness` compares the paged kernel (one
# block, or split parts + merge) with the gather + dequantize path;
# `speed` measures decode on the Qwen2.5-1.5B shape (random weights);
# `sinks` runs the split kernel's merge with sinks and windows.
# Results: benches/results/2026-12-03-kv-quant-h200.md.
set -u
case "${1:-}" in
correctness)
. /tmp/stash/env.sh
[ -f .gpu-cache/kernels.tgz ] && mkdir -p ~/.cache/mlxcel && tar -C ~/.cache/mlxcel -xzf .gpu-cache/kernels.tgz
mkdir -p /tmp/m/smol && tar -C /tmp/m/smol -xf /tmp/stash/extra/smol.tar
python3 - <<'PY'
import json
p = ["Write a haiku about the sea.", "Explain what a hash map is in two sentences.",
     "List three prime numbers and say why they are prime.", "Translate 'good morning' into French and German.",
     "def fibonacci(n):", "What is the capital of Australia? Answer briefly.",
     "Give me a short recipe for pancakes.", "Why is the sky blue?",
     "Summarize the plot of Romeo and Juliet in one paragraph.", "Write a Python function that reverses a string.",
     "What are the benefits of unit tests?", "Describe a cat to someone who has never seen one."]
json.dump(p, open("/tmp/short.json", "w"))
text = open("README.md").read()
json.dump(["Summarize this document:\n" + text[:n] for n in (6000, 9000, 14000)], open("/tmp/long.json", "w"))
PY
for set in short long; do
for kv in auto int8 int4; do
  for path in paged batched; do
    timeout 240 /tmp/mlxcel generate -m /tmp/m/smol --dtype float32 --prompts-file /tmp/$set.json -n 48 --ignore-eos \
      --kv-cache-dtype $kv --attention-path $path --print-token-ids > $OUT/ids-$set-$kv-$path.txt 2>$OUT/log-$set-$kv-$path.txt
    echo "$set $kv $path rc=$? $(grep -c '"ids"' $OUT/ids-$set-$kv-$path.txt) rows; $(grep -hE 'Prompt:|Generation' $OUT/ids-$set-$kv-$path.txt | tr '\n' ' ')"
    grep -iE "error|panic" $OUT/log-$set-$kv-$path.txt | head -3
  done
done
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
def rows(s, kv, path):
    r = [json.loads(l) for l in open(f"{out}/ids-{s}-{kv}-{path}.txt") if l.startswith("{") and '"ids"' in l]
    return [x["ids"] for x in sorted(r, key=lambda x: x["prompt"])]
def cmp(a, b):
    same = sum(x == y for x, y in zip(a, b))
    pref = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(a, b)]
    return same, pref
for s in ["short", "long"]:
    for kv in ["auto", "int8", "int4"]:
        a, b = rows(s, kv, "paged"), rows(s, kv, "batched")
        same, pref = cmp(a, b)
        print(f"{s} {kv}: paged kernel == gather path on {same}/{len(a)} prompts; first divergence {pref}")
    base = rows(s, "auto", "paged")
    for kv in ["int8", "int4"]:
        same, pref = cmp(base, rows(s, kv, "paged"))
        print(f"{s} {kv} vs float K/V: {same}/{len(base)} identical; matching prefix {pref}")
PY
;;
speed)
. /tmp/stash/env.sh
python3 benches/gpu_models.py qwen2.5-1.5b /tmp/m/q15 --tokenizer /tmp/stash/tok >/dev/null
M=/tmp/m/q15
python3 -c "
import sys; sys.path.insert(0,'scripts'); from bench_mlx_lm import prompt_ids
from transformers import AutoTokenizer; t=AutoTokenizer.from_pretrained('$M'); print(t.decode(prompt_ids(t,4096)),end='')" > /tmp/prompt.txt
run() { timeout 150 /tmp/mlxcel generate -m $M --no-chat-template --ignore-eos --speculative off -p "$(cat /tmp/prompt.txt)" "$@" 2>&1 | grep -E "Prompt:|Generation:|rror|anic" | tail -2; }
for kv in auto int8 int4; do
  echo "== 1 stream, 4k prompt, kv $kv, paged"; run -n 256 --runs 2 --kv-cache-dtype $kv --decode-storage-backend paged
  echo "== 8 rows, 4k prompt, kv $kv"; run -n 128 --batch 8 --kv-cache-dtype $kv
  echo "== 32 rows, 4k prompt, kv $kv"; run -n 128 --batch 32 --kv-cache-dtype $kv
done
echo "== 1 stream, 4k prompt, dense"; run -n 256 --runs 2 --decode-storage-backend dense
echo "== mlx_lm 1 stream, 4k prompt"
timeout 150 python3 -m mlx_lm generate --model $M --prompt "$(cat /tmp/prompt.txt)" --max-tokens 256 --ignore-chat-template 2>&1 | grep -E "Prompt:|Generation:|rror"
;;
sinks)
# gpt-oss-small (sinks, a 128-token window on alternate layers) and
# qwen3.5-small (hybrid) in float32: kernel vs gather path on long rows.
. /tmp/stash/env.sh
[ -f .gpu-cache/kernels.tgz ] && mkdir -p ~/.cache/mlxcel && tar -C ~/.cache/mlxcel -xzf .gpu-cache/kernels.tgz
for m in gpt-oss-small qwen3.5-small; do
python3 benches/gpu_models.py $m /tmp/m/$m --tokenizer /tmp/stash/tok --bits 0 --dtype float32 >/dev/null
python3 - <<'PY'
import json
t = open("README.md").read()
json.dump(["Summarize:\n" + t[:n] for n in (5000, 9000)], open("/tmp/long.json", "w"))
json.dump(["Summarize:\n" + t[:7000]], open("/tmp/one.json", "w"))
PY
for set in long one; do
for kv in auto int8; do
  for path in paged batched; do
    timeout 200 /tmp/mlxcel generate -m /tmp/m/$m --dtype float32 --prompts-file /tmp/$set.json -n 32 --ignore-eos \
      --kv-cache-dtype $kv --attention-path $path --print-token-ids 2>&1 | grep -E '"ids"|rror|anic' > /tmp/ids-$m-$set-$kv-$path.txt
  done
  if cmp -s /tmp/ids-$m-$set-$kv-paged.txt /tmp/ids-$m-$set-$kv-batched.txt; then r=same; else r=DIFFERENT; fi
  echo "$m $set $kv: kernel vs gather path: $r ($(grep -c ids /tmp/ids-$m-$set-$kv-paged.txt) rows)"
done
done
done
head -c 300 /tmp/ids-gpt-oss-small-one-int8-paged.txt; echo
head -c 300 /tmp/ids-gpt-oss-small-one-int8-batched.txt; echo
;;
*) echo "usage: $0 correctness|speed|sinks" >&2; exit 2;;
esac
