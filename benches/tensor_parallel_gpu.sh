#!/usr/bin/env bash
# Tensor-parallel throughput on the GPU device (docs/distributed.md), after
# the device's install step (MLX's CUDA build, mlx-lm, the mlxcel
# binaries in /tmp): one request's decode speed and 8 concurrent streams'
# throughput, for mlxcel-server at 1 rank and at 2 ranks (mlx.launch
# --backend nccl), and mlx_lm's own tensor-parallel generate
# (model.shard()) at 1 and 2 ranks, on a random-weight checkpoint of
# Qwen2.5-1.5B's shape (4-bit, group 64, bfloat16). Each run's greedy reply
# is printed as a hash, to compare 1 rank with 2.
#   bash benches/tensor_parallel_gpu.sh
# BACKEND=ring runs both ranks over TCP instead (on a one-GPU machine both
# ranks share the GPU: a correctness check of the sharded forward on the
# GPU, not a scaling number).
set -u
. "$(dirname "$0")/tensor_parallel_gpu_common.sh"
M=/tmp/m/qwen2.5-1.5b; [ -d $M ] || python3 /tmp/stash/mkmodel.py qwen2.5-1.5b $M 64
GT=${GT:-256}
RANKS=${RANKS:-"1 2"}
BACKEND=${BACKEND:-nccl}
cat > /tmp/tp_mlx_lm.py <<'PY'
import sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate
g = mx.distributed.init()
model, tok = load(sys.argv[1])
if g.size() > 1:
    model.shard(g)
mx.eval(model.parameters())
ban = mx.array([0, 1, 2])
def no_eos(tokens, logits):
    return logits.at[..., ban].add(-1e9)
for run in range(3):
    last = None
    for r in stream_generate(model, tok, "Count to a thousand.", max_tokens=int(sys.argv[2]), logits_processors=[no_eos]):
        last = r
    if g.rank() == 0:
        print(f"mlx_lm ranks={g.size()} run={run} tokens={last.generation_tokens} decode_tok_s={last.generation_tps:.1f}", flush=True)
PY
cat > /tmp/tp_client.py <<'PY'
import json, sys, threading, time, urllib.request
port, gt, label = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def stream(out):
    body = json.dumps({"messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": gt, "temperature": 0, "stream": True,
        "logit_bias": {"0": -100, "1": -100, "2": -100}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
        {"Content-Type": "application/json"})
    times, text = [], []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"content"' in line:
                times.append(time.perf_counter())
                for c in json.loads(line[6:])["choices"]:
                    text.append(c["delta"].get("content") or "")
    out.append(times)
    texts.append("".join(text))
texts = []
for run in range(3):
    out = []; stream(out); t = out[0]
    import hashlib
    digest = hashlib.sha256(texts[-1].encode()).hexdigest()[:12]
    print(f"{label} single run={run} chunks={len(t)} decode_tok_s={(len(t)-1)/(t[-1]-t[0]):.1f} reply_sha={digest}", flush=True)
for run in range(2):
    out = []; start = time.perf_counter()
    th = [threading.Thread(target=stream, args=(out,)) for _ in range(8)]
    [x.start() for x in th]; [x.join() for x in th]
    wall = time.perf_counter() - start; n = sum(len(t) for t in out)
    print(f"{label} serving conc=8 run={run} tokens={n} tok_s={n/wall:.1f}", flush=True)
PY
if [[ " $RANKS " == *" 1 "* ]]; then
echo "=== mlx_lm, 1 rank"; timeout 150 python3 /tmp/tp_mlx_lm.py $M $GT 2>&1 | grep -E "mlx_lm|rror" | tail -4
echo "=== mlxcel, 1 rank"
/tmp/mlxcel-server -m $M --port 18500 --parallel 8 > /tmp/s1.log 2>&1 & P=$!
wait_ready 18500 $P && timeout 200 python3 /tmp/tp_client.py 18500 $GT mlxcel-1rank; kill $P; wait $P 2>/dev/null
fi
if [[ " $RANKS " == *" 2 "* ]]; then
echo "=== mlx_lm, 2 ranks ($BACKEND)"; timeout 150 "${LAUNCH[@]}" --backend $BACKEND -n 2 -- python3 /tmp/tp_mlx_lm.py $M $GT 2>&1 | grep -E "mlx_lm|rror" | tail -4
echo "=== mlxcel, 2 ranks ($BACKEND)"
# Its own process group: the launcher and both ranks stop together.
setsid "${LAUNCH[@]}" --backend $BACKEND -n 2 -- /tmp/mlxcel-server -m $M --port 18501 --parallel 8 --tensor-parallel > /tmp/s2.log 2>&1 & P=$!
if wait_ready 18501 $P; then timeout 200 python3 /tmp/tp_client.py 18501 $GT mlxcel-2ranks; else tail -20 /tmp/s2.log; fi
grep -E "joined|ready: serving|rror" /tmp/s2.log | cut -c1-200 | head -6
kill -- -$P; sleep 2; kill -9 -- -$P 2>/dev/null || true
fi
nvidia-smi --query-gpu=name --format=csv,noheader
