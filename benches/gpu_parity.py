#!/usr/bin/env python3
"""Greedy parity with mlx_lm on a GPU, on the real SmolLM2 checkpoint in
bfloat16, and the batching differential (concurrent == alone) there.

  python3 benches/gpu_parity.py --mlxcel target/release/mlxcel \\
      --model models/SmolLM2-135M-Instruct [--tokens 48] [--json OUT]

1. Writes a bfloat16 copy of the checkpoint next to it (`<dir>-bf16`): the
   4-bit weights as they are, every float tensor (scales, biases, norms)
   cast to bfloat16, `torch_dtype: bfloat16`. Both engines then compute in
   bfloat16 from the same file.
2. mlx_lm: each chat prompt of tests/goldens/smollm2_greedy.json (its
   token ids, as mlx_lm's chat template rendered them), greedy for --tokens tokens (no EOS stop),
   recording every step's top-2 logit margin.
3. mlxcel: the same token ids, greedy, `--ignore-eos`, once one prompt at a
   time (`--sequential`) and once all at once (`--parallel` = their count,
   paged KV, decode rows attended by the paged-attention kernel).
Reports, per prompt, whether mlxcel alone equals mlx_lm and where they
first differ, with mlx_lm's top-2 margin at that step (a near tie of
bfloat16 logits is a rounding difference; a wide margin is a bug), and
whether concurrent equals alone. Exit status 1 when a divergence has a
margin above --max-margin or concurrent differs from alone.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from load import plain_decode  # noqa: E402  (benches/ is the script's directory)

REPO = Path(__file__).resolve().parent.parent


def bf16_copy(src: Path) -> Path:
    import mlx.core as mx

    dst = src.parent / (src.name + "-bf16")
    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            w = mx.load(str(f))
            w = {k: (v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in w.items()}
            mx.save_safetensors(str(dst / f.name), w, metadata={"format": "mlx"})
        elif f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg["torch_dtype"] = "bfloat16"
            (dst / f.name).write_text(json.dumps(cfg, indent=1))
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def mlx_lm_greedy(model_dir: Path, prompts, n):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(model_dir))
    out = []
    for ids in prompts:
        cache = make_prompt_cache(model)
        logits = model(mx.array(ids)[None], cache=cache)[:, -1, :].astype(mx.float32)
        toks, margins = [], []
        for _ in range(n):
            top2 = mx.topk(logits, 2, axis=-1)
            best = int(mx.argmax(logits, axis=-1).item())
            hi, lo = sorted(top2[0].tolist(), reverse=True)
            toks.append(best)
            margins.append(hi - lo)
            logits = model(mx.array([[best]]), cache=cache)[:, -1, :].astype(mx.float32)
        out.append((toks, margins))
    return out


def mlxcel_greedy(binary, model_dir: Path, prompts, n, sequential, extra):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
        path = f.name
    cmd = [binary, "generate", "-m", str(model_dir), "--prompts-file", path, "-n", str(n),
           "--ignore-eos", "--print-token-ids", *plain_decode(extra)]
    if sequential:
        cmd.append("--sequential")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"mlxcel failed:\n{res.stderr[-3000:]}")
    ids = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            ids[d["prompt"]] = d["ids"]
    return [ids[i] for i in range(len(prompts))]


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlxcel", default=str(REPO / "target" / "release" / "mlxcel"))
    ap.add_argument("--model", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--max-margin", type=float, default=0.25,
                    help="largest top-2 logit margin at a divergence still called a near tie")
    ap.add_argument("--prompts", type=int, default=0, help="only the first N golden prompts (0: all)")
    ap.add_argument("--mlxcel-args", default="", help="extra `mlxcel generate` flags")
    ap.add_argument("--keep-dtype", action="store_true",
                    help="run the checkpoint as it is (no bfloat16 copy)")
    ap.add_argument("--json")
    args = ap.parse_args()

    model_dir = args.model if args.keep_dtype else bf16_copy(args.model)
    goldens = json.loads((REPO / "tests" / "goldens" / "smollm2_greedy.json").read_text())
    cases = goldens["prompts"][: args.prompts or None]
    # The goldens' prompt ids are mlx_lm's chat-template rendering.
    prompts = [c["prompt_ids"] for c in cases]
    reference = mlx_lm_greedy(model_dir, prompts, args.tokens)
    extra = args.mlxcel_args.split()
    alone = mlxcel_greedy(args.mlxcel, model_dir, prompts, args.tokens, True, extra)
    together = mlxcel_greedy(args.mlxcel, model_dir, prompts, args.tokens, False, extra)
    rows, bad = [], False
    for c, (ref, margins), a, t in zip(cases, reference, alone, together):
        d = first_diff(ref, a)
        margin = margins[d] if d is not None and d < len(margins) else None
        wide = margin is not None and margin > args.max_margin
        batch_ok = a == t
        bad |= wide or not batch_ok
        rows.append({"prompt": c["name"], "equal_mlx_lm": d is None, "first_diff_step": d,
                     "mlx_lm_top2_margin_there": margin, "concurrent_equals_alone": batch_ok,
                     "concurrent_first_diff": first_diff(a, t)})
    equal = sum(r["equal_mlx_lm"] for r in rows)
    print(f"greedy parity, {'checkpoint dtype' if args.keep_dtype else 'bfloat16'}, {args.tokens} tokens: {equal}/{len(rows)} prompts equal mlx_lm; "
          f"concurrent == alone for {sum(r['concurrent_equals_alone'] for r in rows)}/{len(rows)}")
    for r in rows:
        if not r["equal_mlx_lm"] or not r["concurrent_equals_alone"]:
            print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "tokens": args.tokens}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
