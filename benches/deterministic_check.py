#!/usr/bin/env python3
"""`--deterministic` on a GPU: the same greedy tokens for each prompt alone,
batched, chunked differently, with another KV block size and from the
prefix cache, in bfloat16 on the real SmolLM2 checkpoint; then what it
costs in speed.

  python3 benches/deterministic_check.py --mlxcel target/release/mlxcel \\
      --model models/SmolLM2-135M-Instruct [--tokens 48] [--json OUT]

1. The bfloat16 copy of `benches/gpu_parity.py` (4-bit weights as they
   are, float tensors in bfloat16).
2. The golden chat prompts (tests/goldens/smollm2_greedy.json, token ids),
   greedy, `--ignore-eos`, through `mlxcel generate --print-token-ids`
   under each configuration below, with and without `--deterministic`.
   The reference is each prompt alone (`--sequential`); the prompts run
   twice in that run, so the second copy resumes from the prefix cache
   (all but its last block) and is compared too.
3. Speed: one long prompt (the README's first 2,500 characters), prefill
   and 128 decode tokens, and 8 of it batched, both modes interleaved.
Exit status 1 when a `--deterministic` configuration differs anywhere.
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benches"))
from gpu_parity import bf16_copy, mlxcel_greedy  # noqa: E402
from load import plain_decode  # noqa: E402

CONFIGS = [
    ("concurrent", []),
    ("concurrent, chunks of 48 padded to tiles of 32", ["--prefill-chunk-size", "48", "--prefill-tile", "32"]),
    ("concurrent, KV blocks of 16", ["--kv-block-size", "16"]),
]


def generate(binary, model, prompts, n, extra):
    """Each prompt's greedy token ids from `mlxcel generate` with `extra`."""
    return mlxcel_greedy(binary, model, prompts, n, False, extra)


def speeds(binary, model, extra):
    prompt = (REPO / "README.md").read_text()[:2500]
    cmd = [binary, "generate", "-m", str(model), "-p", prompt, "-n", "128", "--ignore-eos",
           "--runs", "3", "--no-chat-template", *plain_decode(extra)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"mlxcel failed ({' '.join(extra)}):\n{res.stderr[-3000:]}")
    text = res.stdout + res.stderr
    pre = [float(x) for x in re.findall(r"Prompt: \d+ tokens, ([\d.]+) tokens-per-sec", text)]
    dec = [float(x) for x in re.findall(r"Generation: \d+ tokens, ([\d.]+) tokens-per-sec", text)]
    # The last run of each (the first compiles kernels).
    return {"prefill_tok_s": pre[-1], "decode_tok_s": dec[-1]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlxcel", default=str(REPO / "target" / "release" / "mlxcel"))
    ap.add_argument("--model", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=0, help="only the first N golden prompts (0: all)")
    ap.add_argument("--speed-rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()

    model = bf16_copy(args.model)
    goldens = json.loads((REPO / "tests" / "goldens" / "smollm2_greedy.json").read_text())
    prompts = [c["prompt_ids"] for c in goldens["prompts"][: args.prompts or None]]
    n = len(prompts)
    out, bad = {"tokens": args.tokens, "prompts": n, "modes": {}}, False
    for mode, flag in [("deterministic", ["--deterministic"]), ("default", [])]:
        twice = generate(args.mlxcel, model, prompts + prompts, args.tokens, ["--sequential", *flag])
        alone, warm = twice[:n], twice[n:]
        rows = {"warm (prefix cache) == alone": sum(a == b for a, b in zip(alone, warm))}
        for name, extra in CONFIGS:
            got = generate(args.mlxcel, model, prompts, args.tokens, [*flag, *extra])
            rows[f"{name} == alone"] = sum(a == b for a, b in zip(alone, got))
        out["modes"][mode] = rows
        print(f"{mode}: " + "; ".join(f"{k}: {v}/{n}" for k, v in rows.items()), flush=True)
        if mode == "deterministic":
            bad |= any(v != n for v in rows.values())
    for name, extra in [("single stream", []), ("batch 8", ["--batch", "8"])][: 2 if args.speed_rounds else 0]:
        runs = {"deterministic": [], "default": []}
        for _ in range(args.speed_rounds):
            for mode, flag in [("default", []), ("deterministic", ["--deterministic"])]:
                runs[mode].append(speeds(args.mlxcel, model, [*flag, *extra]))
        out[f"speed {name}"] = runs
        for k in ("prefill_tok_s", "decode_tok_s"):
            d = sorted(r[k] for r in runs["deterministic"])
            b = sorted(r[k] for r in runs["default"])
            print(f"{name} {k}: deterministic {d} vs default {b}: "
                  f"{d[len(d) // 2] / b[len(b) // 2]:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
