#!/usr/bin/env python3
"""A small GGUF of real quantized blocks and their reference values.

Takes the first rows of one tensor per block type from real GGUF files
(Qwen2.5-Coder-0.5B and Gemma 3 270M Q4_K_M, from scripts/fetch-models),
and writes them, raw, as `q.<TYPE>.weight` tensors into one small GGUF together
with `ref.<TYPE>.weight`: the same rows dequantized by llama.cpp's gguf-py
(`gguf.quants.dequantize`), as F32. daemon/tests/gguf_reader.rs reads both
with the daemon's reader and checks that its conversion gives the values.

Usage (needs `pip install gguf numpy`):
  gguf_blocks.py QWEN25_GGUF GEMMA3_GGUF OUT.gguf
"""
import sys

import numpy as np
import gguf

ROWS = 8


def main():
    sources, out = sys.argv[1:3], sys.argv[3]
    wanted = {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    picked = {}
    for path in sources:
        for t in gguf.GGUFReader(path).tensors:
            kind = t.tensor_type.name
            if kind in wanted and kind not in picked and len(t.shape) == 2:
                picked[kind] = t
    assert set(picked) == wanted, f"found only {sorted(picked)}"
    w = gguf.GGUFWriter(out, "blocks")
    for kind, t in sorted(picked.items()):
        raw = np.asarray(t.data)[:ROWS]  # rows of packed blocks (uint8)
        cols = int(t.shape[0])
        w.add_tensor(f"q.{kind}.weight", raw, raw_dtype=t.tensor_type)
        ref = gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32).reshape(ROWS, cols)
        w.add_tensor(f"ref.{kind}.weight", ref)
        print(kind, t.name, (ROWS, cols))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
