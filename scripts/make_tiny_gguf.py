"""Writes target/tiny-models/{qwen3,llama3_rope}.gguf: tiny random-weight
checkpoints of scripts/make_tiny_models.py as llama.cpp's converter lays
them out (the `gguf` package's writer, llama.cpp's own; metadata keys and
tensor names as convert_hf_to_gguf.py writes them; float32 tensors), so
that tests/family_parity.rs can serve the GGUF files and compare them with
mlx_lm's goldens of the same weights (target/tiny-models/NAME/golden.json).

- qwen3: q/k RMSNorms (`attn_q_norm`, `attn_k_norm`).
- qwen3_moe (`qwen3moe`): a router (`ffn_gate_inp`) and stacked experts
  (`ffn_{gate,up,down}_exps`, `[experts, out, in]` as numpy reads them)
  on layer 0, a dense MLP on layer 1; expert counts in the metadata.
- llama3_rope: Llama 3.1's RoPE scaling as llama.cpp stores it, a
  `rope_freqs` tensor of per-frequency divisors of the rotation angle, and
  llama's q/k rows in ggml's RoPE order (each head's two rotated halves
  interleaved: checkpoint row j*(d/2)+i is GGUF row 2i+j).

    python scripts/make_tiny_gguf.py [TINY_MODELS_DIR]
"""

import math

import json
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# checkpoint name (after model.layers.N.) -> GGUF name (after blk.N.)
LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}
TOP = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, rest = stem[len("model.layers.") :].split(".", 1)
        return f"blk.{layer}.{LAYER[rest]}.{suffix}"
    return f"{TOP[stem]}.{suffix}"


def interleave_halves(w: np.ndarray, heads: int) -> np.ndarray:
    """ggml's row order of a q or k projection: within each head of d
    rows, row j*(d/2)+i moves to 2i+j."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_divisors(config: dict) -> np.ndarray:
    """Llama 3.1's scaling as one divisor per rotated frequency: the
    wavelengths longer than the original context are stretched by
    `factor`, shorter than its 1/high_freq_factor kept, and those between
    blended smoothly (Meta's reference `apply_scaling`)."""
    s = config["rope_scaling"]
    dims = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * config["rope_theta"] ** (i / dims)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write(tiny: Path, name: str, arch: str) -> None:
    src = tiny / name
    config = json.loads((src / "config.json").read_text())
    weights = load_file(str(src / "model.safetensors"))
    if arch == "llama":
        for k in list(weights):
            if k.endswith("self_attn.q_proj.weight"):
                weights[k] = interleave_halves(weights[k], config["num_attention_heads"])
            elif k.endswith("self_attn.k_proj.weight"):
                weights[k] = interleave_halves(weights[k], config["num_key_value_heads"])
    out = tiny / f"{name}.gguf"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{name}")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    if "head_dim" in config:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    if "num_experts" in config:
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for k in sorted(weights):
        w.add_tensor(gguf_name(k), weights[k].astype(np.float32))
    if "rope_scaling" in config:
        w.add_tensor("rope_freqs.weight", rope_divisors(config))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"[tiny-models] {out}: {len(weights)} tensors")


def main() -> None:
    tiny = Path(sys.argv[1] if len(sys.argv) > 1 else "target/tiny-models")
    write(tiny, "qwen3", "qwen3")
    write(tiny, "llama3_rope", "llama")
    write(tiny, "qwen3_moe", "qwen3moe")


if __name__ == "__main__":
    main()
