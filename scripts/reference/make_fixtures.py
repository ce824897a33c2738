#!/usr/bin/env python3
"""Builds the model fixtures the test suite runs on, from the SmolLM2 GGUF.

  OUT/smollm2-mlx/   SmolLM2-135M-Instruct as an mlx-lm directory made from the
                     very same GGUF weights (Q4_1/Q8_0 kept bit-exact as MLX
                     affine 4/8-bit, f32 scales/norms), by gguf_to_mlx.py.
  OUT/tiny-qwen2/    random-weight Qwen2 (q/k/v biases), seeded
  OUT/tiny-qwen3/    random-weight Qwen3 (q/k norms), seeded
The tiny models use the SmolLM2 tokenizer: their job is to pin each
architecture's arithmetic, not language. Weights come from MLX's seeded RNG,
so the same MLX version rebuilds them bit for bit; tests check a sha256.

Usage: make_fixtures.py SMOLLM2.gguf TOKENIZER_DIR OUT
"""
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

HERE = Path(__file__).resolve().parent

TINY = {
    "qwen2": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=49152,
                  max_position_embeddings=2048, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  vocab_size=49152, max_position_embeddings=2048, rope_theta=1000000.0,
                  tie_word_embeddings=True),
}


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def copy_tokenizer(tok_dir, out):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out / name)


def tiny_model(arch, tok_dir, out, seed):
    import importlib
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    cfg = dict(TINY[arch], eos_token_id=2, bos_token_id=1)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copy_tokenizer(tok_dir, out)


def main():
    gguf, tok_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    smol = out / "smollm2-mlx"
    subprocess.run([sys.executable, str(HERE / "gguf_to_mlx.py"), str(gguf), str(smol),
                    "--tokenizer-dir", str(tok_dir), "--dtype", "float32"], check=True)
    for seed, arch in enumerate(TINY, start=1):
        tiny_model(arch, tok_dir, out / f"tiny-{arch}", seed)
    hashes = {d.name: sha256(d / "model.safetensors") for d in sorted(out.iterdir()) if (d / "model.safetensors").exists()}
    (out / "hashes.json").write_text(json.dumps(hashes, indent=2) + "\n")
    print(json.dumps(hashes, indent=2))


if __name__ == "__main__":
    main()
