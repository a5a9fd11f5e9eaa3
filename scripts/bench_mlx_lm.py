#!/usr/bin/env python3
"""Baseline throughput of mlx_lm on the test checkpoint (for comparing mlxcel).

Prints one JSON line:
  {"engine":"mlx_lm", "prefill_tokens":N, "prefill_tok_s":..., "decode_tokens":M,
   "decode_tok_s":..., "blas":"openblas|reference", ...}

Timing is done here, not taken from stream_generate's GenerationResponse
(its prompt_tps includes the first sampled token plus the dispatch of the
next decode step, and its generation_tps counts n+1 tokens over n intervals):
  prefill: one forward over the N prompt tokens into a fresh KV cache
           (mlx_lm.models.cache.make_prompt_cache), chunked by
           --prefill-step-size like generate_step (default 2048, i.e. one
           chunk for N <= 2048), until the last position's logits and the
           argmax token are evaluated. prefill_tok_s = N / seconds.
  decode:  M single-token greedy steps continuing that cache, pipelined like
           mlx_lm's generate_step (step i+1 is queued with async_eval before
           step i's token is read). decode_tok_s = M / seconds.
Each run starts from a fresh cache. --warmup runs (64-token prompt, 8 tokens) are discarded; the median
of --runs runs is reported (min/max also given).

The prompt is N tokens of a fixed English text (token ids, no chat template),
so it is identical for every engine that reads the same tokenizer.

  .venv/bin/python scripts/bench_mlx_lm.py [--model DIR] [--prompt-tokens 512] [--gen-tokens 128] [--runs 3]
  scripts/bench_mlx_lm.py --blas openblas     # re-execs with LD_PRELOAD=libopenblas.so.0
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_goldens import GETTYSBURG, loaded_blas, reexec_with_blas  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def prompt_ids(tokenizer, n):
    base = tokenizer.encode(GETTYSBURG, add_special_tokens=False)
    ids = []
    while len(ids) < n:
        ids.extend(base)
    return ids[:n]


def one_run(model, ids, gen_tokens, prefill_step_size):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.array(ids)

    t0 = time.perf_counter()
    while prompt.size > prefill_step_size:
        model(prompt[None, :prefill_step_size], cache=cache)
        mx.eval([c.state for c in cache])
        prompt = prompt[prefill_step_size:]
    logits = model(prompt[None], cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)
    t_prefill = time.perf_counter() - t0

    def step(tok):
        return mx.argmax(model(tok.reshape(1, 1), cache=cache)[:, -1, :], axis=-1)

    t0 = time.perf_counter()
    y = step(y)
    mx.async_eval(y)
    for _ in range(gen_tokens - 1):
        nxt = step(y)
        mx.async_eval(nxt)
        y.item()
        y = nxt
    y.item()
    t_decode = time.perf_counter() - t0
    return t_prefill, t_decode


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=0,
                    help="N > 0: decode N copies of the prompt together with mlx_lm's batch_generate "
                         "(no stop tokens) and report its prompt and generation tokens/s instead")
    ap.add_argument("--blas", choices=["default", "reference", "openblas"], default="default",
                    help="default: whatever the environment gives; reference/openblas: re-exec to force it")
    args = ap.parse_args()
    reexec_with_blas(args.blas)

    import mlx.core as mx
    from mlx_lm import load
    from importlib.metadata import version

    model, tokenizer = load(args.model)
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    if args.batch > 0:
        return batch_main(args, model, ids)
    # Warmup: loads weights and touches every kernel; kept short (prefill on
    # MLX's CPU backend is slow) -- it is not part of the measurement.
    for _ in range(args.warmup):
        one_run(model, ids[:min(len(ids), 64)], min(args.gen_tokens, 8), args.prefill_step_size)
    pre, dec = [], []
    for _ in range(args.runs):
        tp, td = one_run(model, ids, args.gen_tokens, args.prefill_step_size)
        pre.append(args.prompt_tokens / tp)
        dec.append(args.gen_tokens / td)
    out = {
        "engine": "mlx_lm",
        "prefill_tokens": args.prompt_tokens,
        "prefill_tok_s": round(statistics.median(pre), 2),
        "decode_tokens": args.gen_tokens,
        "decode_tok_s": round(statistics.median(dec), 2),
        "blas": loaded_blas(),
        "runs": args.runs,
        "prefill_tok_s_min_max": [round(min(pre), 2), round(max(pre), 2)],
        "decode_tok_s_min_max": [round(min(dec), 2), round(max(dec), 2)],
        "model": os.path.relpath(args.model, REPO) if Path(args.model).resolve().is_relative_to(REPO) else args.model,
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "device": str(mx.default_device()),
        "timing": "self-timed: prefill = one forward over N tokens (fresh cache) to evaluated argmax; "
                  "decode = M pipelined greedy steps",
    }
    print(json.dumps(out), flush=True)
    return 0


def batch_main(args, model, ids):
    """mlx_lm's batched decode: `batch_generate` over --batch copies of the
    prompt, no stop tokens; its own prompt/generation tokens-per-second."""
    import mlx.core as mx
    from importlib.metadata import version
    from mlx_lm import batch_generate

    class NoStop:
        eos_token_ids = []

        def decode(self, ids):
            return ""

    def run(n, gen):
        return batch_generate(model, NoStop(), [list(ids)] * n, max_tokens=gen).stats

    run(min(args.batch, 4), 8)  # warm-up, not measured
    stats = [run(args.batch, args.gen_tokens) for _ in range(args.runs)]
    out = {
        "engine": "mlx_lm",
        "batch": args.batch,
        "prefill_tokens": args.prompt_tokens,
        "prompt_tok_s": round(statistics.median(s.prompt_tps for s in stats), 2),
        "decode_tokens": args.gen_tokens,
        "generation_tok_s": round(statistics.median(s.generation_tps for s in stats), 2),
        "runs": args.runs,
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "device": str(mx.default_device()),
        "timing": "mlx_lm BatchStats of batch_generate (prompt_tps, generation_tps)",
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
