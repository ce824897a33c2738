#!/usr/bin/env python3
"""f32 matmul speed of MLX's CPU backend over Debian's OpenBLAS, per
OpenBLAS kernel set: the one it detects and those OPENBLAS_CORETYPE forces
(daemon/src/blas_core.rs restarts mlxbcd with the widest the CPU runs).
MiniLM's FFN product for 64 texts of 240 tokens (15,360 x 384 x 1,536),
rounds interleaved, medians.
    target/test-fixtures/venv/bin/python scripts/bench.d/blas_cores.py [ROUNDS]"""
import os, statistics, subprocess, sys

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
ONE = r"""
import ctypes, time, mlx.core as mx
lib = ctypes.CDLL("%s"); lib.openblas_get_corename.restype = ctypes.c_char_p
mx.set_default_device(mx.cpu)
a = mx.random.normal((15360, 384)); w = mx.random.normal((1536, 384)); mx.eval(a, w)
mx.eval(a @ w.T)
best = []
for _ in range(3):
    t = time.perf_counter(); mx.eval(a @ w.T); best.append(time.perf_counter() - t)
print(lib.openblas_get_corename().decode(), 2 * 15360 * 384 * 1536 / min(best) / 1e9)
""" % OPENBLAS

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
cores = ["detected", "Haswell", "SkylakeX", "Cooperlake"]
got = {c: [] for c in cores}
names = {}
for r in range(rounds):
    for c in cores if r % 2 == 0 else cores[::-1]:
        env = dict(os.environ, LD_PRELOAD=OPENBLAS)
        env.pop("OPENBLAS_CORETYPE", None)
        if c != "detected":
            env["OPENBLAS_CORETYPE"] = c
        name, gflops = subprocess.run([sys.executable, "-c", ONE], env=env, capture_output=True, text=True,
                                      check=True).stdout.split()
        names[c] = name
        got[c].append(float(gflops))
print(f"| OpenBLAS kernels | f32 GFLOP/s (rounds) | median |\n|---|---|---:|")
for c in cores:
    label = f"{names[c]} (detected)" if c == "detected" else f"{names[c]} (OPENBLAS_CORETYPE={c})"
    print(f"| {label} | {', '.join(f'{x:.0f}' for x in got[c])} | {statistics.median(got[c]):.0f} |")
