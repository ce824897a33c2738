#!/usr/bin/env python3
"""A W4A16 matrix-vector kernel of our own for few rows (issue "The GPU step
at real sizes", item 1: MLX 0.32's CUDA quantized matmul costs time in
proportion to the rows), through MLX's custom-kernel API
(`mx.fast.cuda_kernel`, the API the daemon would call through mlx-c's
`mlx_fast_cuda_kernel_*`). One warp per output feature reads its packed row
once (16-byte loads, coalesced) and applies it to every row of x (ROWS, a
template constant), accumulating in f32.

Checks it against `mx.quantized_matmul` on the 8B shapes (max relative
error), then times the 36-layer projection chain of scripts/gpu/qmm_scale.py
per row count: packed (MLX), ours, dense f16. Usage: w4a16.py"""
import os, statistics, time
import mlx.core as mx

SOURCE = r"""
    // x [ROWS, K] T; w [N, K/8] uint32 (4-bit, low nibble first);
    // scales, biases [N, K/GROUP] T; out [ROWS, N] T.
    const int lane = threadIdx.x;
    const int n = blockIdx.y * blockDim.y + threadIdx.y;
    if (n >= N) return;
    const uint4* wrow = reinterpret_cast<const uint4*>(w) + (size_t)n * (K / 32);
    const T* srow = scales + (size_t)n * (K / GROUP);
    const T* brow = biases + (size_t)n * (K / GROUP);
    float acc[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) acc[m] = 0.f;
    for (int c = lane; c < K / 32; c += 32) {
        const uint4 q = wrow[c];
        const int k0 = c * 32;
        const float s = static_cast<float>(srow[k0 / GROUP]);
        const float b = static_cast<float>(brow[k0 / GROUP]);
        const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)m * K + k0);
            float dot = 0.f, sum = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 xv = xr[j];
                const T* xh = reinterpret_cast<const T*>(&xv);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float xi = static_cast<float>(xh[i]);
                    dot += static_cast<float>((words[j] >> (4 * i)) & 0xFu) * xi;
                    sum += xi;
                }
            }
            acc[m] += s * dot + b * sum;
        }
    }
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        float v = acc[m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) out[(size_t)m * N + n] = static_cast<T>(v);
    }
"""
KERNEL = mx.fast.cuda_kernel(name="w4a16_gemv", input_names=["x", "w", "scales", "biases"],
                             output_names=["out"], source=SOURCE)
WARPS = int(os.environ.get("W4_WARPS", "4"))


def w4a16(x, w, scales, biases, group=64):
    """x [..., K] @ dequantize(w).T for few rows."""
    K = x.shape[-1]
    N = w.shape[0]
    rows = x.size // K
    x2 = x.reshape(rows, K)
    out = KERNEL(inputs=[x2, w, scales, biases],
                 template=[("T", x.dtype), ("ROWS", rows), ("K", K), ("N", N), ("GROUP", group)],
                 grid=(32, ((N + WARPS - 1) // WARPS) * WARPS, 1), threadgroup=(32, WARPS, 1),
                 output_shapes=[(rows, N)], output_dtypes=[x.dtype])[0]
    return out.reshape(*x.shape[:-1], N)


def check():
    mx.random.seed(1)
    worst = 0.0
    for (N, K) in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]:
        w = (mx.random.normal((N, K)) * 0.02).astype(mx.float16)
        q = mx.quantize(w, group_size=64, bits=4)
        for rows in (1, 2, 3, 4, 8):
            x = (mx.random.normal((rows, 1, K)) * 0.5).astype(mx.float16)
            want = mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4).astype(mx.float32)
            ref = (x.astype(mx.float32) @ mx.dequantize(*q, group_size=64, bits=4).astype(mx.float32).T)
            got = w4a16(x, *q).astype(mx.float32)
            scale = mx.abs(ref).max().item()
            e_ours = (mx.abs(got - ref).max().item()) / scale
            e_mlx = (mx.abs(want - ref).max().item()) / scale
            worst = max(worst, e_ours)
            print(f"check N={N} K={K} rows={rows}: max error vs f32 reference, ours {e_ours:.2e}, "
                  f"MLX quantized_matmul {e_mlx:.2e}", flush=True)
    print(f"worst relative error (ours): {worst:.2e}")


def timing():
    H, KV, FF, LAYERS = 4096, 1024, 12288, 36
    shapes = {"qkv": (H + 2 * KV, H), "o": (H, H), "gate_up": (2 * FF, H), "down": (H, FF)}
    mx.random.seed(0)
    dense = [{k: (mx.random.normal(s) * 0.02).astype(mx.float16) for k, s in shapes.items()} for _ in range(LAYERS)]
    packed = [{k: mx.quantize(w, group_size=64, bits=4) for k, w in l.items()} for l in dense]
    mx.eval(dense, packed)

    def proj(kind, w, x):
        if kind == "packed":
            return mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)
        if kind == "ours":
            return w4a16(x, *w)
        return x @ w.T

    def step(kind, layers, x):
        for l in layers:
            a = proj(kind, l["qkv"], x)[..., :H]
            x = x + proj(kind, l["o"], a)
            gu = proj(kind, l["gate_up"], x)
            g, u = gu[..., :FF], gu[..., FF:]
            x = x + proj(kind, l["down"], g * mx.sigmoid(g) * u)
        return x

    print("| rows | packed (MLX) ms | ours ms | dense f16 ms |")
    print("|---:|---:|---:|---:|")
    for rows in (1, 2, 3, 4, 6, 8):
        res = {}
        x = (mx.random.normal((rows, 1, H)) * 0.1).astype(mx.float16)
        for rnd in range(2):  # interleaved
            for kind, layers in (("packed", packed), ("ours", packed), ("dense", dense)):
                times = []
                for i in range(8):
                    mx.synchronize()
                    t = time.perf_counter()
                    mx.eval(step(kind, layers, x))
                    times.append(time.perf_counter() - t)
                res.setdefault(kind, []).extend(times[3:])
        print(f"| {rows} | {statistics.median(res['packed'])*1e3:.2f} | {statistics.median(res['ours'])*1e3:.2f} | "
              f"{statistics.median(res['dense'])*1e3:.2f} |", flush=True)


if __name__ == "__main__":
    print(f"device {mx.default_device()}, MLX {mx.__version__}, {WARPS} warps a block")
    check()
    timing()
