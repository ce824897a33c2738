"""What a speculative verify pass costs the host on CUDA, and whether MLX's
CUDA graphs are that cost. mlx-lm's model (the Qwen2.5-0.5B shape, packed
4-bit) over a KV cache growing from 600 positions, 30 forwards per
pattern, each split into building the lazy graph, launching it
(`mx.async_eval`: MLX walks the graph, captures every 20 operations into
a CUDA graph and instantiates it, or updates a cached one of the same
topology) and waiting for it:

  plain       one position a forward (a decode step)
  pass 9      nine positions every forward (a fixed draft width)
  pass mixed  2 to 9 positions, varying as an adaptive draft width does
  alternate   a plain step and a pass of 9 in turn (speculation that
              refuses every other pass); the passes reported

under MLX's defaults, with CUDA graphs off (`MLX_USE_CUDA_GRAPHS=0`) and
with 100 operations a graph (`MLX_MAX_OPS_PER_BUFFER=100`); each setting
in its own process, since MLX reads them once. On an H100 mlxbcd's
one-row pass of up to 9 positions queued ~10 ms of host work against a
plain step's ~3 (docs/measurements/h100-2026-12-07d-pass-fusion.md);
`cudaGraphInstantiate` for each 20-node graph whose topology is new, or
whose cached executable cannot take the new kernels, would be such a cost.
Run after `real-size.sh install`: python pass_graphs.py [MODEL_DIR]."""
import os
import random
import statistics
import subprocess
import sys
import time

SETTINGS = [("MLX defaults", {}), ("CUDA graphs off", {"MLX_USE_CUDA_GRAPHS": "0"}),
            ("100 ops a graph", {"MLX_MAX_OPS_PER_BUFFER": "100"})]
PATTERNS = ["plain", "pass 9", "pass mixed", "alternate"]
# Fewer for a trial run on a CPU (PASS_GRAPHS_FORWARDS=3 PASS_GRAPHS_PROMPT=16).
FORWARDS = int(os.environ.get("PASS_GRAPHS_FORWARDS", "30"))
PROMPT = int(os.environ.get("PASS_GRAPHS_PROMPT", "600"))


def widths(pattern, n):
    rng = random.Random(7)
    if pattern == "plain":
        return [1] * n
    if pattern == "pass 9":
        return [9] * n
    if pattern == "pass mixed":
        return [rng.randint(2, 9) for _ in range(n)]
    return [1 if i % 2 == 0 else 9 for i in range(n)]


def measure(model_dir):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(model_dir)
    for pattern in PATTERNS + PATTERNS:  # the second time round is the one reported
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(range(PROMPT))]), cache=cache))
        parts = {"build": [], "launch": [], "wait": []}
        ws = widths(pattern, FORWARDS)
        for i, w in enumerate(ws):
            x = mx.array([[5 + i] * w])
            t0 = time.perf_counter()
            y = mx.argmax(model(x, cache=cache), axis=-1)
            t1 = time.perf_counter()
            mx.async_eval(y)
            t2 = time.perf_counter()
            mx.eval(y)
            t3 = time.perf_counter()
            if pattern == "alternate" and w == 1:
                continue  # its passes are reported: do plain steps between them disturb their graphs?
            parts["build"].append(t1 - t0)
            parts["launch"].append(t2 - t1)
            parts["wait"].append(t3 - t2)
        med = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
        yield pattern, med


def main():
    model_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp/models/qwen2.5-0.5b-4bit"
    if os.environ.get("PASS_GRAPHS_CHILD"):
        last = {}
        for pattern, med in measure(model_dir):
            last[pattern] = med
        for pattern in PATTERNS:
            m = last[pattern]
            print(f"{pattern}\t{m['build']:.2f}\t{m['launch']:.2f}\t{m['wait']:.2f}", flush=True)
        return
    print("| setting | forwards | build ms | launch ms | wait ms | total ms |")
    print("|---|---|---:|---:|---:|---:|")
    for label, env in SETTINGS:
        try:
            out = subprocess.run([sys.executable, __file__, model_dir],
                                 env=dict(os.environ, PASS_GRAPHS_CHILD="1", **env),
                                 capture_output=True, text=True, timeout=240)
        except subprocess.TimeoutExpired:
            print(f"| {label} | timed out after 240 s | | | | |", flush=True)
            continue
        if out.returncode != 0:
            print(f"| {label} | failed: {(out.stderr.strip().splitlines() or ['?'])[-1]} | | | | |", flush=True)
            continue
        for line in out.stdout.splitlines():
            pattern, b, l, w = line.split("\t")
            total = float(b) + float(l) + float(w)
            print(f"| {label} | {pattern} | {b} | {l} | {w} | {total:.2f} |", flush=True)


if __name__ == "__main__":
    main()
