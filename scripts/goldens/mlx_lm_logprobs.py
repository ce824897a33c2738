#!/usr/bin/env python3
"""Reference log-probabilities (mlx-lm's `generate_step`, which yields each
token with the log-softmax of its logits) for greedy answers on the fixture
SmolLM2 directory, dense f32 on CPU as the daemon computes there. Written
to tests/fixtures/reference/smollm2-mlx-logprobs.json (tests need no Python).

Usage: mlx_lm_logprobs.py FIXTURES_DIR OUT_DIR
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]
MAX_TOKENS = 24
TOP = 5


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    hashes = json.loads((fixtures / "hashes.json").read_text())
    model, tokenizer = load(str(fixtures / "smollm2-mlx"))
    model = dequantize_model(model)
    cases = []
    for messages in PROMPTS:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        steps = []
        for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
            token = int(token)
            if token in tokenizer.eos_token_ids:
                break
            top = mx.argsort(-logprobs)[:TOP].tolist()
            steps.append({"id": token, "logprob": logprobs[token].item(),
                          "top": [[i, logprobs[i].item()] for i in top]})
        cases.append({"messages": messages, "steps": steps})
        print(repr(tokenizer.decode([s["id"] for s in steps]))[:80])
    result = {"model": "smollm2-mlx", "weights_sha256": hashes["smollm2-mlx"], "top": TOP,
              "reference": f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, dense f32, CPU", "cases": cases}
    (out / "smollm2-mlx-logprobs.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
