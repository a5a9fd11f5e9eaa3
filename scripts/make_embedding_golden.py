#!/usr/bin/env python3
"""Reference embeddings of the test model for `--embeddings`
(tests/server_e2e.rs): tests/goldens/smollm2_embeddings.json.

    .venv/bin/python scripts/make_embedding_golden.py [MODEL_DIR] [OUT]

For each text below, mlx_lm loads the checkpoint (float32, as on a CPU),
the text is encoded as the server encodes an embedding input (the
tokenizer's special tokens added, ``tokenizer.encode(text)``), and the bare
decoder runs it without a cache (``model.model(ids)``: the final hidden
states after the final norm, no LM head). The last token's state,
L2-normalised, is what ``mlxcel-server --embeddings`` answers. The file
records the ids, the vectors, the mlx and mlx_lm versions and this script.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEXTS = [
    "The capital of France is Paris.",
    "Embeddings map text to vectors.",
    "def add(a, b):\n    return a + b\n",
]


def unit(v: mx.array) -> list[float]:
    return (v / mx.linalg.norm(v)).tolist()


def main() -> None:
    model_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "models" / "SmolLM2-135M-Instruct"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else REPO / "tests" / "goldens" / "smollm2_embeddings.json"
    model, tokenizer = mlx_lm.load(str(model_dir))
    model.set_dtype(mx.float32)
    cases = []
    for text in TEXTS:
        ids = tokenizer.encode(text)
        hidden = model.model(mx.array([ids]))[0].astype(mx.float32)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "last": unit(hidden[-1]),
            }
        )
    golden = {
        "model": model_dir.name,
        "made_by": "scripts/make_embedding_golden.py",
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "pooling": "last token, L2-normalised, final hidden state after the final norm",
        "cases": cases,
    }
    out.write_text(json.dumps(golden) + "\n")
    print(f"wrote {out}: {len(cases)} texts, {len(cases[0]['last'])} dimensions")


if __name__ == "__main__":
    main()
