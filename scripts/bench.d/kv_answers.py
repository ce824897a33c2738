#!/usr/bin/env python3
"""How often a quantized KV cache gives the full-precision answer: greedy
answers (96 tokens) to twelve prompts of the kinds users send (code to
write, fix and explain, prose, lists, a quotation), per model, with the
cache in full precision, 8 bits, 8 bits rotated, 4 bits rotated and 4 bits
(groups of 64); counts of answers identical to full precision, and of
answers identical for their first 32 tokens.
    kv_answers.py BASE_URL MODEL..."""
import json, sys, urllib.request

base, models = sys.argv[1], sys.argv[2:]
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Fix the bug: def mean(xs): return sum(xs) / len(xs) + 1",
    "Explain what a mutex is in two sentences.",
    "Write a Rust function that reverses the words of a sentence.",
    "What does `git rebase -i HEAD~3` do?",
    "List five uses of a hash map.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Write a SQL query returning the ten customers with the highest total order value.",
    "Translate to French: The library opens at nine in the morning.",
    "Write a haiku about compilers.",
    "Convert this JSON to YAML: {\"name\": \"mlxbc\", \"tags\": [\"mlx\", \"rust\"], \"port\": 11434}",
    "Repeat exactly: The quick brown fox jumps over the lazy dog.",
]
SETTINGS = [("full", {}), ("8-bit", {"kv_bits": 8, "kv_rotate": False}), ("8-bit rotated", {"kv_bits": 8, "kv_rotate": True}),
            ("4-bit rotated", {"kv_bits": 4, "kv_rotate": True}), ("4-bit", {"kv_bits": 4, "kv_rotate": False})]


def answer(model, prompt, extra):
    body = {"model": model, "temperature": 0, "max_tokens": 96, "logprobs": True,
            "messages": [{"role": "user", "content": prompt}], **extra}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1200) as r:
        return [t["token"] for t in json.loads(r.read())["choices"][0]["logprobs"]["content"]]


print("| model | KV cache | answers equal to full precision | equal for 32 tokens |\n|---|---|---:|---:|")
for model in models:
    full = [answer(model, p, {}) for p in PROMPTS]
    for name, extra in SETTINGS[1:]:
        got = [answer(model, p, extra) for p in PROMPTS]
        same = sum(a == b for a, b in zip(got, full))
        head = sum(a[:32] == b[:32] for a, b in zip(got, full))
        print(f"| {model} | {name} | {same} of {len(PROMPTS)} | {head} of {len(PROMPTS)} |", flush=True)
