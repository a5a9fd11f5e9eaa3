#!/usr/bin/env python3
"""Reference token ids for the SentencePiece tokenizer that mlxcel builds
from Gemma 3's GGUF metadata (tests/gguf_gemma3.rs).

The reference is the tokenizer transformers builds from the same metadata
(its GGUF tokenizer conversion, as `AutoTokenizer.from_pretrained(dir,
gguf_file=...)` does; called directly here because its GGUF reader needs
torch, which the project's environment does not carry). The file
`models/gemma-3-270m` holds no `tokenizer.json` of its own: the GGUF is the
only source of the vocabulary.

For each sample text this records the ids without special tokens (the
metadata's `add_bos_token` puts `<bos>` in front otherwise) and the text
that decoding those ids gives back.

  .venv/bin/python scripts/make_gemma3_tokenizer_golden.py [GEMMA3_DIR]
  # writes tests/goldens/gemma3_gguf_tokenizer.json
"""
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

OUT = REPO / "tests" / "goldens" / "gemma3_gguf_tokenizer.json"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
SAMPLES = [
    "Hello, world!",
    "One, two, three, four,",
    "  two  spaces, three   and a tab\there\n\nnewlines\n\n\n end ",
    " leading space and trailing  ",
    "naïve café — 日本語のテキスト, Ελληνικά, русский",
    "emoji 🙂👍🏽🦩 and rare signs 𓀀𓁐 \U0010fffd",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos<eos>",
    "tab\tand\r\nCRLF ```rust\nfn main() { println!(\"hi\"); }\n```",
    "Prices: 12345 and 3.14159, 2024-06-01 <b>bold</b>",
    "▁ a literal lower one eighth block",
    "",
]


def main() -> None:
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "models" / "gemma-3-270m"
    from gguf import GGUFReader
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    reader = GGUFReader(str(directory / GGUF_NAME))

    def field(key):
        return reader.fields[key].contents()

    metadata = {
        "tokenizer_type": field("tokenizer.ggml.model"),
        "pre_tokenizer_type": field("tokenizer.ggml.pre"),
        "tokens": field("tokenizer.ggml.tokens"),
        "scores": field("tokenizer.ggml.scores"),
        "token_type": field("tokenizer.ggml.token_type"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "unk_token_id": field("tokenizer.ggml.unknown_token_id"),
        "pad_token_id": field("tokenizer.ggml.padding_token_id"),
        "add_prefix_space": field("tokenizer.ggml.add_space_prefix"),
    }
    tokenizer, _ = convert_gguf_tokenizer(field("general.architecture"), metadata)
    samples = []
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        samples.append(
            {
                "text": text,
                "ids": ids,
                "decoded": tokenizer.decode(ids, skip_special_tokens=False),
            }
        )
        print(repr(text), tokenizer.encode(text, add_special_tokens=False).tokens)
    respelled = {i: tokenizer.id_to_token(i) for i in range(136, 170)}
    OUT.write_text(
        json.dumps({"samples": samples, "id_to_token": respelled}, ensure_ascii=False, indent=1) + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
