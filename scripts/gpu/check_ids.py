#!/usr/bin/env python3
"""Greedy token ids on the GPU: mlxbcd (through `mlxbc ask --json`) against
mlx-lm on the same arrays (the directory mlxbc-gguf-to-mlx wrote from the
same GGUF, packed weights with f16 floats: the daemon's GPU form).

The CPU suite's goldens (tests/fixtures/reference/*.json) are dense-f32 ids;
on the GPU both sides compute in f16 with packed weights, so the reference is
computed here, on the device, with the pinned mlx-lm, on the CPU suite's
prompts (scripts/goldens/mlx_lm_reference.py: three chat prompts and one
grown to 250 tokens, whose decode crosses the daemon's KV buffer growth).

Usage: check_ids.py MLXBC_BINARY NAME=GGUF=MLX_DIR ...
Prints one line per prompt and exits 1 if any differ.
"""
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "goldens"))
from mlx_lm_reference import MAX_TOKENS, PROMPTS, greedy_ids, long_prompt  # noqa: E402


def daemon_ids(mlxbc, gguf, messages):
    """The prompt's length and mlxbcd's greedy ids for a (system +) user turn."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    user = [m["content"] for m in messages if m["role"] == "user"]
    cmd = [mlxbc, "ask", "--json", "-m", gguf, "-n", str(MAX_TOKENS)] + \
        (["--system", system[0]] if system else []) + user
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
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
        for messages in PROMPTS + [long_prompt(tokenizer)]:
            prompt, ref = greedy_ids(model, tokenizer, messages)
            n_ours, ours = daemon_ids(mlxbc, gguf, messages)
            same = ref == ours and len(prompt) == n_ours
            diverge = next((i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), min(len(ref), len(ours)))
            failures += not same
            verdict = "equal" if same else f"DIFFER at token {diverge} (prompt tokens {n_ours} vs {len(prompt)})"
            print(f"{name} | prompt {len(prompt)} tokens | {len(ref)} ids | {verdict}", flush=True)
            if not same:
                print(f"  mlx-lm: {tokenizer.decode(ref)!r}\n  mlxbcd: {tokenizer.decode(ours)!r}")
        subprocess.run([mlxbc, "stop"], capture_output=True)
    print(f"{'all equal' if failures == 0 else f'{failures} prompts differ'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
