#!/usr/bin/env python3
"""Tiny random-weight checkpoints of every family mlxcel serves, with mlx_lm's
greedy output on them: the reference of the family parity test
(tests/family_parity.rs).

    .venv/bin/python scripts/make_tiny_models.py [OUT_DIR]   (default target/tiny-models)

For each family, mlx_lm's own model class (``mlx_lm.models.<module>``) is
built from a small ``config.json`` (2 layers, hidden size 64, a 256-token
vocabulary, float32), its weights are left at MLX's random initialisation
under a fixed seed, scaled up so that logits are well separated, and saved
as ``model.safetensors``. ``golden.json`` then holds a fixed prompt of token
ids, the last-position logits of the prompt, and 16 greedy tokens, both from
mlx_lm's model with its KV cache (``make_prompt_cache``), as ``mlx_lm
generate`` runs it. No tokenizer is involved: the test feeds token ids.

``llama_chat`` is a Llama with SmolLM2's vocabulary (49152 tokens), whose
tokenizer and chat template files are copied from
``models/SmolLM2-135M-Instruct`` (``setup.sh`` fetches it first): a model
the server can serve, with head counts (4 query, 2 K/V) that split over
two tensor-parallel ranks (tests/tensor_parallel.rs).

``qwen3`` also gets ``embedding.json``: the reference of the embedding
test (tests/embeddings.rs). Its model is loaded back from the saved
``model.safetensors`` and run as mlx_lm runs the bare decoder
(``model.model(inputs)``: final hidden states after the final norm, no
head, no cache), and each prompt of ``EMBED_PROMPTS`` is pooled two ways,
last token and mean over tokens, each L2-normalised (as
sentence-transformers' ``Pooling`` then ``Normalize`` modules do).

Idempotent: a family whose directory already holds a golden made by this
version of the script is skipped.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache

VERSION = 3
VOCAB = 256
GREEDY_TOKENS = 16
PROMPT = [(i * 37 + 11) % VOCAB for i in range(40)]

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}

REPO = Path(__file__).resolve().parent.parent
# Tokenizer, template and generation files a served model needs.
CHAT_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
]
CHAT_SOURCE = REPO / "models" / "SmolLM2-135M-Instruct"

# A tiny gpt-oss: every layer 8 experts of 32 (2 per token, biases,
# clamped SwiGLU), attention sinks, layer 0 a window of 16 keys (shorter
# than the prompt), layer 1 full; YaRN RoPE as gpt-oss configures it.
GPT_OSS = {
    "model_type": "gpt_oss",
    "head_dim": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 32,
    "sliding_window": 16,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "tie_word_embeddings": False,
}

# A tiny Qwen3-MoE: 8 experts of 32, 2 per token, scores renormalised.
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "head_dim": 32,
    "tie_word_embeddings": False,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
}

# A tiny Qwen3.5 (hybrid): 4 layers, Gated DeltaNet in layers 0 and 2,
# gated attention (RoPE over a quarter of each 32-wide head) in 1 and 3;
# the text model's keys nested under `text_config`, as Qwen3.5's
# multimodal checkpoints have them.
QWEN3_5_TEXT = {
    "num_hidden_layers": 4,
    "head_dim": 32,
    "full_attention_interval": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False,
    "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}

# A tiny Granite 4 (hybrid): 4 layers, Mamba2 in 0, 2 and 3 (4 heads of
# 16, state 16, 2 groups sharing B and C, kernel 4 with a bias), attention
# in 1; Granite's multipliers.
GRANITE4 = {
    "model_type": "granitemoehybrid",
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "mamba"],
    "attention_bias": False,
    "embedding_multiplier": 2.0,
    "attention_multiplier": 0.2,
    "residual_multiplier": 0.5,
    "logits_scaling": 1.5,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 2,
    "mamba_d_conv": 4,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "tie_word_embeddings": True,
}

# A tiny Gemma 4 (mlx_lm's `gemma4` class: the text model's keys under
# `text_config`, its weights under `language_model.`): 5 layers, sliding
# (window 16 keys, 16-wide heads, RoPE base 10^4) and full (32-wide heads,
# proportional RoPE over a quarter of each head, base 10^6); the last two
# layers (one of each kind) share the K/V of layers 1 and 2 and have a
# double-wide MLP; per-layer inputs of 8 features; logits soft-capped.
GEMMA4_TEXT = {
    "num_hidden_layers": 5,
    "head_dim": 16,
    "global_head_dim": 32,
    "rms_norm_eps": 1e-6,
    "sliding_window": 16,
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
    "final_logit_softcapping": 30.0,
    "use_double_wide_mlp": True,
    "rope_parameters": {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
}

# name -> (mlx_lm module, config overrides)
FAMILIES = {
    "llama": ("llama", {"model_type": "llama", "tie_word_embeddings": False}),
    "llama3_rope": (
        "llama",
        {
            "model_type": "llama",
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("qwen2", {"model_type": "qwen2", "tie_word_embeddings": True}),
    "qwen3": (
        "qwen3",
        {"model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": False},
    ),
    "granite": (
        "granite",
        {
            "model_type": "granite",
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "embedding_multiplier": 2.0,
            "attention_multiplier": 0.2,
            "residual_multiplier": 0.5,
            "logits_scaling": 1.5,
        },
    ),
    # Fused qkv_proj and gate_up_proj, RoPE over 3/4 of each head.
    "phi3": (
        "phi3",
        {"model_type": "phi3", "tie_word_embeddings": False, "partial_rotary_factor": 0.75},
    ),
    # Norms after each branch; q/k norms over the whole projection.
    "olmo2": (
        "olmo2",
        {"model_type": "olmo2", "tie_word_embeddings": False, "attention_bias": False},
    ),
    # A sliding window (16 keys) smaller than the prompt on one layer, the
    # other global (mlx_lm's llama reads `layer_types`).
    "mistral_window": (
        "llama",
        {
            "model_type": "mistral",
            "tie_word_embeddings": False,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # Gemma 3: a local layer (window 16 < the prompt, its own RoPE base)
    # then a global one; 1 + w norms before and after each branch, GELU.
    "gemma3": (
        "gemma3_text",
        {
            "model_type": "gemma3_text",
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
        },
    ),
    # A servable Llama: SmolLM2's vocabulary and tokenizer, even head counts.
    "llama_chat": (
        "llama",
        {
            "model_type": "llama",
            "tie_word_embeddings": True,
            "vocab_size": 49152,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "max_position_embeddings": 2048,
        },
    ),
    # Mixture of experts: 8 experts, 2 per token (the 40-token prompt
    # routes 80 token-expert pairs, past the 64 from which mlxcel and
    # mlx_lm sort them by expert; decode steps route 2, unsorted).
    # Qwen3-MoE: layer 0 sparse, layer 1 dense (`mlp_only_layers`), top-k
    # scores renormalised.
    "qwen3_moe": ("qwen3_moe", {**QWEN3_MOE, "mlp_only_layers": [1]}),
    # Qwen3-MoE again, 4-bit (group 32), both layers sparse: experts
    # through gather_qmm when kept quantized.
    "qwen3_moe_q4": (
        "qwen3_moe",
        {**QWEN3_MOE, "mlp_only_layers": [], "quantization": {"group_size": 32, "bits": 4}},
    ),
    # Qwen2-MoE: q/k/v biases, a shared expert behind a sigmoid gate.
    "qwen2_moe": (
        "qwen2_moe",
        {
            "model_type": "qwen2_moe",
            "tie_word_embeddings": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    # Mixtral, saved as Hugging Face lays it out: one tensor per expert
    # (`block_sparse_moe.experts.{e}.w1/w3/w2`), stacked by mlxcel at load.
    "mixtral": (
        "mixtral",
        {
            "model_type": "mixtral",
            "tie_word_embeddings": False,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
        },
    ),
    "gpt_oss": ("gpt_oss", GPT_OSS),
    "qwen3_5": ("qwen3_5", {"model_type": "qwen3_5", "text_config": QWEN3_5_TEXT}),
    # Qwen3.5-MoE: every layer sparse (8 experts of 32, 2 per token, scores
    # renormalised), a shared expert of 64 behind a sigmoid gate.
    "qwen3_5_moe": (
        "qwen3_5_moe",
        {
            "model_type": "qwen3_5_moe",
            "text_config": {
                **QWEN3_5_TEXT,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
            },
        },
    ),
    "gemma4": ("gemma4", {"model_type": "gemma4", "vocab_size": VOCAB, "text_config": GEMMA4_TEXT}),
    # Gemma 4 with its sparse block (8 experts of 32, 2 per token) beside
    # each layer's MLP and K-equals-V full layers with one K/V head (the
    # sliding ones have two), as `gemma4_text` (not nested).
    "gemma4_moe": (
        "gemma4_text",
        {
            **GEMMA4_TEXT,
            "model_type": "gemma4_text",
            "enable_moe_block": True,
            "num_experts": 8,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
        },
    ),
    # The same, 4-bit (group 32; per-layer inputs of 32 so that every
    # matrix quantizes): quantized embeddings, per-layer tables and experts.
    "gemma4_moe_q4": (
        "gemma4_text",
        {
            **GEMMA4_TEXT,
            "model_type": "gemma4_text",
            "enable_moe_block": True,
            "num_experts": 8,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "hidden_size_per_layer_input": 32,
            "quantization": {"group_size": 32, "bits": 4},
        },
    ),
    # Granite 4, dense, with RoPE; saved as Hugging Face lays it out (the
    # MLP fused as `shared_mlp.input_linear`, the convolution `[channels,
    # 1, kernel]`).
    "granitemoehybrid": ("granitemoehybrid", GRANITE4),
    # Granite 4 with experts (8 of 32, 2 per token, softmax over the top-k
    # logits) beside a shared MLP of 64 on every layer, and no position
    # embedding (`nope`, as the -h models).
    "granitemoehybrid_moe": (
        "granitemoehybrid",
        {
            **GRANITE4,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "shared_intermediate_size": 64,
            "position_embedding_type": "nope",
        },
    ),
    # gpt-oss, 4-bit (group 32): the experts' biases beside gather_qmm.
    "gpt_oss_q4": ("gpt_oss", {**GPT_OSS, "quantization": {"group_size": 32, "bits": 4}}),
    # Phi-3 again, 4-bit (group 32): fused quantized matrices split at load.
    "phi3_q4": (
        "phi3",
        {
            "model_type": "phi3",
            "tie_word_embeddings": False,
            "partial_rotary_factor": 0.75,
            "quantization": {"group_size": 32, "bits": 4},
        },
    ),
}


def build(module: str, config: dict):
    models = importlib.import_module(f"mlx_lm.models.{module}")
    args = models.ModelArgs.from_dict(config)
    model = models.Model(args)
    # MLX's default init gives near-uniform logits on a 2-layer model; a
    # larger scale separates them, so greedy tokens are not decided by
    # rounding. Vectors (norm weights, biases) are spread around their
    # initial values, so that two norms loaded into each other's places
    # change the output.
    def spread(p):
        if p.ndim >= 2:  # matrices, and stacked experts' matrices
            return p * 4.0
        return p * mx.random.uniform(0.5, 1.5, p.shape) + mx.random.uniform(-0.2, 0.2, p.shape)

    model.update(tree_map(spread, model.parameters()))
    # Attention sinks start at 0 in mlx_lm; against the large scores of
    # these scaled-up weights, sinks of 4 to 10 weigh in each softmax
    # (logits move by ~0.6 without them; below 4 they hardly count).
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and "sinks" in attn:
            attn.sinks = mx.random.uniform(4.0, 10.0, attn.sinks.shape)
    # Gemma 4's embedding, times sqrt(hidden), outweighs its normalized
    # branches by ~30x at this scale: every layer would leave each token's
    # own embedding on top (greedy repeats the last prompt token). Branches
    # 8 times louder let the layers decide.
    if module.startswith("gemma4"):
        for layer in getattr(model, "language_model", model).model.layers:
            for name in ("post_attention_layernorm", "post_feedforward_layernorm",
                         "post_per_layer_input_norm"):
                norm = getattr(layer, name)
                norm.weight = norm.weight * 8.0
    if "quantization" in config:
        q = config["quantization"]
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"])
    mx.eval(model.parameters())
    return model


# Families saved with one tensor per expert (Hugging Face's layout) rather
# than mlx_lm's stacked `switch_mlp`: name -> (gate, up, down) names.
PER_EXPERT = {"mixtral": ("w1", "w3", "w2")}


def per_expert(weights: dict, names: tuple[str, str, str]) -> dict:
    out = {}
    proj = dict(zip(("gate_proj", "up_proj", "down_proj"), names))
    for key, value in weights.items():
        if ".switch_mlp." not in key:
            out[key] = value
            continue
        block, rest = key.split(".switch_mlp.")
        name, suffix = rest.split(".", 1)
        for e in range(value.shape[0]):
            out[f"{block}.experts.{e}.{proj[name]}.{suffix}"] = value[e]
    return out


# Families saved in Hugging Face's layout where mlx_lm's differs.
HF_LAYOUT = {"granitemoehybrid"}


def hf_layout(weights: dict) -> dict:
    """Granite 4's Hugging Face names and layouts: a dense layer's MLP as
    ``shared_mlp.input_linear`` (gate rows, then up rows) and
    ``output_linear``; the Mamba convolution ``[channels, 1, kernel]``."""
    out = {}
    for key, value in weights.items():
        if key.endswith(".mlp.gate_proj.weight"):
            up = weights[key.replace("gate_proj", "up_proj")]
            out[key.replace("mlp.gate_proj", "shared_mlp.input_linear")] = mx.concatenate(
                [value, up], axis=0
            )
        elif key.endswith(".mlp.up_proj.weight"):
            continue
        elif key.endswith(".mlp.down_proj.weight"):
            out[key.replace("mlp.down_proj", "shared_mlp.output_linear")] = value
        elif key.endswith("conv1d.weight"):
            out[key] = mx.contiguous(value.moveaxis(2, 1))
        else:
            out[key] = value
    return out


def greedy(model) -> tuple[list[float], list[int]]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([PROMPT]), cache=cache)[0, -1].astype(mx.float32)
    first = logits.tolist()
    tokens = []
    token = int(mx.argmax(logits).item())
    for _ in range(GREEDY_TOKENS):
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        token = int(mx.argmax(logits).item())
    return first, tokens


EMBED_VERSION = 1
# Token-id prompts of the embedding golden: the family prompt, a short one,
# and one long enough to span several prefill chunks of 16.
EMBED_PROMPTS = [PROMPT, PROMPT[:7], [(i * 53 + 5) % VOCAB for i in range(70)]]


def embedding_golden(d: Path, module: str) -> None:
    """Writes ``embedding.json`` for the checkpoint in ``d`` (see above)."""
    golden = d / "embedding.json"
    if golden.is_file() and json.loads(golden.read_text()).get("version") == EMBED_VERSION:
        return
    config = json.loads((d / "config.json").read_text())
    models = importlib.import_module(f"mlx_lm.models.{module}")
    model = models.Model(models.ModelArgs.from_dict(config))
    model.load_weights(str(d / "model.safetensors"))

    def unit(v):
        return (v / mx.linalg.norm(v)).tolist()

    cases = []
    for prompt in EMBED_PROMPTS:
        hidden = model.model(mx.array([prompt]))[0].astype(mx.float32)
        cases.append(
            {"prompt": prompt, "last": unit(hidden[-1]), "mean": unit(mx.mean(hidden, axis=0))}
        )
    golden.write_text(
        json.dumps({"version": EMBED_VERSION, "mlx_lm_module": module, "cases": cases})
    )
    print(f"[tiny-models] {d.name}: embedding golden of {len(cases)} prompts")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "target/tiny-models")
    for name, (module, overrides) in FAMILIES.items():
        d = out / name
        golden = d / "golden.json"
        if golden.is_file() and json.loads(golden.read_text()).get("version") == VERSION:
            continue
        d.mkdir(parents=True, exist_ok=True)
        mx.random.seed(7)
        config = {**BASE, **overrides}
        if "text_config" in overrides:
            # Nested: the text model's keys under text_config.
            config = {
                **overrides,
                "text_config": {**BASE, **overrides["text_config"]},
            }
        model = build(module, config)
        weights = dict(tree_flatten(model.parameters()))
        if name in PER_EXPERT:
            weights = per_expert(weights, PER_EXPERT[name])
        if name in HF_LAYOUT:
            weights = hf_layout(weights)
        mx.save_safetensors(str(d / "model.safetensors"), weights)
        (d / "config.json").write_text(json.dumps(config, indent=2))
        if config.get("vocab_size") == 49152:
            for f in CHAT_FILES:
                if (CHAT_SOURCE / f).is_file():
                    shutil.copy(CHAT_SOURCE / f, d / f)
        logits, tokens = greedy(model)
        golden.write_text(
            json.dumps(
                {
                    "version": VERSION,
                    "mlx_lm_module": module,
                    "prompt": PROMPT,
                    "last_logits": logits,
                    "greedy": tokens,
                }
            )
        )
        print(f"[tiny-models] {name}: greedy {tokens}")
    embedding_golden(out / "qwen3", FAMILIES["qwen3"][0])


if __name__ == "__main__":
    main()
