#!/usr/bin/env python3
"""What single MLX operations cost on this device: the facts behind the
engine's step design (docs/performance.md).

  python3 benches/gpu_probe.py [--json OUT]

Each probe prints the first call (which pays kernel compilation or a
library's per-shape plan) and the median of later calls, in ms:
  sdpa:     fused attention of a 512-token prefill chunk over key lengths
            that change by 32 (as chunked prefill produces), causal and with
            an additive mask; and one decode query over 1,024 keys.
  qmm:      4-bit quantized matmul [M, 896] x [896, 4864]ᵀ for row counts M.
  scatter:  put_along_axis of 32 token rows into K/V pools of 64 MiB and
            4 GiB (in place only if MLX donates the pool's buffer).
  gather:   take of 1,024 slots from a pool, against a contiguous slice.
  launch:   a chain of 500 small element-wise ops, per op.
"""
import argparse
import json
import statistics
import time

import mlx.core as mx

BF16 = mx.bfloat16


def timed(fn, repeat=10):
    """First-call ms and the median ms of `repeat` later calls (each evaluated)."""
    t0 = time.perf_counter()
    mx.eval(fn())
    first = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return round(first, 3), round(statistics.median(times), 3)


def probe_sdpa(out):
    h, kvh, d, q_len = 14, 2, 64, 512
    q = mx.random.normal((1, h, q_len, d)).astype(BF16)
    for mode in ("causal", "array"):
        for k_len in (512, 544, 576, 1024, 1056):
            k = mx.random.normal((1, kvh, k_len, d)).astype(BF16)
            v = mx.random.normal((1, kvh, k_len, d)).astype(BF16)
            mask = None
            if mode == "array":
                mask = mx.zeros((1, 1, q_len, k_len), dtype=BF16)
            mx.eval(q, k, v, *( [mask] if mask is not None else []))

            def f():
                if mode == "causal":
                    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

            out[f"sdpa_{mode}_q{q_len}_k{k_len}"] = timed(f)
    qd = mx.random.normal((1, h, 1, d)).astype(BF16)
    k = mx.random.normal((1, kvh, 1024, d)).astype(BF16)
    mx.eval(qd, k)
    out["sdpa_decode_k1024"] = timed(lambda: mx.fast.scaled_dot_product_attention(qd, k, k, scale=0.125))
    mask = mx.zeros((32, 1, 1, 1024), dtype=BF16)
    q32 = mx.random.normal((32, h, 1, d)).astype(BF16)
    k32 = mx.random.normal((32, kvh, 1024, d)).astype(BF16)
    mx.eval(mask, q32, k32)
    out["sdpa_decode32_masked_k1024"] = timed(
        lambda: mx.fast.scaled_dot_product_attention(q32, k32, k32, scale=0.125, mask=mask))
    out["sdpa_decode32_nomask_k1024"] = timed(
        lambda: mx.fast.scaled_dot_product_attention(q32, k32, k32, scale=0.125))


def probe_qmm(out):
    w = mx.random.normal((4864, 896)).astype(BF16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    mx.eval(wq, s, b)
    for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        x = mx.random.normal((1, m, 896)).astype(BF16)
        mx.eval(x)
        out[f"qmm_m{m}"] = timed(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4))


def probe_scatter(out):
    kvh, d = 2, 64
    for mib in (64, 4096):
        slots = mib * (1 << 20) // (kvh * d * 2)
        pool = mx.zeros((slots, kvh, d), dtype=BF16)
        mx.eval(pool)
        idx = mx.arange(0, 32 * 7, 7, dtype=mx.int32).reshape(32, 1, 1)
        new = mx.ones((32, kvh, d), dtype=BF16)
        mx.eval(idx, new)
        times = []
        for i in range(20):
            t0 = time.perf_counter()
            pool = mx.put_along_axis(pool, idx, new, axis=0)
            mx.eval(pool)
            times.append((time.perf_counter() - t0) * 1e3)
        out[f"scatter_32rows_pool{mib}MiB"] = (round(times[0], 3), round(statistics.median(times[1:]), 3))
        del pool


def probe_gather(out):
    kvh, d = 2, 64
    pool = mx.random.normal((65536, kvh, d)).astype(BF16)
    slots = mx.array(list(range(0, 2048, 2)), dtype=mx.int32)
    mx.eval(pool, slots)
    out["gather_take_1024"] = timed(lambda: mx.take(pool, slots, axis=0))
    out["slice_copy_1024"] = timed(lambda: mx.contiguous(pool[:1024]))


def probe_launch(out):
    x = mx.ones((1, 896), dtype=BF16)
    mx.eval(x)

    def chain():
        y = x
        for _ in range(500):
            y = y * 1.0001 + 0.0001
        return y

    first, warm = timed(chain, repeat=5)
    out["launch_chain500_ms"] = (first, warm)
    out["launch_per_op_us"] = round(warm / 1000 * 1e3, 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"mlx": mx.__version__, "device": str(mx.default_device())}
    for probe in (probe_launch, probe_qmm, probe_sdpa, probe_scatter, probe_gather):
        probe(out)
    for k, v in out.items():
        print(f"{k:36} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
