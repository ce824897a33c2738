#!/usr/bin/env python3
"""What a new prefill shape costs on the GPU the first time (issue "The GPU
step at real sizes", first-burst stalls): MLX's scaled_dot_product_attention
on the 8B shape's heads (32 query heads, 8 KV heads, head dim 128, f16) for
prompt lengths never seen before, first call against the second, with the
causal mask (one prompt) and with a padding mask as an array (a padded batch
of 16 prompts). A first call that costs far more than the second is a graph
or kernel built for that shape. Run it again with MLX_CUDA_USE_CUDNN_SPDA=0
(and its later spelling MLX_CUDA_USE_CUDNN_SDPA=0) to see MLX's path without
cuDNN. Usage: prefill_shapes.py"""
import os
import time
import mlx.core as mx


def timed(f):
    mx.synchronize()
    t = time.perf_counter()
    mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - t) * 1e3


def main():
    cudnn = os.environ.get("MLX_CUDA_USE_CUDNN_SPDA", os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1"))
    print(f"device {mx.default_device()}, MLX {mx.__version__}, cuDNN attention {'off' if cudnn == '0' else 'on'}")
    print("| rows | prompt length | mask | first call ms | second call ms |")
    print("|---:|---:|---|---:|---:|")
    for rows, mask_kind in ((1, "causal"), (16, "array")):
        for length in (37, 41, 53, 64, 97, 512, 2048):
            q = mx.random.normal((rows, 32, length, 128)).astype(mx.float16)
            k = mx.random.normal((rows, 8, length, 128)).astype(mx.float16)
            v = mx.random.normal((rows, 8, length, 128)).astype(mx.float16)
            if mask_kind == "causal":
                mask = "causal"
            else:
                pad = mx.arange(rows).reshape(rows, 1, 1, 1) % 7
                keys = mx.arange(length).reshape(1, 1, 1, length)
                queries = mx.arange(length).reshape(1, 1, length, 1)
                mask = (keys >= pad) & (keys <= queries)
            mx.eval(q, k, v)
            f = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5, mask=mask)
            first, second = timed(f), timed(f)
            print(f"| {rows} | {length} | {mask_kind} | {first:.1f} | {second:.1f} |", flush=True)


if __name__ == "__main__":
    main()
