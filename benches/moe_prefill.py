#!/usr/bin/env python3
"""Mixture-of-experts products over many tokens, by strategy.

  python3 benches/moe_prefill.py [--dtype bfloat16] [--bits 4] [--group-size 64]

For the expert shapes of gpt-oss-20b (32 experts, 4 per token, hidden and
expert width 2,880) and Qwen3-30B-A3B (128 experts, 8 per token, hidden
2,048, expert width 768) and 16 to 2,048 tokens routed at random, times one
expert projection (hidden -> width) of every token-expert pair:

- `gather_qmm sorted`: MLX's gathered quantized matmul over the pairs sorted
  by expert (what mlxcel and mlx_lm run from 64 pairs on);
- `gather_qmm`: the same unsorted;
- `dequantize + gather_mm`: every expert dequantized for the product, then
  the dense gathered matmul over the sorted pairs;
- `per expert, quantized` / `per expert, dequantized`: one `quantized_matmul`
  (or dequantize + `matmul`) per expert on its run of sorted rows, the runs'
  bounds read on the host first (the read is timed too).

Each is the mean of 10 runs after 3 warm-ups, with the TFLOP/s it reaches.
"""
import argparse
import time

import mlx.core as mx
import numpy as np

SHAPES = {
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}
TOKENS = (16, 64, 256, 1024, 2048)


def quantized_experts(experts, width, hidden, dtype, q):
    """Random expert weights `[experts, width, hidden]` of `dtype`,
    quantized by `q` (group size and bits), evaluated: (w, scales, biases)."""
    w = (mx.random.normal((experts, width, hidden)) * 0.02).astype(dtype)
    wq, s, b = mx.quantize(w, **q)
    del w
    mx.eval(wq, s, b)
    return wq, s, b


def bench(f, n=10):
    for _ in range(3):
        mx.eval(f())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="one small shape (a check on a CPU)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args()
    dt = getattr(mx, a.dtype)
    q = dict(group_size=a.group_size, bits=a.bits)
    print(f"device {mx.default_device()} mlx {mx.__version__} {a.dtype} {a.bits}-bit g{a.group_size}")
    shapes = {"tiny": (8, 2, 256, 128)} if a.tiny else SHAPES
    for name, (experts, k, hidden, width) in shapes.items():
        wq, s, b = quantized_experts(experts, width, hidden, dt, q)
        for t in TOKENS:
            x = mx.random.normal((t, hidden)).astype(dt)
            inds = mx.random.randint(0, experts, (t, k)).astype(mx.uint32)
            flat = inds.reshape(-1)
            order = mx.argsort(flat)
            xs = x[order // k][:, None, :]
            si = flat[order]
            mx.eval(x, inds, xs, si)

            def qmm_sorted():
                return mx.gather_qmm(xs, wq, s, b, rhs_indices=si, transpose=True,
                                     sorted_indices=True, **q)

            def qmm():
                return mx.gather_qmm(x[:, None, None, :], wq, s, b, rhs_indices=inds,
                                     transpose=True, **q)

            def dq_mm():
                wd = mx.dequantize(wq, s, b, **q)
                return mx.gather_mm(xs, wd.swapaxes(-1, -2), rhs_indices=si, sorted_indices=True)

            def bounds():
                counts = np.bincount(np.array(si), minlength=experts)
                return np.concatenate([[0], np.cumsum(counts)])

            def per_expert(dequantized):
                def f():
                    ends = bounds()
                    xf = xs.reshape(-1, hidden)
                    ys = []
                    for e in range(experts):
                        lo, hi = int(ends[e]), int(ends[e + 1])
                        if lo == hi:
                            continue
                        if dequantized:
                            we = mx.dequantize(wq[e], s[e], b[e], **q)
                            ys.append(xf[lo:hi] @ we.T)
                        else:
                            ys.append(mx.quantized_matmul(xf[lo:hi], wq[e], s[e], b[e],
                                                          transpose=True, **q))
                    return mx.concatenate(ys, 0)
                return f

            tf = 2 * t * k * hidden * width / 1e9
            row = [("gather_qmm sorted", qmm_sorted), ("gather_qmm", qmm),
                   ("dequantize + gather_mm", dq_mm), ("per expert, quantized", per_expert(False)),
                   ("per expert, dequantized", per_expert(True))]
            out = []
            for label, f in row:
                ms = bench(f)
                out.append(f"{label} {ms:8.3f} ms ({tf / ms:6.1f} TF/s)")
            print(f"{name:14s} T={t:5d} " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
