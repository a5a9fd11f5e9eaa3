#!/usr/bin/env python3
"""Prefill and decode tokens/s of `mlxcel generate` and of mlx_lm, same
machine, same checkpoint, same compute dtype (float32 on CPU), one run.

  .venv/bin/python benches/generate.py [--prompt-tokens 512] [--gen-tokens 128] [--runs 3]

mlxcel: `target/release/mlxcel generate --no-chat-template --ignore-eos`, with
its own "Prompt:/Generation:" lines (prefill = forwards over the prompt until
the last logits are evaluated; decode = completion tokens after the first
over the time from the first to the last). mlx_lm: scripts/bench_mlx_lm.py
(timed the same way; see its docstring). Both read the same prompt: N tokens
of the Gettysburg address. Median of --runs runs each. Prints a table and
one JSON line with the ratios (mlxcel / mlx_lm; > 1 means mlxcel is faster).
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_mlx_lm import prompt_ids  # noqa: E402
from load import machine, plain_decode  # noqa: E402


def prompt_text(model_dir, n):
    """The text of bench_mlx_lm's N-token prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.decode(prompt_ids(tok, n))


def run_mlxcel(binary, model_dir, text, gen_tokens, extra):
    cmd = [str(binary), "generate", "-m", str(model_dir), "--no-chat-template", "--ignore-eos",
           "-p", text, "-n", str(gen_tokens), *plain_decode(extra)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={"RUST_LOG": "warn", "PATH": "/usr/bin:/bin"})
    p = re.search(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", out.stderr)
    g = re.search(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", out.stderr)
    if not (p and g):
        raise SystemExit(f"could not parse mlxcel output:\n{out.stderr}")
    return int(p[1]), float(p[2]), int(g[1]), float(g[2])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mlxcel-args", default="", help="extra flags for mlxcel generate, e.g. '--weights quantized'")
    args = ap.parse_args()

    binary = REPO / "target" / "release" / "mlxcel"
    subprocess.run(["cargo", "build", "--release", "--bin", "mlxcel"], cwd=REPO, check=True)
    text = prompt_text(args.model, args.prompt_tokens)
    extra = args.mlxcel_args.split()

    run_mlxcel(binary, args.model, text[:200], 8, extra)  # warm-up (page cache)
    ours = [run_mlxcel(binary, args.model, text, args.gen_tokens, extra) for _ in range(args.runs)]
    ref = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_mlx_lm.py"), "--model", args.model,
         "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
         "--runs", str(args.runs), "--blas", "openblas"],
        capture_output=True, text=True, check=True)
    peer = json.loads(ref.stdout.strip().splitlines()[-1])

    result = {
        "machine": machine(),
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "mlxcel_prefill_tok_s": statistics.median(r[1] for r in ours),
        "mlxcel_decode_tok_s": statistics.median(r[3] for r in ours),
        "mlx_lm_prefill_tok_s": peer["prefill_tok_s"],
        "mlx_lm_decode_tok_s": peer["decode_tok_s"],
        "mlxcel_args": args.mlxcel_args,
    }
    result["prefill_ratio"] = result["mlxcel_prefill_tok_s"] / result["mlx_lm_prefill_tok_s"]
    result["decode_ratio"] = result["mlxcel_decode_tok_s"] / result["mlx_lm_decode_tok_s"]
    print(f"| engine | prefill tok/s ({args.prompt_tokens}-token prompt) | decode tok/s ({args.gen_tokens} tokens) |")
    print("| --- | --- | --- |")
    print(f"| mlxcel | {result['mlxcel_prefill_tok_s']:.1f} | {result['mlxcel_decode_tok_s']:.1f} |")
    print(f"| mlx_lm | {result['mlx_lm_prefill_tok_s']:.1f} | {result['mlx_lm_decode_tok_s']:.1f} |")
    print(f"| ratio | {result['prefill_ratio']:.2f}x | {result['decode_ratio']:.2f}x |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
