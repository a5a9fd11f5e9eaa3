"""TTFT of a long prompt cold vs warm (prefix-cache hit), through the server.

  .venv/bin/python benches/prefix_ttft.py [--mlxcel-bin target/release/mlxcel-server]
      [--model models/SmolLM2-135M-Instruct] [--prompt-tokens 1000] [--runs 3]

Starts mlxcel-server on a free port, then for each run sends a fresh prompt of
about --prompt-tokens tokens (distinct from its first word, so each run starts
cold) twice, streaming with max_tokens 4: the first request computes the whole
prompt (cold), the second finds it in the prefix cache (warm: only the last
token is recomputed). TTFT = from send to the first content chunk. Prints the
median cold and warm TTFT, their ratio and the cached_tokens the server
reported. Reuses the server and request plumbing of benches/load.py.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # noqa: E402  (same directory)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mlxcel-bin", default=str(load.REPO / "target/release/mlxcel-server"))
    p.add_argument("--model", default=str(load.REPO / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mlxcel-args", default="")
    return p.parse_args()


def ttft(port, prompt):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    rec = load.one_request(port, body, timeout=600)
    if not rec["ok"]:
        raise RuntimeError(rec["error"])
    return rec["t_first"], rec


def cached_tokens(port, prompt):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0}
    conn, resp = load.post_json(port, body, timeout=600)
    usage = load.json.loads(resp.read())["usage"]
    conn.close()
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def main():
    args = parse_args()
    server = load.start_mlxcel(argparse.Namespace(
        mlxcel_bin=args.mlxcel_bin, model=args.model, mlxcel_args=args.mlxcel_args))
    try:
        server.wait_ready()
        cold, warm, cached = [], [], None
        words = int(args.prompt_tokens * 0.75)
        for run in range(args.runs):
            prompt = load.make_prompt(1000 + run, words)
            cold.append(ttft(server.port, prompt)[0])
            warm.append(ttft(server.port, prompt)[0])
            cached = cached_tokens(server.port, prompt)
    finally:
        server.stop()
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"Machine: {load.machine()}")
    print(f"prompt tokens {cached[0]}, cached on a warm request {cached[1]}")
    print("| request | TTFT ms (median of %d) |" % args.runs)
    print("| --- | --- |")
    print(f"| cold | {c * 1e3:.1f} |")
    print(f"| warm (prefix-cache hit) | {w * 1e3:.1f} |")
    print(f"| cold / warm | {c / w:.1f}x |")


if __name__ == "__main__":
    main()
