#!/usr/bin/env python3
"""Greedy reference continuations ("goldens") from mlx_lm for mlxcel's tests.

For each chat prompt below this records: the messages, the rendered prompt
text (apply_chat_template(..., add_generation_prompt=True, tokenize=False)),
the prompt token ids exactly as mlx_lm's stream_generate tokenizes a string
prompt, up to --max-tokens greedy completion ids (stopping early only at EOS,
which is then recorded and not included in the ids), the decoded completion,
and the top-1/top-2 logit margin at every generated step (its minimum says how
robust the golden is to float rounding: a margin of 1e-3 may flip between
BLAS builds or kernel orders, a margin of 1 will not).

Generation uses mlx_lm.generate.generate_step (what stream_generate uses)
with an argmax sampler, in the checkpoint's dtype (float32).

  .venv/bin/python scripts/make_goldens.py                       # writes tests/goldens/smollm2_greedy.json
  .venv/bin/python scripts/make_goldens.py --blas openblas --out /tmp/g-openblas.json
  .venv/bin/python scripts/make_goldens.py --compare-blas        # runs both BLAS builds and compares

--blas openblas re-executes the script with LD_PRELOAD=<libopenblas.so.0>,
so MLX's CBLAS calls go to OpenBLAS instead of the wheel's reference netlib
BLAS. The BLAS actually mapped into the process is recorded in the header.
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
DEFAULT_OUT = REPO / "tests" / "goldens" / "smollm2_greedy.json"
OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Public-domain prose (Lincoln, Gettysburg Address, 1863) for the long prompt.
GETTYSBURG = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. "
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived "
    "and so dedicated, can long endure. We are met on a great battle-field of that war. We have come "
    "to dedicate a portion of that field, as a final resting place for those who here gave their lives "
    "that that nation might live. It is altogether fitting and proper that we should do this. "
    "But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this "
    "ground. The brave men, living and dead, who struggled here, have consecrated it, far above our "
    "poor power to add or detract. The world will little note, nor long remember what we say here, "
    "but it can never forget what they did here. It is for us the living, rather, to be dedicated here "
    "to the unfinished work which they who fought here have thus far so nobly advanced. It is rather "
    "for us to be here dedicated to the great task remaining before us -- that from these honored dead "
    "we take increased devotion to that cause for which they gave the last full measure of devotion "
    "-- that we here highly resolve that these dead shall not have died in vain -- that this nation, "
    "under God, shall have a new birth of freedom -- and that government of the people, by the people, "
    "for the people, shall not perish from the earth."
)

PROMPTS = [
    ("capital_france", [
        {"role": "user", "content": "What is the capital of France?"}]),
    ("one_word", [
        {"role": "user", "content": "Hello"}]),
    ("long_prose_400", [
        {"role": "user", "content": "Read the following speech and answer the question after it.\n\n"
         + GETTYSBURG + "\n\n"
         "The speech above was given during a war. Which war was it, and what does the speaker ask "
         "the living to do? Answer in two or three sentences, in your own words, and mention the "
         "phrase the speaker uses to describe the kind of government that must not perish."}]),
    ("french_accents", [
        {"role": "user", "content": "Quelle est la différence entre un café crème et un café au lait ? "
         "Réponds en français, s'il te plaît."}]),
    ("chinese", [
        {"role": "user", "content": "请用一句话介绍一下长城。"}]),
    ("emoji", [
        {"role": "user", "content": "What do these emoji usually mean: 🎉 🐍 ☕️ ❤️? One short line each."}]),
    ("code_write", [
        {"role": "user", "content": "Write a Python function `fib(n)` that returns the n-th Fibonacci number iteratively."}]),
    ("code_explain_whitespace", [
        {"role": "user", "content": "Explain what this code does:\n\n```python\ndef f(xs):\n    out = []\n"
         "    for x in xs:\n        if x % 2 == 0:\n            out.append(x * x)\n    return out\n```"}]),
    ("multi_turn", [
        {"role": "system", "content": "You are a concise assistant that answers in one or two sentences."},
        {"role": "user", "content": "I'm planning a trip to Japan in April. What is that season known for?"},
        {"role": "assistant", "content": "April in Japan is famous for cherry blossom season, when parks fill with people holding hanami picnics."},
        {"role": "user", "content": "Which city would you recommend for seeing them, and why?"}]),
    ("custom_system_pirate", [
        {"role": "system", "content": "You are a pirate captain. Always answer like a pirate, with lots of 'Arr!'."},
        {"role": "user", "content": "How do I make a good cup of tea?"}]),
    ("digits_math", [
        {"role": "user", "content": "What is 1234 + 5678? Show the addition step by step."}]),
    ("list_colors", [
        {"role": "user", "content": "List the three primary colors, one per line."}]),
]


def sha256_file(path, bufsize=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(bufsize), b""):
            h.update(b)
    return h.hexdigest()


def find_openblas():
    for c in OPENBLAS_CANDIDATES:
        if os.path.exists(c):
            return c
    return None


def loaded_blas():
    """Which BLAS serves MLX in this process (Linux): 'openblas' if a system/preloaded
    libopenblas is mapped, 'reference' if only the wheel's netlib libblas is.
    numpy's own bundled OpenBLAS (scipy_openblas / numpy.libs, symbols suffixed,
    never used by MLX) is ignored."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "accelerate" if sys.platform == "darwin" else "unknown"
    libs = {line.split()[-1] for line in maps.splitlines() if "blas" in line.lower() and "/" in line}
    libs = {l for l in libs if "numpy" not in l and "scipy_openblas" not in l}
    if any("openblas" in Path(l).name.lower() for l in libs):
        return "openblas"
    if libs:
        return "reference"
    return "unknown"


def reexec_with_blas(blas):
    """Make sure the process runs with the requested BLAS; re-exec if needed."""
    if blas == "default":
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if blas == "openblas":
        if "openblas" in preload:
            return
        lib = find_openblas()
        if lib is None:
            raise SystemExit("[goldens] libopenblas.so.0 not found (apt-get install libopenblas-dev)")
        env = dict(os.environ, LD_PRELOAD=(lib + (" " + preload if preload else "")))
    elif blas == "reference":
        if "openblas" not in preload:
            return
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(p for p in preload.split() if "openblas" not in p)
    else:
        raise SystemExit(f"unknown --blas {blas}")
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def versions():
    from importlib.metadata import version

    out = {}
    for pkg in ("mlx", "mlx-lm", "transformers", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = None
    return out


def prompt_ids_like_mlx_lm(tokenizer, prompt_text):
    # Mirrors mlx_lm.generate.stream_generate for a str prompt.
    add_special_tokens = tokenizer.bos_token is None or not prompt_text.startswith(tokenizer.bos_token)
    return list(tokenizer.encode(prompt_text, add_special_tokens=add_special_tokens))


def generate_one(model, tokenizer, messages, max_tokens):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = prompt_ids_like_mlx_lm(tokenizer, text)
    ids_tmpl = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids_tmpl, "keys"):  # BatchEncoding in transformers 5
        ids_tmpl = ids_tmpl["input_ids"]
    ids_tmpl = list(ids_tmpl)
    eos = set(tokenizer.eos_token_ids)

    out, margins, top1_logprobs = [], [], []
    finish, eos_token = "length", None
    sampler = lambda lp: mx.argmax(lp, axis=-1)  # noqa: E731
    for tok, logprobs in generate_step(mx.array(ids), model, max_tokens=max_tokens, sampler=sampler):
        lp = np.array(logprobs.astype(mx.float32))
        top2 = np.partition(lp, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        top1_logprobs.append(float(top2[1]))
        if int(np.argmax(lp)) != tok:
            raise SystemExit(f"[goldens] sampled {tok} != argmax {int(np.argmax(lp))}")
        if tok in eos:
            finish, eos_token = "stop", tok
            break
        out.append(tok)
    return {
        "messages": messages,
        "prompt_text": text,
        "prompt_ids": ids,
        "prompt_tokens": len(ids),
        "apply_chat_template_ids_equal": ids_tmpl == ids,
        "completion_ids": out,
        "completion_tokens": len(out),
        "completion_text": tokenizer.decode(out),
        "finish_reason": finish,
        "eos_token_id_hit": eos_token,
        # margins/logprobs cover every generated step, including the EOS step if any.
        "min_top2_logit_margin": round(min(margins), 6),
        "argmin_step": int(min(range(len(margins)), key=margins.__getitem__)),
        "step_top2_logit_margins": [round(m, 5) for m in margins],
        "step_top1_logprobs": [round(v, 5) for v in top1_logprobs],
    }


def make(args):
    import mlx.core as mx
    from mlx_lm import load

    model_dir = Path(args.model).resolve()
    t0 = time.time()
    model, tokenizer = load(str(model_dir))
    cfg = json.loads((model_dir / "config.json").read_text())
    header = {
        "description": "greedy (argmax) continuations from mlx_lm generate_step; prompt ids as stream_generate "
                       "tokenizes the rendered chat template; completion excludes the EOS token",
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, os.path.relpath(__file__, REPO)] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": versions(),
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "mlx_device": str(mx.default_device()),
        "blas": loaded_blas(),
        "checkpoint_dir": os.path.relpath(model_dir, REPO) if model_dir.is_relative_to(REPO) else str(model_dir),
        "model_safetensors_sha256": sha256_file(model_dir / "model.safetensors"),
        "quantization": cfg.get("quantization"),
        "dtype": "float32",
        "max_tokens": args.max_tokens,
        "eos_token_ids": sorted(tokenizer.eos_token_ids),
        "bos_token_id": cfg.get("bos_token_id"),
    }
    results = []
    for name, messages in PROMPTS:
        t1 = time.time()
        r = generate_one(model, tokenizer, messages, args.max_tokens)
        results.append({"name": name, **r})
        print(f"[goldens] {name:26s} prompt {r['prompt_tokens']:4d} tok, gen {r['completion_tokens']:2d} "
              f"({r['finish_reason']}), min margin {r['min_top2_logit_margin']:.4f}, {time.time() - t1:5.1f}s: "
              f"{r['completion_text'][:60]!r}", flush=True)
    paris = results[0]
    if args.max_tokens >= 8 and "Paris" not in paris["completion_text"]:
        raise SystemExit(f"[goldens] sanity check failed: no 'Paris' in {paris['completion_text']!r}")
    header["generation_seconds"] = round(time.time() - t0, 1)
    doc = {"header": header, "prompts": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    print(f"[goldens] wrote {out} ({len(results)} prompts, blas={header['blas']}, "
          f"{header['generation_seconds']}s)", flush=True)
    return doc


def compare(a, b, label_a, label_b):
    diffs = 0
    for pa, pb in zip(a["prompts"], b["prompts"]):
        ca, cb = pa["completion_ids"], pb["completion_ids"]
        same = ca == cb and pa["prompt_ids"] == pb["prompt_ids"]
        first = next((i for i, (x, y) in enumerate(zip(ca, cb)) if x != y), None)
        dm = max(abs(x - y) for x, y in zip(pa["step_top2_logit_margins"], pb["step_top2_logit_margins"]))
        print(f"[compare] {pa['name']:26s} {'same' if same else 'DIFFER at step ' + str(first)}"
              f"  min margin {pa['min_top2_logit_margin']:.4f}/{pb['min_top2_logit_margin']:.4f}"
              f"  max |d margin| {dm:.2e}")
        diffs += not same
    print(f"[compare] {label_a} vs {label_b}: {diffs} of {len(a['prompts'])} prompts differ in token ids")
    return diffs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--blas", choices=["default", "reference", "openblas"], default="default",
                    help="default: whatever the environment gives; reference/openblas: re-exec to force it")
    ap.add_argument("--compare-blas", action="store_true",
                    help="generate with reference BLAS (into --out) and with OpenBLAS (into --out with "
                         ".openblas suffix), then compare token ids")
    args = ap.parse_args()

    if args.compare_blas:
        base = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--max-tokens", str(args.max_tokens)]
        out_ob = str(Path(args.out).with_suffix(".openblas.json"))
        for blas, out in (("reference", args.out), ("openblas", out_ob)):
            subprocess.run(base + ["--blas", blas, "--out", out], check=True)
        a = json.loads(Path(args.out).read_text())
        b = json.loads(Path(out_ob).read_text())
        compare(a, b, a["header"]["blas"], b["header"]["blas"])
        return 0

    reexec_with_blas(args.blas)
    make(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
