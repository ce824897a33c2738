#!/usr/bin/env python3
"""LoRA adapters under load, on one warm daemon: 16 clients at once, each
greedy for 64 tokens (`mlxbc ask --ignore-eos`), spread over 0 (the bare base), 1, 4 and 16
different adapters; total decode tokens per second, rounds interleaved
(each round starts with another spread), medians; then the base model's
memory (`mlxbc ps`) with 10 adapters loaded against none. The adapters are
copies of the fixture's trained one with their B matrices perturbed (what
they answer does not matter here, only their shape: rank 8 over 8 layers).
    lora_bench.py MLXBC BASE_URL SOCKET_HOME BASE_MODEL ADAPTER_DIR MODELS_DIR ROUNDS"""
import json, os, shutil, statistics, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor

from daemon_client import wait_warm

import mlx.core as mx

mlxbc, base_url, home, model, adapter, models, rounds = sys.argv[1:8]
rounds = int(rounds)
CLIENTS, TOKENS = 16, 64

weights = mx.load(os.path.join(adapter, "adapters.safetensors"))
for i in range(16):
    d = os.path.join(models, f"bench-adapter-{i}")
    if os.path.isdir(d):
        continue
    os.makedirs(d)
    shutil.copy(os.path.join(adapter, "adapter_config.json"), d)
    mx.random.seed(i)
    mx.save_safetensors(os.path.join(d, "adapters.safetensors"),
                        {k: v + 0.01 * mx.random.normal(v.shape) if k.endswith("lora_b") else v
                         for k, v in weights.items()})


def ask(adapter, i, r):
    """One greedy client of TOKENS tokens (EOS ignored, so every spread
    decodes the same number: a fine-tune that answers briefly would
    otherwise be timed on its prefill); returns the tokens generated."""
    cmd = [mlxbc, "ask", "--json", "-m", model, "--temperature", "0", "--max-tokens", str(TOKENS), "--ignore-eos",
           f"[{r}.{i}] Tell me a long story about a lighthouse."]
    if adapter is not None:
        cmd[2:2] = ["--adapter", adapter]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "MLXBC_HOME": home})
    for line in out.stdout.splitlines():
        ev = json.loads(line)
        if ev.get("event") == "done":
            return ev["stats"]["generated_tokens"]
    raise SystemExit(f"mlxbc ask failed: {out.stderr[-300:]}")


def spread(n):
    return [None if n == 0 else f"bench-adapter-{i % n}" for i in range(CLIENTS)]


def ps():
    out = subprocess.run([mlxbc, "ps"], capture_output=True, text=True, env={**os.environ, "MLXBC_HOME": home}).stdout
    return out


# Warm every adapter once (loading is not what is measured).
with ThreadPoolExecutor(CLIENTS) as ex:
    list(ex.map(lambda a: ask(a, 0, "warm"), [None] + [f"bench-adapter-{i}" for i in range(16)]))
# A GPU daemon warms its batch sizes while idle after a load (`mlxbc ps`
# says "warming batches"); rounds run alongside it would time the warming
# (on an H100 the 8B shape's first size took 38 s), so wait it out, then
# warm every spread once more.
wait_warm(mlxbc, home)
for n in [0, 1, 4, 16]:
    with ThreadPoolExecutor(CLIENTS) as ex:
        list(ex.map(lambda ia: ask(ia[1], ia[0], "warm"), enumerate(spread(n))))
SPREADS = [0, 1, 4, 16]
rows = {n: [] for n in SPREADS}
for r in range(rounds):
    for n in SPREADS[r % 4:] + SPREADS[: r % 4]:
        t = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as ex:
            tokens = sum(ex.map(lambda ia: ask(ia[1], ia[0], r), enumerate(spread(n))))
        rows[n].append(tokens / (time.monotonic() - t))
        print(f"round {r}: {n} adapters: {rows[n][-1]:.1f} tok/s", flush=True)
print(f"\n| 16 clients, {TOKENS} tokens each, {model} | total tok/s | against the bare base |\n|---|---:|---:|")
for n in SPREADS:
    name = "the bare base" if n == 0 else f"{n} adapter{'s' if n > 1 else ''}"
    print(f"| {name} | {statistics.median(rows[n]):.1f} | {statistics.median(rows[n]) / statistics.median(rows[0]):.2f}x |")
print(f"\nrounds: {rounds}\n\nmlxbc ps with 17 adapters loaded (16 here, 1 warm-up):\n{ps()}")
