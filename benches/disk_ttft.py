"""TTFT per turn of an agent-style conversation, RAM-only vs the disk tier,
with a server restart in the middle (issue 25).

  .venv/bin/python benches/disk_ttft.py [--mlxcel-bin target/release/mlxcel-server]
      [--model models/SmolLM2-135M-Instruct] [--system-words 3000] [--turns 6]
      [--restart-after 3] [--json benches/results/....json]

A long system prompt (tool definitions and instructions, --system-words
words), then --turns user turns of ~120 words each, each request carrying
the whole conversation so far (the assistant's earlier replies included),
streamed with max_tokens 16 at temperature 0. The server is stopped with
SIGTERM after --restart-after turns and started again. Two runs:
`ram` (no --prompt-cache-dir: the restart loses the cache) and `disk`
(--prompt-cache-dir in a fresh temporary directory: the clean stop saves
the cache, the restarted server reads it back). Prints, per turn, TTFT
(send to first content chunk) and cached_tokens of both runs, the stop
time (SIGTERM to exit, the disk run's includes saving), and checks that
both runs gave the same replies.
"""

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # noqa: E402  (same directory)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mlxcel-bin", default=str(load.REPO / "target/release/mlxcel-server"))
    p.add_argument("--model", default=str(load.REPO / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--system-words", type=int, default=3000)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--restart-after", type=int, default=3)
    p.add_argument("--mlxcel-args", default="")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def system_prompt(n_words):
    rng = random.Random(25)
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": rng.choice(load.SENTENCES),
                                          "parameters": {"type": "object", "properties": {
                                              "path": {"type": "string"}, "line": {"type": "integer"}}}}}
        for i in range(12)
    ]
    words = "You are a coding agent. Tools:".split() + json.dumps(tools).split()
    while len(words) < n_words:
        words += rng.choice(load.SENTENCES).split()
    return " ".join(words[:n_words])


def user_turn(i):
    return load.make_prompt(100 + i, 120)


def ttft(port, messages):
    """One streamed request: (ttft seconds, cached_tokens, prompt_tokens, reply text)."""
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(load.HOST, port, timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read(500)!r}")
    first, text, usage = None, [], None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        obj = json.loads(data)
        for choice in obj.get("choices", []):
            piece = choice.get("delta", {}).get("content")
            if piece:
                first = first or time.perf_counter() - t0
                text.append(piece)
        usage = obj.get("usage") or usage
    conn.close()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return first, details.get("cached_tokens"), (usage or {}).get("prompt_tokens"), "".join(text)


def start(args, cache_dir):
    extra = args.mlxcel_args + (f" --prompt-cache-dir {cache_dir}" if cache_dir else "")
    server = load.start_mlxcel(argparse.Namespace(
        mlxcel_bin=args.mlxcel_bin, model=args.model, mlxcel_args=extra))
    server.wait_ready()
    return server


def stop(server):
    """SIGTERM and wait; returns seconds to exit."""
    t0 = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout=600)
    server.log.close()
    return time.perf_counter() - t0


def run(args, cache_dir):
    messages = [{"role": "system", "content": system_prompt(args.system_words)}]
    turns, stops = [], []
    server = start(args, cache_dir)
    try:
        for i in range(args.turns):
            if i == args.restart_after:
                stops.append(stop(server))
                server = start(args, cache_dir)
            messages.append({"role": "user", "content": user_turn(i)})
            t, cached, prompt, reply = ttft(server.port, messages)
            messages.append({"role": "assistant", "content": reply})
            turns.append({"turn": i + 1, "ttft_s": t, "cached_tokens": cached,
                          "prompt_tokens": prompt, "after_restart": i == args.restart_after,
                          "reply": reply})
            print(f"  turn {i + 1}: {prompt} prompt tokens, {cached} cached, TTFT {t:.3f} s",
                  flush=True)
    finally:
        stops.append(stop(server))
    return {"turns": turns, "stop_s": stops}


def main():
    args = parse_args()
    results = {}
    print("ram (no --prompt-cache-dir)", flush=True)
    results["ram"] = run(args, None)
    tmp = tempfile.mkdtemp(prefix="mlxcel-disk-bench-")
    try:
        print("disk (--prompt-cache-dir)", flush=True)
        results["disk"] = run(args, tmp)
        files = [f for f in os.listdir(tmp) if f.endswith(".kvb")]
        results["disk"]["files"] = len(files)
        results["disk"]["bytes"] = sum(os.path.getsize(os.path.join(tmp, f)) for f in files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = [a["reply"] == b["reply"] for a, b in zip(results["ram"]["turns"], results["disk"]["turns"])]
    print("\n| turn | prompt tokens | RAM-only TTFT (s) | cached | disk tier TTFT (s) | cached |")
    print("| --- | --- | --- | --- | --- | --- |")
    for a, b in zip(results["ram"]["turns"], results["disk"]["turns"]):
        mark = " (after restart)" if a["after_restart"] else ""
        print(f"| {a['turn']}{mark} | {a['prompt_tokens']} | {a['ttft_s']:.3f} | {a['cached_tokens']} "
              f"| {b['ttft_s']:.3f} | {b['cached_tokens']} |")
    print(f"\nstop (SIGTERM to exit) s: ram {results['ram']['stop_s']}, disk {results['disk']['stop_s']}")
    print(f"disk files at the end: {results['disk']['files']}, {results['disk']['bytes']} bytes")
    print(f"same replies in both runs: {all(same)}")
    results["same_replies"] = all(same)
    results["args"] = vars(args)
    results["machine"] = load.machine()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
