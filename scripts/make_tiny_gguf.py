"""Writes target/tiny-models/qwen3.gguf: the tiny random-weight Qwen3 of
scripts/make_tiny_models.py as llama.cpp's converter lays it out (the
`gguf` package's writer, llama.cpp's own; metadata keys and tensor names as
convert_hf_to_gguf.py writes them for Qwen3; float32 tensors), so that
tests/gguf.rs can serve a `qwen3` GGUF and compare it with mlx_lm's golden
of the same weights (target/tiny-models/qwen3/golden.json).

    python scripts/make_tiny_gguf.py [TINY_MODELS_DIR]
"""

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


def main() -> None:
    tiny = Path(sys.argv[1] if len(sys.argv) > 1 else "target/tiny-models")
    src = tiny / "qwen3"
    config = json.loads((src / "config.json").read_text())
    weights = load_file(str(src / "model.safetensors"))
    out = tiny / "qwen3.gguf"
    w = gguf.GGUFWriter(str(out), "qwen3")
    w.add_name("tiny-qwen3")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name in sorted(weights):
        w.add_tensor(gguf_name(name), weights[name].astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"[tiny-models] {out}: {len(weights)} tensors")


if __name__ == "__main__":
    main()
