#!/usr/bin/env python3
"""Random-weight MLX checkpoints of real model shapes, for GPU speed runs
(speed does not depend on the weights' values).

  python3 benches/gpu_models.py NAME OUT_DIR --tokenizer DIR [--group-size 64] [--bits 4]

NAME: smollm2-135m (Llama), smollm2-thin (its 30 layers and vocabulary at a
width of 64: host-bound on a CPU too), qwen2.5-0.5b, qwen2.5-1.5b (Qwen2), gemma3-270m,
qwen3-30b-a3b (Qwen3-MoE: 128 experts, 8 per token), qwen3.5-0.8b and
qwen3.5-35b-a3b (Qwen3.5 hybrids, the latter 256 experts, 8 per token),
qwen3.5-small (a 4-layer Qwen3.5 for CPU and float32 parity runs),
granite-4.0-h-tiny (Granite 4 hybrid: 36 Mamba2 layers, 4 attention, 64
experts, 6 per token) and granite4-small (4 layers, for CPU and float32
parity runs), gpt-oss-20b (32
experts, 4 per token, attention sinks, windows of 128), with the
hyper-parameters of the published checkpoints; qwen3-moe-small, a
Qwen3-MoE of SmolLM2's vocabulary small enough for a CPU (4 layers, 16
experts of 256, 4 per token); gpt-oss-small, the same for gpt-oss (4
layers, 16 experts of 256, 4 per token, windows of 16 keys: shorter than
the parity prompts). Weights come from mlx_lm's
own model classes, quantized with `mlx.nn.quantize`, bfloat16 otherwise;
the tokenizer files are copied from DIR (SmolLM2's tokenizer serves every
shape: only token ids below its vocabulary are used).
"""
import argparse
import json
import shutil
from pathlib import Path

SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    # SmolLM2's 30 layers and vocabulary at a width of 64: a step's
    # arithmetic is negligible even on a CPU, so decode speed measures the
    # host's work a step (kernels encoded, engine and server), the regime a
    # GPU's single-stream decode is in.
    "smollm2-thin": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                         num_hidden_layers=30, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Gemma 3 270M's shape (GeGLU MLP, head size 256, five sliding-window
    # layers to one global).
    "gemma3-270m": dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048,
                        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=256, vocab_size=262144, rope_theta=1000000.0,
                        rope_local_base_freq=10000.0, sliding_window=512,
                        sliding_window_pattern=6, query_pre_attn_scalar=256,
                        max_position_embeddings=32768, rms_norm_eps=1e-6,
                        hidden_activation="gelu_pytorch_tanh"),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
                          norm_topk_prob=True, vocab_size=151936, rope_theta=1000000.0,
                          max_position_embeddings=40960, rms_norm_eps=1e-6,
                          tie_word_embeddings=False),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                        sliding_window=128, vocab_size=201088, rope_theta=150000.0,
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                          beta_slow=1.0, original_max_position_embeddings=4096),
                        max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0,
                        tie_word_embeddings=False),
    "gpt-oss-small": dict(model_type="gpt_oss", hidden_size=512, intermediate_size=256,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64, num_local_experts=16, num_experts_per_tok=4,
                          sliding_window=16, vocab_size=49152, rope_theta=150000.0,
                          rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                            beta_slow=1.0, original_max_position_embeddings=4096),
                          max_position_embeddings=8192, rms_norm_eps=1e-5,
                          tie_word_embeddings=False),
    "qwen3-moe-small": dict(model_type="qwen3_moe", hidden_size=512, intermediate_size=1536,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, num_experts=16, num_experts_per_tok=4,
                            moe_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[],
                            norm_topk_prob=True, vocab_size=49152, rope_theta=1000000.0,
                            max_position_embeddings=8192, rms_norm_eps=1e-6,
                            tie_word_embeddings=True),
    # Qwen3.5 (hybrid: Gated DeltaNet in three of every four layers, gated
    # attention with RoPE over a quarter of each head): sizes as the
    # published checkpoints' training configs give them (the 0.8B's linear
    # attention heads, not given there, as the 35B-A3B's key heads: 16 of
    # 128 for keys and values).
    "qwen3.5-0.8b": dict(model_type="qwen3_5", hidden_size=1024, intermediate_size=3584,
                         num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                         linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_conv_kernel_dim=4, full_attention_interval=4,
                         vocab_size=248320, max_position_embeddings=32768, rms_norm_eps=1e-6,
                         tie_word_embeddings=True,
                         rope_parameters=dict(type="default", rope_theta=10000000.0,
                                              partial_rotary_factor=0.25)),
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe", hidden_size=2048, intermediate_size=512,
                            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128,
                            linear_conv_kernel_dim=4, full_attention_interval=4,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, norm_topk_prob=True,
                            vocab_size=248320, max_position_embeddings=32768, rms_norm_eps=1e-6,
                            tie_word_embeddings=False,
                            rope_parameters=dict(type="default", rope_theta=10000000.0,
                                                 partial_rotary_factor=0.25)),
    # A Qwen3.5 of SmolLM2's vocabulary small enough for a CPU and for
    # float32 parity runs (4 layers: 3 Gated DeltaNet, 1 attention).
    "qwen3.5-small": dict(model_type="qwen3_5", hidden_size=512, intermediate_size=1536,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
                          linear_key_head_dim=64, linear_value_head_dim=64,
                          linear_conv_kernel_dim=4, full_attention_interval=4,
                          vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-6,
                          tie_word_embeddings=True,
                          rope_parameters=dict(type="default", rope_theta=10000000.0,
                                               partial_rotary_factor=0.25)),
    # Granite 4.0-H-Tiny (hybrid MoE: Mamba2 in 36 of 40 layers, attention
    # without position embedding in 4; 64 experts of 512, 6 per token,
    # beside a shared MLP of 1024), as its published config gives it.
    "granite-4.0-h-tiny": dict(model_type="granitemoehybrid", hidden_size=1536,
                               intermediate_size=512, shared_intermediate_size=1024,
                               num_hidden_layers=40, num_attention_heads=12,
                               num_key_value_heads=4,
                               layer_types=["attention" if i in (5, 15, 25, 35) else "mamba"
                                            for i in range(40)],
                               mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128,
                               mamba_n_groups=1, mamba_d_conv=4, mamba_conv_bias=True,
                               mamba_proj_bias=False, num_local_experts=64,
                               num_experts_per_tok=6, position_embedding_type="nope",
                               embedding_multiplier=12.0, attention_multiplier=0.0078125,
                               residual_multiplier=0.22, logits_scaling=6.0,
                               attention_bias=False, vocab_size=100352,
                               max_position_embeddings=131072, rms_norm_eps=1e-5,
                               rope_theta=10000.0, tie_word_embeddings=True),
    # A Granite 4 hybrid of SmolLM2's vocabulary for a CPU and for float32
    # parity runs (4 layers: 3 Mamba2, 1 attention; 8 experts of 256, 2 per
    # token, a shared MLP of 512).
    "granite4-small": dict(model_type="granitemoehybrid", hidden_size=512, intermediate_size=256,
                           shared_intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2,
                           layer_types=["mamba", "attention", "mamba", "mamba"],
                           mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64,
                           mamba_n_groups=1, mamba_d_conv=4, mamba_conv_bias=True,
                           mamba_proj_bias=False, num_local_experts=8, num_experts_per_tok=2,
                           position_embedding_type="nope", embedding_multiplier=12.0,
                           attention_multiplier=0.015625, residual_multiplier=0.22,
                           logits_scaling=6.0, attention_bias=False, vocab_size=49152,
                           max_position_embeddings=8192, rms_norm_eps=1e-5,
                           rope_theta=10000.0, tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--bits", type=int, default=4, help="0: not quantized")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    cfg = dict(SHAPES[args.name])
    cfg.update(architectures=["RandomWeights"], bos_token_id=1, eos_token_id=2,
               torch_dtype=args.dtype, hidden_act="silu")
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(cfg))
    # gpt-oss's sinks start at 0 in mlx_lm: give them values of the size
    # trained ones have, so that a parity run exercises them.
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and "sinks" in attn:
            attn.sinks = mx.random.uniform(-1.0, 3.0, attn.sinks.shape)
    model.set_dtype(getattr(mx, args.dtype))
    if args.bits:
        nn.quantize(model, group_size=args.group_size, bits=args.bits)
        cfg["quantization"] = {"group_size": args.group_size, "bits": args.bits}
    # Layer by layer: a 30B model's float32 initial values never all live
    # at once.
    for layer in model.layers:
        mx.eval(layer.parameters())
    args.out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(args.out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        if (args.tokenizer / name).exists():
            shutil.copy(args.tokenizer / name, args.out / name)
    print(f"made {args.name} in {args.out}: {sum(v.nbytes for v in weights.values()) / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
