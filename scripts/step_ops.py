#!/usr/bin/env python3
"""Counts one decode step's MLX operations by kind: mlxbcd's (the dot that
`cargo run --release -p mlxbc-daemon --example step_graph -- MODEL OURS.dot`
writes) beside mlx-lm's on the same MLX directory (a 4-token prompt, then
one greedy step, left lazy and exported the same way). On a GPU a one-row
step is bound by the host's work per operation, so the difference is what
to cut (issue "The GPU step at real sizes"). On a CPU MLX's fast kernels
(rms_norm, rope, attention) appear as their fallback operations in both.
    step_ops.py MLX_DIR OURS.dot"""
import collections, re, sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def count(path):
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', open(path).read()))


model_dir, ours = sys.argv[1], sys.argv[2]
model, _ = load(model_dir)
cache = make_prompt_cache(model)
logits = model(mx.array([[1, 1, 1, 1]]), cache=cache)
first = mx.argmax(logits[:, -1, :], axis=-1)
mx.eval(first, [c.state for c in cache])
logits = model(first[:, None], cache=cache)
mx.export_to_dot("/tmp/mlx_lm_step.dot", mx.argmax(logits[:, -1, :], axis=-1))
# The host's time to build steps (not run them): 64 more, lazily, each
# from the last one's pick, as mlx-lm's pipelined generate queues them.
import time
y = mx.argmax(logits[:, -1, :], axis=-1)
t = time.perf_counter()
for _ in range(64):
    y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
built = time.perf_counter() - t
mx.eval(y)
print(f"mlx-lm building a step: {built * 1e6 / 64:.1f} us (mean of 64, not evaluated)")
a, b = count(ours), count("/tmp/mlx_lm_step.dot")
print(f"| operation | mlxbcd | mlx-lm |\n|---|---:|---:|")
for op in sorted(set(a) | set(b), key=lambda o: -(a[o] + b[o])):
    print(f"| {op} | {a[op]} | {b[op]} |")
print(f"| **all** | **{sum(a.values())}** | **{sum(b.values())}** |")
