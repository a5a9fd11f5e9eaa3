#!/usr/bin/env python3
"""Quantized matmul against dequantize-then-dense-matmul, by row count.

  python3 benches/dequant_matmul.py [--dtype bfloat16] [--bits 4] [--group-size 64]

For weight shapes of the models the GPU benches use (Qwen2.5-1.5B's gate/up
(fused), down and q/k/v products, SmolLM2's gate/up and down, gpt-oss-20b's
q projection) and 1 to 2,048 input rows, prints the time of MLX's
`quantized_matmul`, of `dequantize` then `matmul` (what mlxcel's
`--dequant-matmul-rows` does), and of a matmul with a matrix already dense,
each the mean of 20 runs after 3 warm-ups, with the TFLOP/s it reaches.
On a GPU this chose `--dequant-matmul-rows auto` (docs/performance.md).
"""
import argparse
import time

import mlx.core as mx

SHAPES = {
    "qwen2.5-1.5b gate_up": (1536, 17920),
    "qwen2.5-1.5b down": (8960, 1536),
    "qwen2.5-1.5b qkv": (1536, 2048),
    "smollm2 gate_up": (576, 3072),
    "smollm2 down": (1536, 576),
    "gpt-oss-20b q": (2880, 4096),
}
ROWS = (1, 8, 32, 128, 256, 512, 1024, 2048)


def bench(f, n=20):
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
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args()
    dt = getattr(mx, a.dtype)
    q = dict(group_size=a.group_size, bits=a.bits)
    print(f"device {mx.default_device()} mlx {mx.__version__} {a.dtype} {a.bits}-bit g{a.group_size}")
    for name, (k, n) in SHAPES.items():
        w = (mx.random.normal((n, k)) * 0.02).astype(dt)
        wq, s, b = mx.quantize(w, **q)
        wd = mx.dequantize(wq, s, b, **q)
        mx.eval(wq, s, b, wd)
        for m in ROWS:
            x = mx.random.normal((m, k)).astype(dt)
            mx.eval(x)
            tq = bench(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, **q))
            tdq = bench(lambda: x @ mx.dequantize(wq, s, b, **q).T)
            td = bench(lambda: x @ wd.T)
            tf = 2 * m * k * n / 1e9
            print(f"{name:22s} M={m:5d} quantized {tq:7.3f} ms ({tf / tq:6.1f} TF/s)  "
                  f"dequantize+dense {tdq:7.3f} ({tf / tdq:6.1f})  dense {td:7.3f} ({tf / td:6.1f})",
                  flush=True)


if __name__ == "__main__":
    main()
