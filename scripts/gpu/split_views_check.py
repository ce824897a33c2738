#!/usr/bin/env python3
"""Which of the batched step's operations read a fused projection's parts
correctly as views, on this device (the 8B shape's sizes, f16 dense weights
as the batched path holds them).

A fused q/k/v (or gate/up) matmul's parts are strided views into one
buffer; for more than one row the daemon has copied each part before use,
because MLX 0.32.2's CUDA rope misread such a view that starts past the
buffer's beginning (scripts/gpu/fused_qmm_check.py). Each copy is one more
operation in a host-bound step (5 a layer, 180 a step of the 8B shape), so
this prints, for each consumer of a part, the largest difference between
reading the view and reading a copy: rope straight from the view (llama,
Qwen2: no q/k norm), rms_norm then rope (Qwen3's q_norm/k_norm), the
compiled SwiGLU over gate and up, and v written into a cache buffer or
quantized for an 8-bit one.
0 means the view is safe there. Usage: split_views_check.py
"""
import mlx.core as mx

HIDDEN, HEAD, HEADS, KV_HEADS, MLP = 4096, 128, 32, 8, 12288
dt = mx.float16


def diff(a, b):
    return mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()


@mx.compile
def swiglu(g, u):
    return g * mx.sigmoid(g) * u


def main():
    mx.random.seed(0)
    print(f"mlx {mx.__version__}, {mx.default_device()}")
    w_qkv = (mx.random.normal(((HEADS + 2 * KV_HEADS) * HEAD, HIDDEN)) * 0.02).astype(dt)
    w_gu = (mx.random.normal((2 * MLP, HIDDEN)) * 0.02).astype(dt)
    norm = (1 + mx.random.normal((HEAD,)) * 0.1).astype(dt)
    cut = [HEADS * HEAD, (HEADS + KV_HEADS) * HEAD]
    for b, l in ((16, 1), (64, 1), (1, 50), (4, 7)):
        x = (mx.random.normal((b, l, HIDDEN)) * 0.5).astype(dt)
        offsets = mx.arange(b, dtype=mx.int32) * 3 + 5  # per-row positions, as a padded batch has
        q, k, v = mx.split(x @ w_qkv.T, cut, axis=-1)

        def heads(y, n):
            return y.reshape(b, l, n, HEAD).transpose(0, 2, 1, 3)

        def rope(y):
            return mx.fast.rope(y, HEAD, traditional=False, base=1e6, scale=1.0, offset=offsets if l == 1 else 5)

        rows = []
        for name, part, n in (("q", q, HEADS), ("k", k, KV_HEADS)):
            copy = mx.contiguous(part)
            rows.append((f"{name}: rope of the view", diff(rope(heads(part, n)), rope(heads(copy, n)))))
            normed = lambda y: mx.fast.rms_norm(heads(y, n), norm, 1e-6)
            rows.append((f"{name}: rms_norm then rope", diff(rope(normed(part)), rope(normed(copy)))))
        buf = mx.zeros((b, KV_HEADS, 64, HEAD), dtype=dt)
        write = lambda y: mx.slice_update(buf, heads(y, KV_HEADS), mx.array([3]), axes=(2,))
        rows.append(("v: written into a cache buffer", diff(write(v), write(mx.contiguous(v)))))
        packed = lambda y: mx.dequantize(*mx.quantize(heads(y, KV_HEADS), group_size=64, bits=8), group_size=64, bits=8)
        rows.append(("v: quantized for an 8-bit cache", diff(packed(v), packed(mx.contiguous(v)))))
        g, u = mx.split(x @ w_gu.T, [MLP], axis=-1)
        rows.append(("gate/up: compiled SwiGLU", diff(swiglu(g, u), swiglu(mx.contiguous(g), mx.contiguous(u)))))
        for name, d in rows:
            print(f"rows {b} x positions {l}: {name}: max |view - copy| = {d:.3g}", flush=True)


if __name__ == "__main__":
    main()
