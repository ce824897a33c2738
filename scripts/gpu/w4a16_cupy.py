#!/usr/bin/env python3
"""The W4A16 few-row kernel (daemon/src/model/w4a16_body.cu, the body the daemon
hands MLX's custom-kernel API) checked and timed through CuPy on the device's
own Python (no MLX needed: it runs before the bundle is staged).

Checks every variant against an f32 reference of the dequantized weights
(f16 and bf16), then times the 36-layer projection chain of the Qwen3-8B
shape (fused q/k/v 6144x4096, o 4096x4096, fused gate/up 24576x4096, down
4096x12288) plus the LM head (151936x4096), each layer's weights distinct
(4.5 GB packed, so the chain reads memory, not L2), captured in a CUDA graph,
per rows and variant, beside cuBLAS on dense f16 copies (what the daemon uses
today). Usage: python3 w4a16_cupy.py [ROWS,...]"""
import os, statistics, sys, time
import cupy as cp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BODY = open(os.path.join(HERE, "..", "..", "daemon", "src", "model", "w4a16_body.cu")).read()
SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename T, int ROWS, int R, int NW, int DQ>
__global__ void w4a16(const T* __restrict__ x, const unsigned int* __restrict__ w, const T* __restrict__ scales,
                      const T* __restrict__ biases, T* __restrict__ out, int K, int N, int GROUP) {
  typedef unsigned int uint32_t;
  auto prepare = [&]() {};
  auto load8 = [&](int m, int k) -> uint4 { return *reinterpret_cast<const uint4*>(x + (size_t)m * K + k); };
  auto wrow = [&](int n0, int r) -> int { return n0 + r; };
  auto store = [&](int m, int n0, int r, float v, float) { out[(size_t)m * N + n0 + r] = static_cast<T>(v); };
""" + BODY + "\n}\n"

ROWS = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2,3,4,6,8,16").split(",")]
VARIANTS = [(2, 4, 0), (4, 4, 0), (4, 4, 1), (2, 4, 1), (8, 4, 1), (4, 8, 1), (4, 2, 1), (1, 4, 1)]


def variants(rows):
    return [v for v in VARIANTS if v[0] * rows <= 64]


names = []
for rows in sorted(set(ROWS) | {1, 3, 8, 16}):
    for (r, nw, dq) in variants(rows):
        for t in ("__half", "__nv_bfloat16"):
            names.append(f"w4a16<{t},{rows},{r},{nw},{dq}>")
t0 = time.perf_counter()
MOD = cp.RawModule(code=SOURCE, options=("-std=c++17", "--use_fast_math"), name_expressions=names)
KERNELS = {}


def kernel(dtype, rows, r, nw, dq):
    t = "__half" if dtype == cp.float16 else "__nv_bfloat16"
    key = (t, rows, r, nw, dq)
    if key not in KERNELS:
        KERNELS[key] = MOD.get_function(f"w4a16<{t},{rows},{r},{nw},{dq}>")
    return KERNELS[key]


def bf16(a):
    """A float32 array rounded to bfloat16, stored as uint16 (CuPy has no bfloat16)."""
    u = a.astype(cp.float32).view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


def from_bf16(u):
    return (u.astype(cp.uint32) << 16).view(cp.float32)


def quantized(n, k, group, dtype, rng):
    """Random packed weights, scales, biases (stored as `dtype`, bf16 as uint16) and the f32 dequantization."""
    w = rng.randint(0, 256, size=(n, k // 2), dtype=cp.uint8).view(cp.uint32)
    s = rng.uniform(0.001, 0.004, size=(n, k // group), dtype=cp.float32)
    b = -8 * s + rng.normal(0, 0.002, size=(n, k // group), dtype=cp.float32)
    if dtype == cp.float16:
        s, b = s.astype(cp.float16), b.astype(cp.float16)
        sf, bf = s.astype(cp.float32), b.astype(cp.float32)
    else:
        s, b = bf16(s), bf16(b)
        sf, bf = from_bf16(s), from_bf16(b)
    return w, s, b, sf, bf


def dequantize(w, sf, bf, group):
    n, kw = w.shape
    shifts = cp.arange(8, dtype=cp.uint32) * 4
    q = ((w[:, :, None] >> shifts) & 0xF).reshape(n, kw * 8).astype(cp.float32)
    return q * cp.repeat(sf, group, axis=1) + cp.repeat(bf, group, axis=1)


def launch(dtype, rows, variant, x, w, s, b, out, k, n, group, stream=None):
    r, nw, dq = variant
    blocks = (n // r + nw - 1) // nw
    kernel(dtype, rows, r, nw, dq)((blocks,), (32 * nw,), (x, w, s, b, out, np.int32(k), np.int32(n), np.int32(group)),
                                   stream=stream)


def check():
    rng = cp.random.RandomState(0)
    worst = 0.0
    for (n, k, group) in [(6144, 4096, 64), (4096, 12288, 64), (896, 896, 64), (1024, 4096, 32), (512, 2048, 128)]:
        for dtype in (cp.float16, "bf16"):
            w, s, b, sf, bf = quantized(n, k, group, dtype, rng)
            ref_w = dequantize(w, sf, bf, group)
            for rows in (1, 3, 8, 16):
                xf = rng.normal(0, 1, size=(rows, k), dtype=cp.float32)
                x = xf.astype(cp.float16) if dtype == cp.float16 else bf16(xf)
                xr = x.astype(cp.float32) if dtype == cp.float16 else from_bf16(x)
                ref = xr @ ref_w.T
                scale = float(cp.abs(ref).max())
                for v in variants(rows):
                    out = cp.zeros((rows, n), dtype=cp.float16 if dtype == cp.float16 else cp.uint16)
                    launch(dtype, rows, v, x, w, s, b, out, k, n, group)
                    got = out.astype(cp.float32) if dtype == cp.float16 else from_bf16(out)
                    e = float(cp.abs(got - ref).max()) / scale
                    worst = max(worst, e)
                    if e > 1e-2:
                        print(f"FAIL n={n} k={k} g={group} {dtype} rows={rows} {v}: rel err {e:.2e}", flush=True)
        print(f"check n={n} k={k} group={group}: worst so far {worst:.2e}", flush=True)
    print(f"worst relative error against the f32 reference: {worst:.2e} (f16 output rounding is ~5e-4)")
    return worst


def timing():
    H, KV, FF, LAYERS, VOCAB = 4096, 1024, 12288, 36, 151936
    shapes = [(H + 2 * KV, H), (H, H), (2 * FF, H), (H, FF)]
    rng = cp.random.RandomState(1)
    packed, dense = [], []
    for _ in range(LAYERS):
        for (n, k) in shapes:
            w, s, b, _, _ = quantized(n, k, 64, cp.float16, rng)
            packed.append((n, k, w, s, b))
            dense.append((n, k, rng.normal(0, 0.02, size=(n, k), dtype=cp.float32).astype(cp.float16)))
    w, s, b, _, _ = quantized(VOCAB, H, 64, cp.float16, rng)
    packed.append((VOCAB, H, w, s, b))
    dense.append((VOCAB, H, rng.normal(0, 0.02, size=(VOCAB, H), dtype=cp.float32).astype(cp.float16)))
    gb_packed = sum(p[2].nbytes + p[3].nbytes * 2 for p in packed) / 1e9
    gb_dense = sum(d[2].nbytes for d in dense) / 1e9
    print(f"chain: {LAYERS} layers + LM head; packed {gb_packed:.2f} GB, dense f16 {gb_dense:.2f} GB", flush=True)
    stream = cp.cuda.Stream(non_blocking=True)

    def graph_of(fn):
        with stream:
            fn()  # warm (and any lazy init) outside the capture
            stream.synchronize()
            stream.begin_capture()
            fn()
            return stream.end_capture()

    def time_graph(g, reps=20):
        times = []
        for _ in range(reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            g.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
        return statistics.median(times[3:])

    print("| rows | dense f16 (cuBLAS) ms | " + " | ".join(f"R{r} NW{nw} DQ{dq}" for r, nw, dq in VARIANTS)
          + " | best ours GB/s |")
    print("|---:|---:|" + "---:|" * len(VARIANTS) + "---:|")
    for rows in ROWS:
        xs = {k: rng.normal(0, 1, size=(rows, k), dtype=cp.float32).astype(cp.float16) for k in (H, FF)}
        outs = {n: cp.zeros((rows, n), dtype=cp.float16) for n in {p[0] for p in packed}}

        def dense_chain():
            for (n, k, wd) in dense:
                cp.matmul(xs[k], wd.T, out=outs[n])

        res = {}
        # CuPy refuses cuBLAS under stream capture: timed by events around plain calls.
        with stream:
            dense_chain()
            times = []
            for _ in range(10):
                st, en = cp.cuda.Event(), cp.cuda.Event()
                st.record(stream)
                dense_chain()
                en.record(stream)
                en.synchronize()
                times.append(cp.cuda.get_elapsed_time(st, en))
            res["dense"] = statistics.median(times[2:])
        for v in variants(rows):
            def ours():
                for (n, k, w, s, b) in packed:
                    launch(cp.float16, rows, v, xs[k], w, s, b, outs[n], k, n, 64, stream=stream)
            res[v] = time_graph(graph_of(ours))
        best = min(t for key, t in res.items() if key != "dense")
        cells = [f"{res[v]:.3f}" if v in res else "" for v in VARIANTS]
        print(f"| {rows} | {res['dense']:.3f} | " + " | ".join(cells) + f" | {gb_packed / best * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    dev = cp.cuda.Device()
    print(f"{cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, CuPy {cp.__version__}, "
          f"compiled {len(names)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)
    worst = check()
    timing()
    sys.exit(0 if worst < 1e-2 else 1)
