#!/usr/bin/env python3
"""Serving throughput and latency under concurrent load: mlxcel-server against
mlx_lm.server, same machine, same checkpoint, same OpenAI chat API.

  .venv/bin/python benches/load.py [--mlxcel-bin PATH] [--model DIR]
      [--concurrency 1,4,8] [--requests-per-level N] [--max-tokens 64]
      [--prompt-tokens 100] [--skip-mlx-lm] [--mlxcel-args "..."] [--json OUT]

Each server is started here on a free port, polled on GET /health until it
answers, warmed up with one short request (not measured), loaded, then stopped.
For each concurrency level C, C client threads send streaming chat completions
(`stream: true`, temperature 0, fixed max_tokens, no seed) back to back until N
requests are done (default N = max(2*C, 4)). Every prompt is distinct from its
very first user word (a prefix cache can reuse only the shared chat-template
prefix) and all have the same number of words. Measured per request, with the
clock started before the connection is opened:
  TTFT: until the first SSE chunk whose delta.content is non-empty;
  E2E:  until `data: [DONE]`;
  ITL:  (last content chunk - first content chunk) / (completion tokens - 1);
  completion tokens: `usage.completion_tokens` of the final usage chunk
        (stream_options.include_usage) when the server sends it, otherwise the
        number of content-bearing chunks. Both are recorded; their ratio shows
        whether the server streams one token per chunk.
Per level: aggregate tokens/s = completion tokens of all successful requests /
wall time of the level (first send to last [DONE]); TTFT mean/p50/p90; mean
ITL; mean E2E. Failed requests (HTTP error, error chunk, broken stream,
timeout) are counted and reported, never fatal.

Equal work: `ignore_eos: true` is sent to a server only if a probe request with
it is not rejected (mlxcel refuses unknown fields with 400; mlx_lm.server
ignores unknown fields silently, so "accepted" does not mean "honoured").
Tokens/s always uses the actual counts; the finish reasons printed per server
tell whether requests stopped at EOS ('stop') or at max_tokens ('length').

mlx_lm.server batches requests (BatchGenerator) only when they carry no
`seed`; it is started with --decode-concurrency/--prompt-concurrency equal to
the largest C, and by default with LD_PRELOAD of the system OpenBLAS (what
mlxcel links), as benches/generate.py does (--mlx-lm-blas default: no preload).
Prints a Markdown table (ratio rows: mlxcel / mlx_lm) and, with --json, writes
the raw per-request numbers.

Caveat for 4-bit checkpoints on CPU: mlxcel's default (--weights auto)
dequantizes them once at load and runs dense float32 matmuls, while
mlx_lm.server keeps them quantized. For a like-for-like weight format pass
--mlxcel-args "--weights quantized".
"""
import argparse
import hashlib
import http.client
import json
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from make_goldens import find_openblas  # noqa: E402  (stdlib-only module)

HOST = "127.0.0.1"

TOPICS = [
    "a lighthouse keeper", "a lost robot", "a mountain village", "a river pirate",
    "a clockmaker's apprentice", "a desert caravan", "a haunted library", "a space station cook",
    "a retired detective", "a city of bridges", "a young astronomer", "a travelling circus",
    "a forgotten island", "a winter market", "a chess prodigy", "a glassblower",
    "an old steam train", "a beekeeper", "a deep sea diver", "a royal gardener",
]
SENTENCES = [
    "The morning fog rolled slowly over the harbour while the bells rang twice.",
    "Nobody in the town remembered who had built the tower on the hill.",
    "A letter arrived without a stamp, sealed with green wax and a single feather.",
    "The market sold copper kettles, dried apricots, maps, and rusty keys.",
    "Every evening the old radio played the same song at exactly nine o'clock.",
    "Rain had not fallen for forty days, and the wells were nearly empty.",
    "The stranger carried a violin case that was far too heavy for a violin.",
    "Children whispered that the forest moved a little closer every winter.",
    "A cat with one white ear followed the baker home every single night.",
    "The library's clock ran backwards, and the librarian refused to fix it.",
    "Far to the north, the sea froze so thick that wagons crossed it.",
    "The mayor kept a locked drawer that even his family had never seen open.",
    "A storm knocked out the lights just as the ship's captain began to speak.",
    "Someone had painted small blue doors at the bottom of every garden wall.",
    "The train timetable listed a station that did not appear on any map.",
    "Her grandmother's recipe book had one page written in an unknown alphabet.",
]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlxcel-bin", default=str(REPO / "target" / "release" / "mlxcel-server"))
    ap.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts")
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: max(2*C, 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=100, help="approximate; actual count reported")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--mlxcel-args", default="", help="extra mlxcel-server flags, e.g. '--parallel 8'")
    ap.add_argument("--mlx-lm-args", default="", help="extra mlx_lm.server flags")
    ap.add_argument("--mlx-lm-blas", choices=["openblas", "default"], default="openblas")
    ap.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"), help="runs mlx_lm.server")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--json", default=None, help="write raw numbers here")
    args = ap.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.levels or min(args.levels) < 1:
        ap.error("--concurrency needs positive integers")
    return args


# ---------------------------------------------------------------- environment

def machine():
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores"


def command_output(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or out.stderr.strip() or "unknown"
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"


def versions(args):
    code = "from importlib.metadata import version as v; print(f\"mlx {v('mlx')}, mlx-lm {v('mlx-lm')}\")"
    rev = command_output(["git", "-C", str(REPO), "describe", "--always", "--dirty"])
    try:
        digest = hashlib.sha256(Path(args.mlxcel_bin).read_bytes()).hexdigest()[:12]
    except OSError:
        digest = "?"
    return {
        "mlxcel": f"{command_output([args.mlxcel_bin, '--version'])} "
                  f"(binary sha256 {digest}; repo at git {rev})",
        "python_mlx": command_output([args.python, "-c", code]),
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------- prompts

def make_prompt(index, n_words):
    """A distinct prompt of exactly n_words words (+ a fixed instruction)."""
    rng = random.Random(index)
    topic = TOPICS[index % len(TOPICS)]
    words = f"Notes {index} about {topic}:".split()
    while len(words) < n_words:
        words += rng.choice(SENTENCES).split()
    notes = " ".join(words[:n_words])
    return f"{notes}\nUsing these notes, write a long and detailed story about {topic}."


def request_body(prompt, max_tokens, extras):
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    body.update(extras)
    return body


# ------------------------------------------------------------------- servers

def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess with its log in a temporary file."""

    def __init__(self, name, cmd, env, port):
        self.name, self.cmd, self.port = name, cmd, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"load-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def log_tail(self, n=20):
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout=300.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def plain_decode(flags):
    """mlxcel's `flags` (a list) with `--speculative off` unless they choose
    a method: `auto` speculates on a GPU too, and the benches that compare
    against mlx_lm's plain decode (or random-weight models, which repeat
    themselves, so prompt lookup finds drafts) measure one token a step;
    benches/speculative.py measures speculation."""
    flags = list(flags)
    if not any(f == "--speculative" or f.startswith("--speculative=") for f in flags):
        flags += ["--speculative", "off"]
    return flags


def start_mlxcel(args):
    port = free_port()
    cmd = [args.mlxcel_bin, "-m", args.model, "--host", HOST, "--port", str(port),
           *plain_decode(shlex.split(args.mlxcel_args))]
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "warn")
    return Server("mlxcel", cmd, env, port)


def start_mlx_lm(args):
    port = free_port()
    top = str(max(args.levels))
    cmd = [args.python, "-m", "mlx_lm", "server", "--model", args.model, "--host", HOST,
           "--port", str(port), "--decode-concurrency", top, "--prompt-concurrency", top,
           "--log-level", "WARNING", *shlex.split(args.mlx_lm_args)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.mlx_lm_blas == "openblas":
        lib = find_openblas()
        if lib is None:
            raise RuntimeError("libopenblas.so.0 not found; pass --mlx-lm-blas default")
        env["LD_PRELOAD"] = " ".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    return Server("mlx_lm", cmd, env, port)


# ------------------------------------------------------------------ requests

def post_json(port, body, timeout):
    """POST /v1/chat/completions; returns (status, response) with the body unread."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def handle_chunk(obj, rec, now):
    if "error" in obj:
        err = obj["error"]
        raise RuntimeError(f"error chunk: {err.get('message', err) if isinstance(err, dict) else err}")
    if obj.get("usage"):
        rec["usage_tokens"] = obj["usage"].get("completion_tokens")
        rec["prompt_tokens"] = obj["usage"].get("prompt_tokens")
    for choice in obj.get("choices") or []:
        rec["finish"] = choice.get("finish_reason") or rec["finish"]
        if (choice.get("delta") or {}).get("content"):
            rec["text"] = rec.get("text", "") + choice["delta"]["content"]
            rec["chunks"] += 1
            rec["t_first"] = rec["t_first"] if rec["t_first"] is not None else now
            rec["t_last"] = now


def read_stream(resp, rec, t0):
    """Consumes the SSE body into rec; times are seconds since t0."""
    for raw in resp:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, ": keepalive" comments, event: lines
        data = line[5:].strip()
        if data == "[DONE]":
            rec["done"] = True
            return
        handle_chunk(json.loads(data), rec, time.perf_counter() - t0)
    raise RuntimeError("stream ended without [DONE]")


def one_request(port, body, timeout):
    """One streamed completion, timed; never raises (failures go in 'error')."""
    rec = {"ok": False, "error": None, "chunks": 0, "usage_tokens": None, "prompt_tokens": None,
           "t_first": None, "t_last": None, "e2e": None, "done": False, "finish": None,
           "start_unix": time.time()}
    t0 = time.perf_counter()
    conn = None
    try:
        conn, resp = post_json(port, body, timeout)
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
        read_stream(resp, rec, t0)
        rec["e2e"] = time.perf_counter() - t0
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 -- any failure is counted, not fatal
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if conn is not None:
            conn.close()
    rec["tokens"] = rec["usage_tokens"] if rec["usage_tokens"] is not None else rec["chunks"]
    return rec


def probe_extras(port, timeout):
    """The optional fields this server does not reject (each probed alone)."""
    candidates = {"stream_options": {"include_usage": True}, "ignore_eos": True}
    accepted = {}
    for key, value in candidates.items():
        body = request_body("Say hi.", 2, {key: value})
        rec = one_request(port, body, timeout)
        if rec["ok"]:
            accepted[key] = value
        else:
            print(f"  probe: {key} not accepted ({rec['error'][:120]})", file=sys.stderr)
    return accepted


# --------------------------------------------------------------------- load

def run_level(port, concurrency, n_requests, first_index, args, extras):
    """n_requests streamed requests from `concurrency` threads; records + wall s."""
    n_words = max(8, round(args.prompt_tokens * 0.72))  # ~1.4 tokens/word with the instruction
    bodies = [request_body(make_prompt(first_index + i, n_words), args.max_tokens, extras)
              for i in range(n_requests)]
    records = [None] * n_requests
    next_index = iter(range(n_requests))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            records[i] = one_request(port, bodies[i], args.timeout)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def percentile(values, q):
    """Linear interpolation between closest ranks (q in [0, 100])."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(values):
    return sum(values) / len(values) if values else None


def summarize(records, wall):
    ok = [r for r in records if r["ok"]]
    ttft = [r["t_first"] * 1e3 for r in ok if r["t_first"] is not None]
    itl = [(r["t_last"] - r["t_first"]) * 1e3 / (r["tokens"] - 1) for r in ok
           if r["t_first"] is not None and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in ok)
    usage = [r for r in ok if r["usage_tokens"]]
    return {
        "requests": len(records), "ok": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "wall_s": wall, "completion_tokens": tokens,
        "tok_s": tokens / wall if wall > 0 else None,
        "ttft_mean_ms": mean(ttft), "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
        "itl_mean_ms": mean(itl), "e2e_mean_ms": mean([r["e2e"] * 1e3 for r in ok]),
        "prompt_tokens_mean": mean([r["prompt_tokens"] for r in ok if r["prompt_tokens"]]),
        "tokens_source": "usage" if len(usage) == len(ok) and ok else "content chunks",
        "finish_reasons": {f: sum(r["finish"] == f for r in ok) for f in {r["finish"] for r in ok}},
        "chunks_per_token": (sum(r["chunks"] for r in usage) / sum(r["usage_tokens"] for r in usage))
        if usage else None,
    }


def bench_server(name, server, args):
    """Start-to-stop run of one server: warm-up, probe, every level."""
    result = {"command": " ".join(shlex.quote(c) for c in server.cmd), "levels": {}}
    try:
        server.wait_ready()
        warm = one_request(server.port, request_body(make_prompt(10**6, 20), 8, {}), args.timeout)
        if not warm["ok"]:
            print(f"[{name}] warm-up failed: {warm['error']}", file=sys.stderr)
        result["extras"] = extras = probe_extras(server.port, args.timeout)
        for level_no, c in enumerate(args.levels):
            n = args.requests_per_level or max(2 * c, 4)
            print(f"[{name}] concurrency {c}: {n} requests", file=sys.stderr, flush=True)
            started = time.time()
            records, wall = run_level(server.port, c, n, (level_no + 1) * 10**4, args, extras)
            # A level run twice keeps both (the second as "C#2").
            key = c if c not in result["levels"] else f"{c}#{level_no + 1}"
            result["levels"][key] = {**summarize(records, wall), "started_unix": started, "records": records}
    except Exception as e:  # noqa: BLE001 -- report what was measured so far
        result["fatal"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] aborted: {result['fatal']}", file=sys.stderr)
    finally:
        server.stop()
        result["log"] = server.log.name
    return result


# ------------------------------------------------------------------- report

def fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b else "-"


COLUMNS = ("| server | C | ok/failed | tokens | wall s | tok/s | TTFT mean ms | TTFT p50 ms "
           "| TTFT p90 ms | ITL mean ms | E2E mean ms |")


def level_row(name, c, s):
    return (f"| {name} | {c} | {s['ok']}/{s['failed']} | {s['completion_tokens']} | {fmt(s['wall_s'], 2)} "
            f"| {fmt(s['tok_s'])} | {fmt(s['ttft_mean_ms'])} | {fmt(s['ttft_p50_ms'])} "
            f"| {fmt(s['ttft_p90_ms'])} | {fmt(s['itl_mean_ms'])} | {fmt(s['e2e_mean_ms'])} |")


def ratio_row(c, a, b):
    keys = ("tok_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "itl_mean_ms", "e2e_mean_ms")
    cells = " | ".join(ratio(a[k], b[k]) for k in keys)
    return f"| **mlxcel / mlx_lm** | {c} | | | | {cells} |"


def table(results, levels):
    lines = [COLUMNS, "|" + " --- |" * COLUMNS.count(" |")]
    # Levels in the order run, a repeated one under its "C#N" key.
    keys = [c if c not in levels[:i] else f"{c}#{i + 1}" for i, c in enumerate(levels)]
    for c in keys:
        rows = {name: r["levels"].get(c) for name, r in results.items()}
        for name, s in rows.items():
            if s is not None:
                lines.append(level_row(name, c, s))
        if rows.get("mlxcel") and rows.get("mlx_lm"):
            lines.append(ratio_row(c, rows["mlxcel"], rows["mlx_lm"]))
    return "\n".join(lines)


def server_notes(name, r):
    lines = [f"- {name}: `{r['command']}` (log: {r['log']})"]
    if r.get("extras") is not None:
        sent = ", ".join(f"{k}={json.dumps(v)}" for k, v in r["extras"].items()) or "none"
        lines.append(f"  - optional fields sent: {sent}"
                     + (" (not rejected; honoured only if finish reasons show no 'stop')"
                        if "ignore_eos" in r["extras"] else ""))
    levels = list(r["levels"].values())
    if levels:
        finish = {}
        for s in levels:
            for f, n in s["finish_reasons"].items():
                finish[str(f)] = finish.get(str(f), 0) + n
        lines.append(f"  - completion tokens from: {levels[0]['tokens_source']}; content chunks per "
                     f"token: {fmt(levels[0]['chunks_per_token'], 2)}; mean prompt tokens (with chat "
                     f"template): {fmt(levels[0]['prompt_tokens_mean'])}; finish reasons: "
                     f"{', '.join(f'{f} {n}' for f, n in sorted(finish.items()))}")
    for c, s in r["levels"].items():
        for err in s["errors"]:
            lines.append(f"  - C={c} error ({s['failed']} failed): {err[:300]}")
    if r.get("fatal"):
        lines.append(f"  - aborted: {r['fatal']}")
    return lines


def requests_note(args):
    return str(args.requests_per_level) if args.requests_per_level else "max(2*C, 4)"


def report(results, args, env):
    lines = [
        f"Machine: {env['machine']}",
        f"Versions: {env['versions']['mlxcel']}; {env['versions']['python_mlx']}; "
        f"Python {env['versions']['python']}",
        f"Model: {args.model}; max_tokens {args.max_tokens}; user messages of ~{args.prompt_tokens} "
        f"tokens, distinct; temperature 0; streaming; {requests_note(args)} requests per level",
        "",
        table(results, args.levels),
        "",
        "Ratios are mlxcel / mlx_lm: > 1 is better for tok/s, < 1 is better for latencies. "
        "tok/s = completion tokens / wall time of the level; ITL = per-request decode gap.",
        "",
        "Servers:",
    ]
    for name, r in results.items():
        lines += server_notes(name, r)
    return "\n".join(lines)


def write_json(path, results, args, env):
    out = {"env": env, "args": {k: v for k, v in vars(args).items()}, "servers": results}
    Path(path).write_text(json.dumps(out, indent=2, default=str))


def run_server(name, start, args):
    try:
        server = start(args)
    except (OSError, RuntimeError) as e:
        print(f"[{name}] could not start: {e}", file=sys.stderr)
        return {"command": "-", "levels": {}, "fatal": f"could not start: {e}", "log": "-"}
    return bench_server(name, server, args)


def main():
    args = parse_args()
    env = {"machine": machine(), "versions": versions(args)}
    results = {"mlxcel": run_server("mlxcel", start_mlxcel, args)}
    if not args.skip_mlx_lm:
        results["mlx_lm"] = run_server("mlx_lm", start_mlx_lm, args)
    print(report(results, args, env))
    if args.json:
        write_json(args.json, results, args, env)
    return 1 if any(r.get("fatal") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
