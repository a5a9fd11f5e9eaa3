#!/usr/bin/env python3
"""Greedy reference for serving SmolLM2's GGUF directly (tests/gguf.rs).

The peer: gguf2mlx's float32 conversion of the same GGUF (step 1 of
scripts/prepare_model.py, before that script re-quantizes to MLX 4-bit),
run by mlx_lm. gguf2mlx dequantizes every tensor exactly (Q4_1 and Q8_0
blocks: d * q + m in float32) and undoes llama.cpp's q/k row order, so
mlxcel serving the GGUF with its weights dequantized to float32 runs the
same weights; the converted checkpoint under models/ does not (its 4-bit
re-quantization moved most weights; README.md, "GGUF files").

For each chat prompt this records the prompt token ids (rendered and
tokenized by mlx_lm with models/SmolLM2-135M-Instruct's tokenizer and chat
template, whose pre-tokenizer scripts/prepare_model.py fixed), the 64
largest logits of the prompt's last position (ids and values), and 24
greedy tokens (argmax, EOS not special: generation runs on).

  .venv/bin/python scripts/make_gguf_goldens.py   # writes tests/goldens/smollm2_gguf_f32.json
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

OUT = REPO / "tests" / "goldens" / "smollm2_gguf_f32.json"
TOKENS = 24
TOP = 64
PROMPTS = [
    ("capital", [{"role": "user", "content": "What is the capital of France?"}]),
    ("code", [{"role": "user", "content": "Write a Python function that returns the 10th Fibonacci number."}]),
    ("system", [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?  Explain\n\nbriefly, 2 reasons."},
    ]),
]


def main():
    from prepare_model import default_gguf
    from importlib.metadata import version

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    gguf = default_gguf()
    with tempfile.TemporaryDirectory(dir=REPO / "target") as tmp:
        f32 = Path(tmp) / "f32"
        subprocess.run(
            [sys.executable, "-m", "gguf2mlx", "--input", str(gguf), "--output", str(f32), "--dtype", "float32"],
            check=True,
        )
        model, _ = load(str(f32))
        _, tokenizer = load(str(REPO / "models" / "SmolLM2-135M-Instruct"))
        goldens = []
        for name, messages in PROMPTS:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            cache = make_prompt_cache(model)
            logits = model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32)
            top = mx.argsort(-logits)[:TOP]
            mx.eval(logits, top)
            greedy = []
            step = logits
            for _ in range(TOKENS):
                token = int(mx.argmax(step).item())
                greedy.append(token)
                step = model(mx.array([[token]]), cache=cache)[0, -1]
            goldens.append({
                "name": name,
                "messages": messages,
                "prompt_ids": ids,
                "top_ids": [int(i) for i in top.tolist()],
                "top_logits": [float(logits[int(i)].item()) for i in top.tolist()],
                "greedy": greedy,
                "greedy_text": tokenizer.decode(greedy),
            })
    header = {
        "made_by": "scripts/make_gguf_goldens.py",
        "gguf": gguf.name,
        "peer": "mlx_lm on gguf2mlx --dtype float32 of the GGUF",
        "versions": {p: version(p) for p in ("mlx", "mlx-lm", "gguf2mlx")},
    }
    OUT.write_text(json.dumps({"header": header, "goldens": goldens}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
