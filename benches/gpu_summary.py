#!/usr/bin/env python3
"""Turns a benches/gpu_bench.sh log into the README's GPU table (Markdown,
ratios mlxcel / mlx_lm) and a JSON file of the numbers.

  python3 benches/gpu_summary.py gpu.log [--json benches/results/gpu-DATE.json]

mlxcel's figure for a case is the median over its runs in one process
(each run's prefill and decode speed as `mlxcel generate` prints them);
mlx_lm's is its script's median. Serving tables are copied as load.py
printed them.
"""
import argparse
import json
import re
import statistics
import sys

HEADER = re.compile(r"^### (\S+) (single|batch32|serve)(?: pt=(\d+))?(?: (mlxcel|mlx_lm))?")
PROMPT = re.compile(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec")
GEN = re.compile(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec")
WARM = re.compile(r"warm-up done.*seconds=([\d.]+)")


def parse(lines):
    meta, cases, block = {}, {}, None
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith("### machine"):
            parts = line.split()
            meta = {"machine": " ".join(parts[2:parts.index("commit")]) if "commit" in parts else "",
                    "commit": parts[parts.index("commit") + 1] if "commit" in parts else "",
                    "date": parts[-1]}
            continue
        m = HEADER.match(line)
        if m:
            model, case, pt, engine = m.groups()
            block = cases.setdefault((model, case, pt), {}).setdefault(engine or "table", {"lines": []})
            continue
        if block is None:
            continue
        block["lines"].append(line)
    return meta, cases


def mlxcel_numbers(lines):
    pre = [float(m.group(2)) for l in lines if (m := PROMPT.search(l))]
    gen = [float(m.group(2)) for l in lines if (m := GEN.search(l))]
    warm = [float(m.group(1)) for l in lines if (m := WARM.search(l))]
    out = {}
    if pre:
        out["prefill_tok_s"] = round(statistics.median(pre), 1)
        out["prefill_runs"] = pre
    if gen:
        out["decode_tok_s"] = round(statistics.median(gen), 1)
        out["decode_runs"] = gen
    if warm:
        out["warmup_s"] = warm[0]
    return out


def mlx_lm_numbers(lines):
    for l in reversed(lines):
        if l.startswith("{"):
            d = json.loads(l)
            if "batch" in d:
                return {"prefill_tok_s": d["prompt_tok_s"], "decode_tok_s": d["generation_tok_s"]}
            return {"prefill_tok_s": d["prefill_tok_s"], "decode_tok_s": d["decode_tok_s"]}
    return {}


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--json")
    args = ap.parse_args()
    with open(args.log) as f:
        meta, cases = parse(f)
    results = {"meta": meta, "cases": []}
    print(f"{meta.get('machine', '?')}, commit {meta.get('commit', '?')}, {meta.get('date', '?')}\n")
    print("| shape | case | mlxcel prefill tok/s | mlx_lm prefill tok/s | ratio | mlxcel decode tok/s | mlx_lm decode tok/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (model, case, pt), engines in cases.items():
        if case == "serve":
            continue
        ours = mlxcel_numbers(engines.get("mlxcel", {}).get("lines", []))
        theirs = mlx_lm_numbers(engines.get("mlx_lm", {}).get("lines", []))
        if case == "batch32":
            # The case measures batched decode; the two engines' prompt
            # rates for a batch are not timed alike.
            ours.pop("prefill_tok_s", None)
            theirs.pop("prefill_tok_s", None)
        label = f"{'one request' if case == 'single' else '32 rows'}, {pt}-token prompt"
        print(f"| {model} | {label} | {ours.get('prefill_tok_s', '-')} | {theirs.get('prefill_tok_s', '-')} | "
              f"{ratio(ours.get('prefill_tok_s'), theirs.get('prefill_tok_s'))} | {ours.get('decode_tok_s', '-')} | "
              f"{theirs.get('decode_tok_s', '-')} | {ratio(ours.get('decode_tok_s'), theirs.get('decode_tok_s'))} |")
        results["cases"].append({"model": model, "case": case, "prompt_tokens": int(pt) if pt else None,
                                 "mlxcel": ours, "mlx_lm": theirs})
    for (model, case, _), engines in cases.items():
        if case == "serve":
            table = [l for l in engines.get("table", {}).get("lines", []) if l.startswith("|")]
            print(f"\nServing, {model}:\n")
            print("\n".join(table))
            results["cases"].append({"model": model, "case": "serve", "table": table})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
