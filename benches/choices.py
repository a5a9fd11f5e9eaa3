"""What `n` choices and constrained decoding cost, through the server.

  .venv/bin/python benches/choices.py [--mlxcel-bin target/release/mlxcel-server]
      [--model models/SmolLM2-135M-Instruct] [--prompt-tokens 600] [--n 4] [--runs 2]

Starts mlxcel-server on a free port (default flags, `--parallel 4`), then:

1. `n` choices of one ~--prompt-tokens prompt (temperature 1, seeded, 16
   tokens each) as ONE request with `n`, against the same prompt sent as `n`
   concurrent requests with `cache_prompt: false` (so each computes its own
   prefill, as a server without shared prefills would). Reports wall time
   and the prefill tokens the server ran (`mlxcel_step_tokens_total`).
2. Decode speed of 48 greedy tokens with `response_format: json_schema`
   (an llguidance mask every step) against the same request without it:
   completion tokens over the request's wall time.

mlx_lm.server has no `n` and no grammar, so the ratios are within mlxcel.
Reuses the server and request plumbing of benches/load.py.
"""

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # noqa: E402  (same directory)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "hobbies"],
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mlxcel-bin", default=str(load.REPO / "target/release/mlxcel-server"))
    p.add_argument("--model", default=str(load.REPO / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--mlxcel-args", default="")
    return p.parse_args()


def post(port, body):
    conn, resp = load.post_json(port, body, timeout=900)
    data = json.loads(resp.read())
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data}")
    return data


def prefill_tokens(port):
    text = urllib.request.urlopen(f"http://{load.HOST}:{port}/metrics", timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith('mlxcel_step_tokens_total{kind="prefill"}'):
            return int(float(line.split()[-1]))
    raise RuntimeError("no prefill counter in /metrics")


def timed(port, fn):
    before = prefill_tokens(port)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, prefill_tokens(port) - before


def one_request_n(port, prompt, n, seed):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 1.0,
            "seed": seed, "n": n, "cache_prompt": False}
    out = post(port, body)
    assert len(out["choices"]) == n


def separate_requests(port, prompt, n, seed):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 1.0,
            "cache_prompt": False}
    threads = [threading.Thread(target=post, args=(port, dict(body, seed=seed + i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def decode_rate(port, constrained):
    body = {"messages": [{"role": "user", "content": "Describe a person as JSON."}], "max_tokens": 48,
            "temperature": 0, "cache_prompt": False}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    t0 = time.perf_counter()
    out = post(port, body)
    return out["usage"]["completion_tokens"] / (time.perf_counter() - t0)


def main():
    args = parse_args()
    server = load.start_mlxcel(argparse.Namespace(
        mlxcel_bin=args.mlxcel_bin, model=args.model, mlxcel_args=args.mlxcel_args))
    try:
        server.wait_ready()
        words = int(args.prompt_tokens * 0.75)
        shared, separate, plain, grammar = [], [], [], []
        for run in range(args.runs):
            prompt = load.make_prompt(2000 + run, words)
            shared.append(timed(server.port, lambda: one_request_n(server.port, prompt, args.n, run)))
            separate.append(timed(server.port, lambda: separate_requests(server.port, prompt, args.n, run)))
            plain.append(decode_rate(server.port, False))
            grammar.append(decode_rate(server.port, True))
    finally:
        server.stop()
    s_wall = statistics.median(w for w, _ in shared)
    p_wall = statistics.median(w for w, _ in separate)
    print(f"Machine: {load.machine()}")
    print(f"| {args.n} choices of a {args.prompt_tokens}-token prompt | wall s | prefill tokens run |")
    print("| --- | --- | --- |")
    print(f"| one request, n={args.n} | {s_wall:.2f} | {shared[0][1]} |")
    print(f"| {args.n} requests, n=1 | {p_wall:.2f} | {separate[0][1]} |")
    print(f"| separate / shared | {p_wall / s_wall:.2f}x | |")
    pr, gr = statistics.median(plain), statistics.median(grammar)
    print(f"| 48 greedy tokens | tokens/s |\n| --- | --- |")
    print(f"| plain | {pr:.1f} |\n| json_schema (llguidance mask) | {gr:.1f} |\n| grammar / plain | {gr / pr:.2f} |")


if __name__ == "__main__":
    main()
