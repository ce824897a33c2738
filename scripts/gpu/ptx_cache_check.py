#!/usr/bin/env python3
"""Does MLX's CUDA build keep the kernels it compiles where MLX_PTX_CACHE_DIR
says, and does a new process skip compiling them? Times the first call of a
compiled elementwise chain at a new shape (a JIT compile) in this process;
run it twice with the same MLX_PTX_CACHE_DIR and compare."""
import os, time
import mlx.core as mx

@mx.compile
def chain(x, y):
    return mx.tanh(x * 1.7 + y) * mx.sigmoid(y - 0.3) + mx.exp(-x * x)

times = []
for n in (12345, 23456, 34567):
    x, y = mx.random.normal((n,)), mx.random.normal((n,))
    mx.eval(x, y)
    t = time.perf_counter()
    mx.eval(chain(x, y))
    times.append((time.perf_counter() - t) * 1e3)
d = os.environ.get("MLX_PTX_CACHE_DIR")
files = sum(len(f) for _, _, f in os.walk(d)) if d and os.path.isdir(d) else 0
print(f"MLX_PTX_CACHE_DIR={d} files={files} first calls ms: " + ", ".join(f"{t:.1f}" for t in times), flush=True)
