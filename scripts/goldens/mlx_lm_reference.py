#!/usr/bin/env python3
"""Greedy token ids from the reference implementation (mlx-lm, pinned in
scripts/test-fixtures) for the test prompts, on the fixture weights.

The daemon computes in dense f32 on CPU (quantized weights dequantized at
load; see docs/benchmarks.md "Compute dtype"), so the reference does the same: mlx-lm's
own `dequantize_model` on the loaded model. Output is committed under
tests/fixtures/reference/ so that tests need no Python.

Usage: mlx_lm_reference.py FIXTURES_DIR OUT_DIR [NAME=MODEL_DIR=SOURCE_SHA256 ...]
The extra models are directories mlxbc-gguf-to-mlx wrote from a GGUF file
(float32), identified by the GGUF's sha256.
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three colors of the rainbow."}],
]
MAX_TOKENS = 40
# A prompt grown to this many tokens on each model's tokenizer, so that decode
# crosses the 256-position boundary where the daemon's KV buffers grow (and
# its compiled decode step is retraced) within the first tokens.
LONG_PROMPT_TOKENS = 250
LONG_WORDS = "the quick brown fox jumps over the lazy dog while".split()


def long_prompt(tokenizer):
    words = []
    while True:
        messages = [{"role": "user", "content": "Continue this text: " + " ".join(words)}]
        if len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)) >= LONG_PROMPT_TOKENS:
            return messages
        words.append(LONG_WORDS[len(words) % len(LONG_WORDS)])


def greedy_ids(model, tokenizer, messages):
    """The templated prompt's ids and mlx-lm's greedy continuation (up to
    MAX_TOKENS, without the end-of-sequence token)."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        token = int(token)
        if token in tokenizer.eos_token_ids:
            break
        ids.append(token)
    return prompt, ids


def reference(model_dir):
    model, tokenizer = load(str(model_dir))
    model = dequantize_model(model)
    cases = []
    for messages in PROMPTS + [long_prompt(tokenizer)]:
        prompt, ids = greedy_ids(model, tokenizer, messages)
        cases.append({"messages": messages, "prompt_ids": list(map(int, prompt)),
                      "max_tokens": MAX_TOKENS, "generated_ids": ids,
                      "text": tokenizer.decode(ids)})
        print(model_dir.name, repr(tokenizer.decode(ids))[:100])
    return cases


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    hashes = json.loads((fixtures / "hashes.json").read_text())
    import mlx_lm
    for name in ("smollm2-mlx", "tiny-qwen2", "tiny-qwen3"):
        result = {"model": name, "weights_sha256": hashes[name],
                  "reference": f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, dense f32, CPU",
                  "cases": reference(fixtures / name)}
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    for extra in sys.argv[3:]:
        name, model_dir, sha = extra.split("=")
        result = {"model": name, "source_gguf_sha256": sha,
                  "reference": f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, dense f32, CPU, "
                               "on the directory mlxbc-gguf-to-mlx wrote from the GGUF",
                  "cases": reference(Path(model_dir))}
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
