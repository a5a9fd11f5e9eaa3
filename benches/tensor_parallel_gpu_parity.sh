#!/usr/bin/env bash
# Greedy replies of mlxcel-server at 1 rank and at 2 ranks on the GPU device
# (after the device's install step), for a float32 checkpoint whose head
# counts divide by 2 (the tests' target/tiny-models/llama_chat, carried as a
# tar): eight chat prompts, one by one and then all at once. Prints each
# reply's hash and whether the 2-rank replies equal the 1-rank ones.
#   MODEL=/tmp/stash/extra/llama_chat BACKEND=ring bash benches/tensor_parallel_gpu_parity.sh
set -u
. "$(dirname "$0")/tensor_parallel_gpu_common.sh"
M=${MODEL:?MODEL=checkpoint dir}; BACKEND=${BACKEND:-nccl}
cat > /tmp/tp_parity.py <<'PY'
import hashlib, json, sys, threading, urllib.request
port = int(sys.argv[1])
prompts = ["Hello!", "What is the capital of France?", "Write a haiku about rust.",
    "List three prime numbers.", "Explain KV caches in one sentence.", "Count to ten.",
    "Translate 'good morning' to German.", "What is 17 times 3?"]
def ask(p, out, i):
    body = json.dumps({"messages": [{"role": "user", "content": p}], "max_tokens": 48,
        "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out[i] = json.load(r)["choices"][0]["message"]["content"]
one = [None] * len(prompts)
for i, p in enumerate(prompts):
    ask(p, one, i)
together = [None] * len(prompts)
th = [threading.Thread(target=ask, args=(p, together, i)) for i, p in enumerate(prompts)]
[t.start() for t in th]; [t.join() for t in th]
print(json.dumps({"one_by_one": one, "batched": together}))
PY
/tmp/mlxcel-server -m $M --port 18600 --parallel 8 > /tmp/p1.log 2>&1 & P=$!
wait_ready 18600 $P && python3 /tmp/tp_parity.py 18600 > /tmp/r1.json; kill $P; wait $P 2>/dev/null
setsid "${LAUNCH[@]}" --backend $BACKEND -n 2 -- /tmp/mlxcel-server -m $M --port 18601 --parallel 8 --tensor-parallel > /tmp/p2.log 2>&1 & P=$!
if wait_ready 18601 $P; then python3 /tmp/tp_parity.py 18601 > /tmp/r2.json; else tail -20 /tmp/p2.log; fi
kill -- -$P; sleep 2; kill -9 -- -$P 2>/dev/null || true
python3 - <<'PY'
import hashlib, json
a, b = json.load(open("/tmp/r1.json")), json.load(open("/tmp/r2.json"))
h = lambda s: hashlib.sha256(s.encode()).hexdigest()[:10]
for k in ("one_by_one", "batched"):
    same = sum(x == y for x, y in zip(a[k], b[k]))
    print(f"{k}: 2 ranks equal 1 rank on {same}/{len(a[k])}", [h(x) for x in a[k]], [h(x) for x in b[k]])
print("1-rank batched equals one by one:", a["batched"] == a["one_by_one"])
PY
