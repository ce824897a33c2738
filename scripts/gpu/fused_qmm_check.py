#!/usr/bin/env python3
"""Why fused quantized projections answered wrongly on MLX 0.32.2 CUDA (issue 5):
one quantized matmul over q/k/v weights concatenated along the output axis,
against the three separate ones, then each step the daemon takes after it
(slicing the output, heads reshape, rope). Prints the largest difference of
each step; on CPU every line is 0.

Usage: fused_qmm_check.py   (SmolLM2-135M's shapes: hidden 576, 9 heads and 3
key/value heads of 64, MLP 1536, affine 4-bit groups of 32 as from Q4_1)
"""
import mlx.core as mx

HIDDEN, HEAD, HEADS, KV_HEADS, MLP = 576, 64, 9, 3, 1536


def quantized(rows):
    w = mx.random.normal((rows, HIDDEN)) * 0.05
    return mx.quantize(w.astype(mx.float16), group_size=32, bits=4)


def qmm(x, q):
    return mx.quantized_matmul(x, *q, transpose=True, group_size=32, bits=4)


def main():
    mx.random.seed(0)
    print(f"device: {mx.default_device()}")
    parts = [quantized(HEADS * HEAD), quantized(KV_HEADS * HEAD), quantized(KV_HEADS * HEAD)]
    fused = tuple(mx.concatenate([p[i] for p in parts], axis=0) for i in range(3))
    mlp = [quantized(MLP), quantized(MLP)]
    mlp_fused = tuple(mx.concatenate([p[i] for p in mlp], axis=0) for i in range(3))
    for length in (1, 50):
        x = (mx.random.normal((1, length, HIDDEN)) * 0.5).astype(mx.float16)
        separate = [qmm(x, p) for p in parts]
        together = qmm(x, fused)
        cut = [HEADS * HEAD, (HEADS + KV_HEADS) * HEAD]
        sliced = mx.split(together, cut, axis=-1)
        diff = lambda a, b: mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
        print(f"L={length} qkv: fused output vs concatenated separate: "
              f"{diff(together, mx.concatenate(separate, axis=-1)):.3g}")
        for name, a, b, n in zip("qkv", sliced, separate, (HEADS, KV_HEADS, KV_HEADS)):
            heads = lambda y: y.reshape(1, length, n, HEAD).transpose(0, 2, 1, 3)
            rope = lambda y: mx.fast.rope(heads(y), HEAD, traditional=False, base=100000.0, scale=1.0, offset=7)
            print(f"  {name}: slice {diff(a, b):.3g}, heads {diff(heads(a), heads(b)):.3g}, "
                  f"rope {diff(rope(a), rope(b)):.3g}")
        # The daemon's prefill: the projection and rope in one lazy graph,
        # nothing evaluated in between (the lines above evaluate `together`
        # before roping its slices).
        x2 = (mx.random.normal((1, length, HIDDEN)) * 0.5).astype(mx.float16)
        k_view = mx.split(qmm(x2, fused), cut, axis=-1)[1]
        k_heads = lambda y: y.reshape(1, length, KV_HEADS, HEAD).transpose(0, 2, 1, 3)
        roped = mx.fast.rope(k_heads(k_view), HEAD, traditional=False, base=100000.0, scale=1.0, offset=7)
        expected = mx.fast.rope(k_heads(qmm(x2, parts[1])), HEAD, traditional=False, base=100000.0, scale=1.0, offset=7)
        print(f"  k, rope of the slice in one lazy graph: {diff(roped, expected):.3g}")
        gate_up = qmm(x, mlp_fused)
        print(f"L={length} gate/up: fused vs separate: "
              f"{diff(gate_up, mx.concatenate([qmm(x, p) for p in mlp], axis=-1)):.3g}")


if __name__ == "__main__":
    main()
