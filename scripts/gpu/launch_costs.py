#!/usr/bin/env python3
"""What one MLX operation costs the host on the GPU, per kind, at the 8B
shape's sizes: why a batched decode step (dense matmuls through cuBLAS, our
attention kernel through MLX's custom-kernel API) takes ~12 ms of host time
at 16 and at 64 rows alike where one row's step (packed matmuls, MLX's
fused attention) takes ~6.75 ms with as many operations
(docs/measurements/h100-2026-12-05-real-size.md).

For each kind, N independent operations are built, then handed to MLX
(`mx.async_eval`: MLX walks the graph and launches every kernel on this
thread) and waited for (`mx.eval`). Printed per operation: the time to
build it (Python's call, not what Rust pays), to launch it (MLX's own host
work: what bounds the daemon's step) and to run it (the device's share,
after the launches). Usage: python3 launch_costs.py [N]"""
import statistics, sys, time

import mlx.core as mx

N = int(sys.argv[1]) if len(sys.argv) > 1 else 400
H, F = 4096, 4096
dt = mx.float16
w = mx.random.normal((F, H)).astype(dt) * 0.02
wq, sq, bq = mx.quantize(w, group_size=64, bits=4)
x1 = mx.random.normal((1, H)).astype(dt)
x16 = mx.random.normal((16, H)).astype(dt)
q16 = mx.random.normal((16, 32, 1, 128)).astype(dt)
k16 = mx.random.normal((16, 8, 256, 128)).astype(dt)
v16 = mx.random.normal((16, 8, 256, 128)).astype(dt)
mask = mx.ones((16, 1, 1, 256), dtype=mx.bool_)
zeros16 = mx.zeros((16,), dtype=mx.uint32)
copy_kernel = None
if mx.default_device() == mx.gpu and hasattr(mx.fast, "cuda_kernel"):
    copy_kernel = mx.fast.cuda_kernel(
        name="copy_rows", input_names=["inp"], output_names=["out"],
        source="int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < inp_shape[0] * inp_shape[1]) out[i] = inp[i];")
mx.eval(w, wq, sq, bq, x1, x16, q16, k16, v16, mask, zeros16)

KINDS = {
    "quantized_matmul, 1 row (one row's projections)": lambda: mx.quantized_matmul(x1, wq, sq, bq, True, 64, 4),
    "quantized_matmul, 16 rows": lambda: mx.quantized_matmul(x16, wq, sq, bq, True, 64, 4),
    "matmul x @ w.T, 1 row": lambda: x1 @ w.T,
    "matmul x @ w.T, 16 rows (the batched step's projections)": lambda: x16 @ w.T,
    # The batched step's alternative to cuBLAS: MLX's gather_mm with every
    # row picking the one matrix (sorted indices: its grouped GEMM, no
    # cublasLt heuristic query per call, which MLX 0.32 makes for every
    # dense matmul it hands cuBLAS).
    "gather_mm, 16 rows, one matrix (sorted)": lambda: mx.gather_mm(
        x16.reshape(16, 1, H), w.T[None], rhs_indices=zeros16, sorted_indices=True),
    "split of a fused projection + contiguous copy, 16 rows": lambda: mx.contiguous(x16[:, 1024:2048]),
    "sdpa, 16 rows, no mask": lambda: mx.fast.scaled_dot_product_attention(q16, k16, v16, scale=0.088),
    "sdpa, 16 rows, array mask": lambda: mx.fast.scaled_dot_product_attention(q16, k16, v16, scale=0.088, mask=mask),
    "custom kernel (copy), 16 rows": lambda: copy_kernel(
        inputs=[x16], output_shapes=[x16.shape], output_dtypes=[dt], grid=(16 * H, 1, 1), threadgroup=(256, 1, 1))[0],
    "add (x + 1), 16 rows": lambda: x16 + 1,
}
if copy_kernel is None:
    del KINDS["custom kernel (copy), 16 rows"]

print(f"mlx {mx.__version__}, {mx.default_device()}, {N} operations a round, 5 rounds, medians; microseconds per operation")
print("| operation | build | launch (MLX's host work) | run (device, after launching) |")
print("|---|---:|---:|---:|")
for name, op in KINDS.items():
    try:
        first = op()
        mx.eval(first)  # compiled or chosen once, outside the rounds
    except Exception as e:  # e.g. an MLX without this path on CUDA
        print(f"| {name} | failed: {str(e)[:120]} | | |", flush=True)
        continue
    if name.startswith("gather_mm"):
        err = mx.abs(first.reshape(16, F) - x16 @ w.T).max().item()
        print(f"(gather_mm against matmul: max abs difference {err:.2e})", flush=True)
    rows = []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = [op() for _ in range(N)]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        t3 = time.perf_counter()
        rows.append(((t1 - t0) / N * 1e6, (t2 - t1) / N * 1e6, (t3 - t2) / N * 1e6))
        del outs
    b, l, r = (statistics.median(v[i] for v in rows) for i in range(3))
    print(f"| {name} | {b:.1f} | {l:.1f} | {r:.1f} |", flush=True)
