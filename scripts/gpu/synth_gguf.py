#!/usr/bin/env python3
"""Rebuilds a GGUF of a real model's exact shape and block types from its
header alone, for machines a 478 MB file cannot reach (the lent GPU takes
64 MiB per call). The header (metadata, tokenizer, tensor directory) is the
real file's; each tensor's data is real blocks of its type, tiled (rows from
tests/fixtures/reference/gguf-blocks.gguf), norms 1.0 and biases 0. Decode
speed does not depend on the values; the text it writes is nonsense.

Usage: synth_gguf.py HEADER_BYTES BLOCKS_GGUF OUT.gguf
(HEADER_BYTES: the real file's first bytes, up to where its tensor data starts.)
"""
import struct
import sys

import numpy as np

# ggml type -> (values per block, bytes per block)
BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
          12: (256, 144), 13: (256, 176), 14: (256, 210), 30: (1, 2)}
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}


class Reader:
    def __init__(self, data):
        self.d, self.at = data, 0

    def take(self, n):
        self.at += n
        return self.d[self.at - n:self.at]

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]

    def string(self):
        return self.take(self.u64()).decode("utf-8", "replace")

    def value(self, kind):
        fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if kind in fixed:
            return self.take(fixed[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            inner, n = self.u32(), self.u64()
            return [self.value(inner) for _ in range(n)]
        raise ValueError(f"metadata type {kind}")


def directory(data):
    """(tensors [(name, dims, type, offset)], alignment, end of the directory)."""
    r = Reader(data)
    assert r.take(4) == b"GGUF"
    r.u32()
    n_tensors, n_meta = r.u64(), r.u64()
    align = 32
    for _ in range(n_meta):
        key, kind = r.string(), r.u32()
        v = r.value(kind)
        if key == "general.alignment":
            align = struct.unpack("<I", v)[0]
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.u64() for _ in range(r.u32())]
        kind, offset = r.u32(), r.u64()
        tensors.append((name, dims, kind, offset))
    return tensors, align, r.at


def main():
    header, blocks_path, out = open(sys.argv[1], "rb").read(), sys.argv[2], sys.argv[3]
    tensors, align, end = directory(header)
    data_start = (end + align - 1) // align * align
    assert len(header) >= data_start, "the header bytes stop before the tensor data starts"
    samples = {}
    btensors, balign, bend = directory(open(blocks_path, "rb").read())
    braw = open(blocks_path, "rb").read()
    bstart = (bend + balign - 1) // balign * balign
    for name, dims, kind, offset in btensors:
        if name.startswith("q."):
            per, size = BLOCKS[kind]
            n = int(np.prod(dims)) // per * size
            samples[kind] = np.frombuffer(braw[bstart + offset:bstart + offset + n], dtype=np.uint8)
    with open(out, "wb") as f:
        f.write(header[:data_start])
        for name, dims, kind, offset in sorted(tensors, key=lambda t: t[3]):
            per, size = BLOCKS[kind]
            n = int(np.prod(dims)) // per * size
            f.seek(data_start + offset)
            if kind == 0:
                value = 1.0 if name.endswith("norm.weight") else 0.0
                f.write(np.full(n // 4, value, dtype=np.float32).tobytes())
            elif kind in samples:
                s = samples[kind]
                f.write(np.tile(s, n // len(s) + 1)[:n].tobytes())
            else:
                raise SystemExit(f"{name}: no sample blocks of type {kind}")
    print(f"{out}: {len(tensors)} tensors, types {sorted({NAMES.get(t[2], t[2]) for t in tensors}, key=str)}")


if __name__ == "__main__":
    main()
