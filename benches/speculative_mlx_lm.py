#!/usr/bin/env python3
"""mlx_lm's decode speed on the workloads of benches/speculative.py, without
and with its own speculative decoding (`draft_model`, greedy), for the
ratios against mlxcel measured in the same run.

  python3 benches/speculative_mlx_lm.py --model DIR [--draft-model DIR]
      [--max-tokens 128] [--num-draft-tokens 3] [--json OUT]

Each prompt of each workload (edit, summarise, chat) goes through the
model's chat template and `mlx_lm.stream_generate` at temperature 0, once
to warm up and once measured; the decode speed is the tokens after the
first over the time from the first to the last (timed here, as
benches/speculative.py times mlxcel's stream), averaged over the
workload's prompts. One stream only: mlx_lm's
speculative decoding does not batch. With `--draft-model`, each prompt also
runs with that draft, and the share of tokens that came from accepted
drafts is printed.
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speculative  # noqa: E402  (the workloads)


def run(model, tokenizer, prompt, max_tokens, draft=None, draft_tokens=3):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    kwargs = {"max_tokens": max_tokens, "sampler": make_sampler(temp=0.0)}
    if draft is not None:
        kwargs.update(draft_model=draft, num_draft_tokens=draft_tokens)
    tokens, drafted, first, end = [], 0, None, None
    for r in stream_generate(model, tokenizer, text, **kwargs):
        end = time.perf_counter()
        first = first or end
        tokens.append(r.token)
        drafted += int(getattr(r, "from_draft", False))
    # Timed here: mlx_lm's generation_tps counts a draft step's tokens oddly.
    decode = (len(tokens) - 1) / (end - first) if len(tokens) > 1 and end > first else 0.0
    return {"tokens": len(tokens), "decode_tok_s": decode, "from_draft": drafted, "ids": tokens}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--workloads", default="edit,summarise,chat")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from mlx_lm import load

    model, tokenizer = load(args.model)
    draft = load(args.draft_model)[0] if args.draft_model else None
    rows = []
    for name in args.workloads.split(","):
        prompts = speculative.workloads()[name]
        for mode in ["plain"] + (["draft"] if draft is not None else []):
            speeds, drafted, total, ids = [], 0, 0, []
            for p in prompts:
                d = draft if mode == "draft" else None
                run(model, tokenizer, p, args.max_tokens, d, args.num_draft_tokens)  # warm-up
                r = run(model, tokenizer, p, args.max_tokens, d, args.num_draft_tokens)
                speeds.append(r["decode_tok_s"])
                drafted += r["from_draft"]
                total += r["tokens"]
                ids.append(r["ids"])
            row = {"workload": name, "mode": mode, "decode_tok_s": sum(speeds) / len(speeds),
                   "tokens": total, "from_draft": drafted, "ids": ids}
            rows.append(row)
            print(f"mlx_lm {name} {mode}: {row['decode_tok_s']:.1f} tok/s decode "
                  f"({total} tokens, {drafted} from accepted drafts)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "draft_model": args.draft_model,
                                               "max_tokens": args.max_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
