#!/usr/bin/env python3
"""Greedy token ids on the GPU: mlxbcd (through `mlxbc ask --json`) against
mlx-lm on the same arrays (the directory mlxbc-gguf-to-mlx wrote from the
same GGUF, packed weights with f16 floats: the daemon's GPU form).

The CPU suite's goldens (tests/fixtures/reference/*.json) are dense-f32 ids;
on the GPU both sides compute in f16 with packed weights, so the reference is
computed here, on the device, with the pinned mlx-lm. Same prompts as
scripts/reference/mlx_lm_reference.py (the single-turn ones, plus one grown
to 250 tokens so that decode crosses the daemon's KV buffer growth).

Usage: check_ids.py MLXBC_BINARY NAME=GGUF=MLX_DIR ...
Prints one line per prompt and exits 1 if any differ.
"""
import json
import os
import subprocess
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string."]
MAX_TOKENS = 40
LONG_PROMPT_TOKENS = 250
LONG_WORDS = "the quick brown fox jumps over the lazy dog while".split()


def long_prompt(tokenizer):
    words = []
    while True:
        content = "Continue this text: " + " ".join(words)
        messages = [{"role": "user", "content": content}]
        if len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)) >= LONG_PROMPT_TOKENS:
            return content
        words.append(LONG_WORDS[len(words) % len(LONG_WORDS)])


def reference_ids(model, tokenizer, content):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ids = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        token = int(token)
        if token in tokenizer.eos_token_ids:
            break
        ids.append(token)
    return len(prompt), ids


def daemon_ids(mlxbc, gguf, content):
    out = subprocess.run([mlxbc, "ask", "--json", "-m", gguf, "-n", str(MAX_TOKENS), content],
                         capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        event = json.loads(line)
        if event.get("event") == "done":
            return event["stats"]["prompt_tokens"], event["stats"]["token_ids"]
    raise RuntimeError(f"no done event: {out.stdout[-300:]} {out.stderr[-300:]}")


def main():
    mlxbc, specs = sys.argv[1], sys.argv[2:]
    failures = 0
    print(f"device: {mx.default_device()}")
    for spec in specs:
        name, gguf, mlx_dir = spec.split("=")
        model, tokenizer = load(mlx_dir)
        for content in PROMPTS + [long_prompt(tokenizer)]:
            n_ref, ref = reference_ids(model, tokenizer, content)
            n_ours, ours = daemon_ids(mlxbc, gguf, content)
            same = ref == ours and n_ref == n_ours
            diverge = next((i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), min(len(ref), len(ours)))
            failures += not same
            verdict = "equal" if same else f"DIFFER at token {diverge} (prompt tokens {n_ours} vs {n_ref})"
            print(f"{name} | prompt {n_ref} tokens | {len(ref)} ids | {verdict}", flush=True)
            if not same:
                print(f"  mlx-lm: {tokenizer.decode(ref)!r}\n  mlxbcd: {tokenizer.decode(ours)!r}")
        subprocess.run([mlxbc, "stop"], capture_output=True)
    print(f"{'all equal' if failures == 0 else f'{failures} prompts differ'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
