"""Greedy replies of a running mlxcel-server against mlx_lm's greedy tokens
(a golden: [{"prompt": [ids], "greedy": [ids]}, ...], as
scripts/prepare_real_models.py records them): each prompt's ids go to
/v1/completions (temperature 0), the golden's tokens through /detokenize,
and the two texts are compared, with the length of their common prefix
in characters. Used on the GPU device for the Gemma 3 GGUF served
directly (bfloat16, --quantize auto), whose golden is float32: a long
common prefix, not equality, is what to expect there.

    python3 benches/gguf_gpu_check.py PORT GOLDEN.json
"""

import json
import sys
import urllib.request


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def main():
    port, golden = int(sys.argv[1]), json.load(open(sys.argv[2]))
    for case in golden:
        want = post(port, "/detokenize", {"tokens": case["greedy"]})["prompt"]
        got = post(
            port,
            "/v1/completions",
            {"prompt": case["prompt"], "max_tokens": len(case["greedy"]), "temperature": 0},
        )["choices"][0]["text"]
        common = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        print(
            f"prompt {len(case['prompt'])} tokens: equal={got == want} "
            f"common_prefix={common}/{len(want)} chars\n  want {want!r}\n  got  {got!r}"
        )


if __name__ == "__main__":
    main()
