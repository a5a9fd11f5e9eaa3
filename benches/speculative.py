#!/usr/bin/env python3
"""Speculative decoding (prompt lookup or a draft model): decode speed with
and without it, same machine, same checkpoint, same run.

  .venv/bin/python benches/speculative.py [--mlxcel-bin PATH] [--model DIR]
      [--concurrency 1,4] [--max-tokens 160] [--rounds 2]
      [--num-speculative-tokens N] [--mlxcel-args "..."] [--json OUT]
      [--temperature T] [--method ngram|draft --draft-model DIR]

Two mlxcel servers are started in turn on the same checkpoint:
`--speculative off` and `--speculative ngram` (or `draft` with
`--draft-model`). Each runs three workloads, streamed chat completions at
temperature 0 (greedy), or at `--temperature T` with a fixed seed per
request (both servers return the same text either way, which
tests/speculative.rs holds them to):

  edit:      a ~40-line Python file and "rename X to Y and print the whole
             code" (the answer is mostly copied from the prompt);
  summarise: a ~400-word article and "summarise it in five bullet points";
  chat:      short open questions (nothing to copy).

Each workload runs single stream and with C clients (--concurrency), each
client sending the workload's prompts in turn, `--rounds` times (the first
round warms the server; only later rounds are measured). Decode speed per
request is (completion tokens - 1) / (last content chunk - first content
chunk); per level it is the completion tokens of all requests over the
level's wall time minus the mean TTFT. Printed as a Markdown table with the
ratio ngram / off, plus the server's acceptance numbers from /metrics.
"""
import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # noqa: E402  (the servers and the SSE client)

REPO = load.REPO

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    count: int


def load_items(path):
    with open(path) as f:
        raw = json.load(f)
    items = []
    for entry in raw:
        items.append(Item(entry["name"], float(entry["price"]), int(entry["count"])))
    return items


def total_price(items, tax_rate):
    subtotal = 0.0
    for item in items:
        subtotal += item.price * item.count
    return round(subtotal * (1 + tax_rate), 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best


def report(items, tax_rate):
    lines = [f"{len(items)} items"]
    for item in items:
        lines.append(f"- {item.name}: {item.count} x {item.price:.2f}")
    lines.append(f"total with tax: {total_price(items, tax_rate):.2f}")
    return "\\n".join(lines)
'''

ARTICLE = " ".join([
    "The city council met on Tuesday to discuss the new public transport plan.",
    "The plan adds three bus lines that connect the northern suburbs to the central station,",
    "extends the tram line to the university campus, and introduces a single ticket valid",
    "for ninety minutes on every bus, tram and ferry in the region.",
    "Council members agreed that the current network leaves large parts of the north without",
    "a direct connection, and that students spend up to an hour a day changing between lines.",
    "The cost of the plan is estimated at 240 million euros over six years, of which the",
    "national government would pay forty percent and the region twenty percent.",
    "The remaining forty percent would come from the city budget, partly financed by a",
    "new parking fee in the city centre, which several shop owners opposed during the",
    "public hearing.",
    "They argued that customers would move to the shopping mall outside the city, where",
    "parking stays free.",
    "The transport department answered that the mall will be served by one of the new bus",
    "lines and that the fee applies only on weekdays between eight in the morning and six",
    "in the evening.",
    "Environmental groups welcomed the plan but asked for more bicycle lanes along the new",
    "tram route and for electric buses from the first day of service.",
    "The department said that the first twenty buses will be electric and that the rest of",
    "the fleet will follow when the new depot with charging stations opens in 2029.",
    "A final vote on the plan is expected next month, after the budget committee has reviewed",
    "the financing and the region has confirmed its share.",
    "If approved, construction of the tram extension would start in the spring, and the new",
    "bus lines would run from the beginning of the next school year.",
] * 2)

CHAT = [
    "What are three good habits for writing maintainable software? Explain each briefly.",
    "Describe how a refrigerator keeps food cold.",
    "Give me some advice for a first trip to the mountains in winter.",
    "Why is the sky blue? Explain it for a ten-year-old.",
]


def workloads():
    return {
        "edit": [
            f"Rename the function `total_price` to `price_with_tax` in this code and print the whole code.\n\n```python\n{CODE}```",
            f"Rename the class `Item` to `Product` everywhere in this code and print the whole code.\n\n```python\n{CODE}```",
        ],
        "summarise": [
            f"Summarise this article in five bullet points, reusing its wording.\n\n{ARTICLE}",
            f"Write a short summary of this article for a newsletter.\n\n{ARTICLE}",
        ],
        "chat": CHAT,
    }


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlxcel-bin", default=str(REPO / "target" / "release" / "mlxcel-server"))
    ap.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2, help="the first round is a warm-up")
    ap.add_argument("--num-speculative-tokens", type=int, default=None)
    ap.add_argument("--mlxcel-args", default="", help="extra flags for both servers")
    ap.add_argument("--workloads", default="edit,summarise,chat")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (each request seeded by its prompt index)")
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    ap.add_argument("--draft-model", default=None, help="the draft of --method draft")
    return ap.parse_args()


def run_level(port, prompts, clients, max_tokens, timeout, temperature=0.0):
    """Every client sends every prompt once (client i starts at prompt i)."""
    records, lock = [], threading.Lock()
    extras = {"stream_options": {"include_usage": True}}

    def client(i):
        for j in range(len(prompts)):
            k = (i + j) % len(prompts)
            seeded = {"temperature": temperature, "seed": k} if temperature > 0 else {}
            body = load.request_body(prompts[k], max_tokens, {**extras, **seeded})
            rec = load.one_request(port, body, timeout)
            rec["prompt"] = (i + j) % len(prompts)
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def metrics(port):
    conn, resp = None, None
    try:
        import http.client
        conn = http.client.HTTPConnection(load.HOST, port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        if conn is not None:
            conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("mlxcel_speculative_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def bench(name, flags, args, levels, loads):
    ns = argparse.Namespace(mlxcel_bin=args.mlxcel_bin, model=args.model,
                            mlxcel_args=f"{args.mlxcel_args} {flags}")
    server = load.start_mlxcel(ns)
    results = {}
    try:
        server.wait_ready()
        for wl, prompts in loads.items():
            for c in levels:
                for r in range(args.rounds):
                    records, wall = run_level(server.port, prompts, c, args.max_tokens, args.timeout,
                                              args.temperature)
                if any(not rec["ok"] for rec in records):
                    bad = [rec["error"] for rec in records if not rec["ok"]]
                    raise RuntimeError(f"{name} {wl} C={c}: failed requests {bad[:2]}")
                tokens = sum(rec["tokens"] for rec in records)
                ttft = sum(rec["t_first"] for rec in records) / len(records)
                per_req = [(rec["tokens"] - 1) / (rec["t_last"] - rec["t_first"])
                           for rec in records if rec["tokens"] > 1 and rec["t_last"] > rec["t_first"]]
                results[(wl, c)] = {
                    "texts": {rec["prompt"]: rec.get("text", "") for rec in records},
                    "tokens": tokens, "wall_s": wall, "ttft_s": ttft,
                    "tok_s": tokens / wall,
                    "decode_tok_s": sum(per_req) / len(per_req) if per_req else 0.0,
                    "finish": sorted({rec["finish"] for rec in records}),
                }
                print(f"  {name} {wl} C={c}: {tokens} tokens in {wall:.1f} s, "
                      f"decode {results[(wl, c)]['decode_tok_s']:.1f} tok/s per request", file=sys.stderr)
        results["metrics"] = metrics(server.port)
    finally:
        server.stop()
    return results


def main():
    args = parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    loads = {k: v for k, v in workloads().items() if k in args.workloads.split(",")}
    method = f"--speculative {args.method}"
    if args.method == "draft":
        if not args.draft_model:
            sys.exit("--method draft needs --draft-model")
        method += f" --draft-model {args.draft_model}"
    if args.num_speculative_tokens:
        method += f" --num-speculative-tokens {args.num_speculative_tokens}"
    off = bench("off", "--speculative off", args, levels, loads)
    on = bench(args.method, method, args, levels, loads)
    sampling = f"temperature {args.temperature}, seeded" if args.temperature > 0 else "greedy"
    print(f"\nmachine: {load.machine()}\nmodel: {args.model}\nmax_tokens {args.max_tokens}, "
          f"{sampling}, rounds {args.rounds} (last measured)\n")
    print(f"| workload | clients | off: decode tok/s per request | {args.method} | ratio | off: tok/s (all) | {args.method} | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    same = total = 0
    for wl in loads:
        for c in levels:
            a, b = off[(wl, c)], on[(wl, c)]
            for k, text in a["texts"].items():
                total += 1
                same += b["texts"].get(k) == text
            r1 = b["decode_tok_s"] / a["decode_tok_s"] if a["decode_tok_s"] else float("nan")
            r2 = b["tok_s"] / a["tok_s"]
            print(f"| {wl} | {c} | {a['decode_tok_s']:.1f} | {b['decode_tok_s']:.1f} | {r1:.2f}x "
                  f"| {a['tok_s']:.1f} | {b['tok_s']:.1f} | {r2:.2f}x |")
            rows.append({"workload": wl, "clients": c, "off": a, args.method: b,
                         "decode_ratio": r1, "throughput_ratio": r2})
    print(f"\nidentical replies with and without speculation: {same} of {total}")
    print(f"\n{args.method} server /metrics:")
    for k, v in sorted(on["metrics"].items()):
        print(f"  {k} {v:g}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": load.machine(), "model": args.model, "max_tokens": args.max_tokens,
            "rounds": args.rounds, "temperature": args.temperature, "method": args.method,
            "draft_model": args.draft_model, "identical_replies": [same, total],
            "rows": rows, "metrics": on["metrics"]}, indent=1))


if __name__ == "__main__":
    main()
