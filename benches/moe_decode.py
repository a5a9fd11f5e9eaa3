#!/usr/bin/env python3
"""Mixture-of-experts products of decode steps (few tokens), by strategy.

  python3 benches/moe_decode.py [--dtype bfloat16] [--bits 4] [--group-size 64]

For the expert projections of gpt-oss-20b (32 experts, 4 per token, 2,880
-> 2,880) and Qwen3-30B-A3B (128 experts, 8 per token, gate 2,048 -> 768
and down 768 -> 2,048) and 1 to 32 tokens routed at random, times one
expert projection of every token-expert pair ("pairs"):

- `gather_qmm`: MLX's gathered quantized matmul as mlxcel and mlx_lm call
  it (the pairs sorted by expert from 64 on);
- `gemv <= N`: the same kernel called on runs of at most N pairs, their
  outputs concatenated (MLX's CUDA backend takes its gathered GEMV kernel
  for fewer than 8 output rows in all and a tiled GEMM kernel otherwise,
  so this asks whether the GEMV kernel would serve decode steps better);
- `take + dequantize`: each pair's expert gathered, dequantized and
  multiplied densely (a temporary of `pairs x out x in`).

Each line is one call's time, in µs: `--layers` independent calls (one
per layer of a step) are built and evaluated together, 10 times after 3
warm-ups, so launch and sync costs are shared as in a forward.

Measured on an H100 (2026-12-08,
`benches/results/2026-12-08-moe-end-to-end-h100.md`): from 8 pairs on
the runs lose or tie (below 8 all columns make the same one call), so
mlxcel keeps the single `gather_qmm` call.
"""
import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_prefill import quantized_experts  # noqa: E402

SHAPES = {
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "qwen3-30b-a3b gate": (128, 8, 2048, 768),
    "qwen3-30b-a3b down": (128, 8, 768, 2048),
}
TOKENS = (1, 2, 4, 8, 16, 32)
SORT_FROM_PAIRS = 64


def bench(f, layers, n=10):
    def run():
        mx.eval([f(i) for i in range(layers)])

    for _ in range(3):
        run()
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        run()
    mx.synchronize()
    return (time.perf_counter() - t) / n / layers * 1e6


def runs(pairs, most):
    """Balanced runs of at most `most` pairs: [(start, stop), ...]."""
    count = -(-pairs // most)
    base, extra = divmod(pairs, count)
    out, at = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        out.append((at, at + size))
        at += size
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="one small shape (a check on a CPU)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=24)
    a = ap.parse_args()
    dt = getattr(mx, a.dtype)
    q = dict(group_size=a.group_size, bits=a.bits)
    print(f"device {mx.default_device()} mlx {mx.__version__} {a.dtype} {a.bits}-bit "
          f"g{a.group_size}, {a.layers} calls a step")
    shapes = {"tiny": (8, 2, 256, 128)} if a.tiny else SHAPES
    for name, (experts, k, hidden, width) in shapes.items():
        wq, s, b = quantized_experts(experts, width, hidden, dt, q)
        for t in TOKENS:
            pairs = t * k
            xs = [mx.random.normal((t, hidden)).astype(dt) for _ in range(a.layers)]
            inds = [mx.random.randint(0, experts, (t, k)).astype(mx.uint32)
                    for _ in range(a.layers)]
            flat = [i.reshape(-1) for i in inds]
            order = [mx.argsort(f) for f in flat]
            sorted_x = [x[o // k][:, None, :] for x, o in zip(xs, order)]
            sorted_i = [f[o] for f, o in zip(flat, order)]
            pair_x = [mx.repeat(x, k, axis=0)[:, None, :] for x in xs]
            mx.eval(xs, inds, sorted_x, sorted_i, pair_x)

            def gather(i):
                if pairs >= SORT_FROM_PAIRS:
                    return mx.gather_qmm(sorted_x[i], wq, s, b, rhs_indices=sorted_i[i],
                                         transpose=True, sorted_indices=True, **q)
                return mx.gather_qmm(xs[i][:, None, None, :], wq, s, b, rhs_indices=inds[i],
                                     transpose=True, **q)

            def gemv(most):
                def f(i):
                    parts = [mx.gather_qmm(pair_x[i][lo:hi], wq, s, b,
                                           rhs_indices=flat[i][lo:hi], transpose=True, **q)
                             for lo, hi in runs(pairs, most)]
                    return parts[0] if len(parts) == 1 else mx.concatenate(parts, 0)
                return f

            def take_dequantize(i):
                e = flat[i]
                wd = mx.dequantize(wq[e], s[e], b[e], **q)
                return pair_x[i] @ wd.swapaxes(-1, -2)

            row = [("gather_qmm", gather), ("gemv <= 7", gemv(7)), ("gemv <= 4", gemv(4)),
                   ("take + dequantize", take_dequantize)]
            out = [f"{label} {bench(f, a.layers):8.1f}" for label, f in row]
            print(f"{name:19s} tokens {t:3d} pairs {pairs:4d} | " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
