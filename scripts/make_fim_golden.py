#!/usr/bin/env python3
"""mlx_lm's greedy fill-in-the-middle answers on the real Qwen2.5-Coder-0.5B
weights: the reference of tests/fim.rs. Writes tests/goldens/qwen_fim.json.

    .venv/bin/python scripts/make_fim_golden.py [MODEL_DIR]   (default models/qwen2.5-coder-0.5b)

MODEL_DIR is what scripts/prepare_real_models.py made: the float32
checkpoint mlx_lm reads and, beside it, the GGUF file mlxcel serves in the
test (the same weights: every tensor of the GGUF decodes to the
checkpoint's values). The tokenizer is transformers' own reading of the
GGUF's vocabulary (`convert_gguf_tokenizer`, with the metadata read by the
`gguf` package), not mlxcel's, so the prompt ids are an independent
reference.

For each case, the prompt is Qwen2.5-Coder's FIM layout,
`<|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>`, with the
repository-level layout of the extra files (`<|repo_name|>project\\n`, then
`<|file_sep|>NAME\\nTEXT\\n` per file, then `<|file_sep|>filename\\n` for the
file being edited) first when a case has them; mlx_lm's
model class generates greedily with its KV cache until an end token (the
GGUF's EOS, `<|endoftext|>`, `<|im_end|>`) or a FIM control token
(`<|fim_*|>`, `<|file_sep|>`, `<|repo_name|>`), at most MAX_TOKENS tokens.
Recorded: the prompt ids, the generated ids (the stop token not included)
and their text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

MAX_TOKENS = 32
REPO = Path(__file__).resolve().parent.parent

CASES = [
    {
        "name": "function_body",
        "prefix": "def fibonacci(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n    ",
        "suffix": "\n\n\nprint(fibonacci(10))\n",
        "extra": [],
    },
    {
        "name": "with_extra_file",
        "prefix": "from geometry import area\n\nprint(",
        "suffix": ")\n",
        "extra": [
            {
                "filename": "geometry.py",
                "text": "def area(width, height):\n    return width * height\n",
            }
        ],
    },
]


def gguf_tokenizer(path: Path):
    """transformers' tokenizer for the GGUF's vocabulary (no torch needed)."""
    import gguf
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = gguf.GGUFReader(str(path))
    metadata = {}
    for key, field in reader.fields.items():
        if not key.startswith(("tokenizer.", "general.architecture")):
            continue
        metadata[key] = field.contents()
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in renames.items()
        if f"tokenizer.{key}" in metadata
    }
    backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    return backend, metadata


def main() -> None:
    model_dir = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "models" / "qwen2.5-coder-0.5b")
    gguf_path = next(model_dir.glob("*.gguf"))
    tok, metadata = gguf_tokenizer(gguf_path)
    special = {
        name: tok.token_to_id(name)
        for name in [
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
            "<|fim_pad|>",
            "<|file_sep|>",
            "<|repo_name|>",
            "<|endoftext|>",
            "<|im_end|>",
        ]
    }
    stops = set(special.values()) | {int(metadata["tokenizer.ggml.eos_token_id"])}

    def text(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    out = {"max_tokens": MAX_TOKENS, "model": str(gguf_path.name), "cases": []}
    for case in CASES:
        ids = []
        if case["extra"]:
            ids += [special["<|repo_name|>"]] + text("project\n")
            for f in case["extra"]:
                ids += [special["<|file_sep|>"]] + text(f"{f['filename']}\n{f['text']}")
                if not f["text"].endswith("\n"):
                    ids += text("\n")
            ids += [special["<|file_sep|>"]] + text("filename\n")
        ids += [special["<|fim_prefix|>"]] + text(case["prefix"])
        ids += [special["<|fim_suffix|>"]] + text(case["suffix"])
        ids += [special["<|fim_middle|>"]]
        cache = make_prompt_cache(model)
        logits = model(mx.array([ids]), cache=cache)[0, -1]
        generated = []
        for _ in range(MAX_TOKENS):
            token = int(mx.argmax(logits).item())
            if token in stops:
                break
            generated.append(token)
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
        answer = tok.decode(generated, skip_special_tokens=True)
        out["cases"].append({**case, "prompt_ids": ids, "generated": generated, "text": answer})
        print(f"[fim-golden] {case['name']}: {len(ids)} prompt tokens -> {answer!r}")
    dest = REPO / "tests" / "goldens" / "qwen_fim.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
