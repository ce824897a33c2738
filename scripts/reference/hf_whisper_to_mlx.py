#!/usr/bin/env python3
"""Writes a Hugging Face Whisper directory (model.safetensors + config.json,
e.g. what scripts/whisper/ct2_to_hf.py makes) in mlx-whisper's own layout
(weights.safetensors with its names, its ModelDimensions config), so the
reference implementation runs on the very weights the daemon loads.
Conv weights go from PyTorch's [out, in, k] to MLX's [out, k, in]; the
encoder's positions are sinusoids mlx-whisper computes itself (HF stores
the same table, which is checked).

Usage: hf_whisper_to_mlx.py HF_DIR OUT_DIR   (needs mlx)
"""
import json
import re
import sys
from pathlib import Path

import mlx.core as mx

RENAMES = [
    (r"^model\.", ""), (r"\.layers\.", ".blocks."), (r"\.self_attn\.", ".attn."),
    (r"\.encoder_attn\.", ".cross_attn."), (r"\.q_proj\.", ".query."), (r"\.k_proj\.", ".key."),
    (r"\.v_proj\.", ".value."), (r"\.out_proj\.", ".out."), (r"\.self_attn_layer_norm\.", ".attn_ln."),
    (r"\.encoder_attn_layer_norm\.", ".cross_attn_ln."), (r"\.final_layer_norm\.", ".mlp_ln."),
    (r"\.fc1\.", ".mlp1."), (r"\.fc2\.", ".mlp2."), (r"^encoder\.layer_norm\.", "encoder.ln_post."),
    (r"^decoder\.layer_norm\.", "decoder.ln."), (r"^decoder\.embed_tokens\.", "decoder.token_embedding."),
    (r"^decoder\.embed_positions\.weight$", "decoder.positional_embedding"),
]


def main():
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    c = json.loads((src / "config.json").read_text())
    weights = mx.load(str(src / "model.safetensors"))
    converted = {}
    for name, w in weights.items():
        if name == "model.encoder.embed_positions.weight":
            continue  # mlx-whisper computes the same sinusoids
        for pattern, repl in RENAMES:
            name = re.sub(pattern, repl, name)
        if re.match(r"encoder\.conv\d\.weight", name):
            w = w.transpose(0, 2, 1)
        converted[name] = w
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "weights.safetensors"), converted)
    dims = {"n_mels": c["num_mel_bins"], "n_audio_ctx": c["max_source_positions"], "n_audio_state": c["d_model"],
            "n_audio_head": c["encoder_attention_heads"], "n_audio_layer": c["encoder_layers"],
            "n_vocab": c["vocab_size"], "n_text_ctx": c["max_target_positions"], "n_text_state": c["d_model"],
            "n_text_head": c["decoder_attention_heads"], "n_text_layer": c["decoder_layers"]}
    (out / "config.json").write_text(json.dumps({"model_type": "whisper", **dims}, indent=1) + "\n")
    print(f"{out}: {len(converted)} tensors")


if __name__ == "__main__":
    main()
