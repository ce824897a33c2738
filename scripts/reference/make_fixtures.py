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

  OUT/tiny-gemma3-vlm[-4bit]/, OUT/tiny-qwen25-vl[-4bit]/, OUT/tiny-qwen3-vl[-4bit]/,
  OUT/tiny-qwen3_5[-4bit]/, OUT/tiny-gemma4[-4bit]/, OUT/tiny-gemma4-unified[-4bit]/,
  OUT/tiny-{qwen3-vl,qwen3_5,gemma4,gemma4-unified}-bf16/, OUT/tiny-gemma4-moe[-4bit]/
                     random-weight VLMs with the real Gemma 3 / Qwen2.5
                     tokenizers (from the GGUF metadata), in f32 and as
                     mlx-community style 4-bit and bf16 copies

Usage: make_fixtures.py SMOLLM2.gguf TOKENIZER_DIR OUT GEMMA3.gguf[.part] QWEN25.gguf[.part]
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
sys.path.insert(0, str(HERE))
import gguf_tokenizer  # noqa: E402

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


# A tiny Gemma 3 VLM for the daemon's end-to-end image tests: random weights
# under mlx-community checkpoint names, SigLIP 64x64/8 tower, 16 image tokens,
# and the real Gemma 3 tokenizer (SentencePiece, rebuilt from the Gemma 3 GGUF's
# metadata, plus <image_soft_token> at 262144 as in the released VLMs), the
# real chat template, and the processor files transformers/mlx-vlm read.
TEMPLATES = HERE / "templates"


def gguf_tokenizer_files(gguf_part, out, extra_special=(), **config):
    """tokenizer.json from the GGUF metadata; tokenizer_config.json from `config`."""
    meta = gguf_tokenizer.read_metadata(gguf_part)
    tok = gguf_tokenizer.hf_tokenizer(meta, extra_special)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = dict(config, tokenizer_class="PreTrainedTokenizerFast", model_max_length=131072)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return tok


def tiny_gemma3_vlm(gemma_gguf, out, seed):
    out.mkdir(parents=True, exist_ok=True)
    tok = gguf_tokenizer_files(
        gemma_gguf, out, ["<image_soft_token>"], bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", add_bos_token=True, chat_template=(TEMPLATES / "gemma3.jinja").read_text(),
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    vocab = len(tok["model"]["vocab"])
    image_token = vocab - 1
    text = dict(model_type="gemma3_text", hidden_size=96, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, vocab_size=vocab,
                sliding_window_pattern=2, sliding_window=1024, mm_tokens_per_image=16, max_position_embeddings=4096)
    vision = dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  patch_size=8, image_size=64, layer_norm_eps=1e-6)
    mx.random.seed(seed)
    w = {}
    def normal(name, shape, scale=0.05):
        w[name] = mx.random.normal(shape) * scale
    lm = "language_model.model"
    normal(f"{lm}.embed_tokens.weight", (vocab, 96), 0.5)
    normal(f"{lm}.norm.weight", (96,), 0.2)
    for i in range(2):
        p = f"{lm}.layers.{i}"
        for n, shape in [("self_attn.q_proj", (128, 96)), ("self_attn.k_proj", (64, 96)), ("self_attn.v_proj", (64, 96)),
                         ("self_attn.o_proj", (96, 128)), ("mlp.gate_proj", (128, 96)), ("mlp.up_proj", (128, 96)),
                         ("mlp.down_proj", (96, 128))]:
            normal(f"{p}.{n}.weight", shape, 0.15)
        for n, d in [("self_attn.q_norm", 32), ("self_attn.k_norm", 32), ("input_layernorm", 96),
                     ("post_attention_layernorm", 96), ("pre_feedforward_layernorm", 96), ("post_feedforward_layernorm", 96)]:
            normal(f"{p}.{n}.weight", (d,), 0.2)
    vt = "vision_tower.vision_model"
    normal(f"{vt}.embeddings.patch_embedding.weight", (64, 8, 8, 3), 0.1)
    normal(f"{vt}.embeddings.patch_embedding.bias", (64,))
    normal(f"{vt}.embeddings.position_embedding.weight", (64, 64), 0.1)
    for i in range(2):
        p = f"{vt}.encoder.layers.{i}"
        for n, (o, k) in [("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (64, 64)), ("self_attn.v_proj", (64, 64)),
                          ("self_attn.out_proj", (64, 64)), ("mlp.fc1", (128, 64)), ("mlp.fc2", (64, 128))]:
            normal(f"{p}.{n}.weight", (o, k), 0.15)
            normal(f"{p}.{n}.bias", (o,))
        for n in ("layer_norm1", "layer_norm2"):
            w[f"{p}.{n}.weight"] = 1 + mx.random.normal((64,)) * 0.1
            normal(f"{p}.{n}.bias", (64,))
    w[f"{vt}.post_layernorm.weight"] = 1 + mx.random.normal((64,)) * 0.1
    normal(f"{vt}.post_layernorm.bias", (64,))
    normal("multi_modal_projector.mm_input_projection_weight", (64, 96), 0.2)
    normal("multi_modal_projector.mm_soft_emb_norm.weight", (64,), 0.1)
    out.mkdir(parents=True, exist_ok=True)
    mx.eval(w)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    config = {"model_type": "gemma3", "text_config": text, "vision_config": vision, "image_token_index": image_token,
              "boi_token_index": 255999, "eoi_token_index": 256000, "mm_tokens_per_image": 16,
              "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
         "do_resize": True, "size": {"height": 64, "width": 64}, "resample": 2, "do_rescale": True,
         "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
         "do_convert_rgb": None, "do_pan_and_scan": None}, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": 16, "processor_class": "Gemma3Processor"}, indent=2) + "\n")


def tiny_qwen25_vl(qwen_gguf, out, seed):
    """A tiny Qwen2.5-VL for the daemon's image tests (same spirit as the Gemma 3
    one): the real Qwen2.5 tokenizer (from the Qwen2.5 GGUF's metadata, which
    holds the vision tokens) and Qwen2.5-VL's chat template."""
    out.mkdir(parents=True, exist_ok=True)
    tok = gguf_tokenizer_files(
        qwen_gguf, out, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=(TEMPLATES / "qwen2_5_vl.jinja").read_text())
    vocab = len(tok["model"]["vocab"])
    mx.random.seed(seed)
    w = {}
    def normal(name, shape, scale=0.1):
        w[name] = mx.random.normal(shape) * scale
    lm = "language_model.model"
    normal(f"{lm}.embed_tokens.weight", (vocab, 64), 0.5)
    w[f"{lm}.norm.weight"] = 1 + mx.random.normal((64,)) * 0.1
    normal("language_model.lm_head.weight", (vocab, 64), 0.2)
    for i in range(2):
        p = f"{lm}.layers.{i}"
        for n, (o, k), bias in [("self_attn.q_proj", (64, 64), True), ("self_attn.k_proj", (32, 64), True),
                                ("self_attn.v_proj", (32, 64), True), ("self_attn.o_proj", (64, 64), False),
                                ("mlp.gate_proj", (128, 64), False), ("mlp.up_proj", (128, 64), False),
                                ("mlp.down_proj", (64, 128), False)]:
            normal(f"{p}.{n}.weight", (o, k), 0.15)
            if bias:
                normal(f"{p}.{n}.bias", (o,), 0.05)
        for n in ("input_layernorm", "post_attention_layernorm"):
            w[f"{p}.{n}.weight"] = 1 + mx.random.normal((64,)) * 0.1
    vt = "vision_tower"
    normal(f"{vt}.patch_embed.proj.weight", (32, 2, 14, 14, 3), 0.02)
    for i in range(2):
        p = f"{vt}.blocks.{i}"
        for n in ("norm1", "norm2"):
            w[f"{p}.{n}.weight"] = 1 + mx.random.normal((32,)) * 0.1
        for n, (o, k) in [("attn.qkv", (96, 32)), ("attn.proj", (32, 32)), ("mlp.gate_proj", (64, 32)),
                          ("mlp.up_proj", (64, 32)), ("mlp.down_proj", (32, 64))]:
            normal(f"{p}.{n}.weight", (o, k), 0.15)
            normal(f"{p}.{n}.bias", (o,), 0.05)
    w[f"{vt}.merger.ln_q.weight"] = 1 + mx.random.normal((32,)) * 0.1
    normal(f"{vt}.merger.mlp.0.weight", (128, 128), 0.1)
    normal(f"{vt}.merger.mlp.0.bias", (128,), 0.05)
    normal(f"{vt}.merger.mlp.2.weight", (64, 128), 0.1)
    normal(f"{vt}.merger.mlp.2.bias", (64,), 0.05)
    out.mkdir(parents=True, exist_ok=True)
    mx.eval(w)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    config = {"model_type": "qwen2_5_vl", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": vocab,
              "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
              "tie_word_embeddings": False, "max_position_embeddings": 4096,
              "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64,
                                "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                "window_size": 56, "fullatt_block_indexes": [1]},
              "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
              "vision_end_token_id": 151653, "bos_token_id": 151643, "eos_token_id": 151645}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
         "min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2,
         "merge_size": 2, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
         "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
         "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True}, indent=2) + "\n")


def qwen3_vl_tower(normal, norm, linear, deepstack):
    """Qwen3-VL's tiny tower (shared by Qwen3.5): 16-pixel patches, an 8x8
    position table, 3 LayerNorm blocks, the 2x2 merger into 64 wide, and
    `deepstack` deepstack mergers (in the RNG order the fixtures were made in)."""
    vt = "vision_tower"
    normal(f"{vt}.patch_embed.proj.weight", (32, 2, 16, 16, 3), 0.02)
    normal(f"{vt}.patch_embed.proj.bias", (32,), 0.05)
    normal(f"{vt}.pos_embed.weight", (64, 32), 0.3)
    for i in range(3):
        p = f"{vt}.blocks.{i}"
        norm(f"{p}.norm1", 32, bias=True)
        norm(f"{p}.norm2", 32, bias=True)
        linear(f"{p}.attn.qkv", 96, 32)
        linear(f"{p}.attn.proj", 32, 32)
        linear(f"{p}.mlp.linear_fc1", 64, 32)
        linear(f"{p}.mlp.linear_fc2", 32, 64)
    norm(f"{vt}.merger.norm", 32, bias=True)
    linear(f"{vt}.merger.linear_fc1", 128, 128, 0.1)
    linear(f"{vt}.merger.linear_fc2", 64, 128, 0.1)
    for j in range(deepstack):
        p = f"{vt}.deepstack_merger_list.{j}"
        norm(f"{p}.norm", 128, bias=True)
        linear(f"{p}.linear_fc1", 128, 128, 0.1)
        linear(f"{p}.linear_fc2", 64, 128, 0.1)


def tiny_qwen3_vl(qwen_gguf, out, seed):
    """A tiny Qwen3-VL: the Qwen2.5 tokenizer (Qwen3-VL's vocabulary is the same
    151,643 pieces with the vision tokens at the same ids), Qwen3-VL's chat
    template (no default system turn), its processor config (16-pixel patches,
    mean/std 0.5) and random weights under mlx-community's names: a 3-block
    tower with LayerNorm blocks, a learned 8x8 position table, two deepstack
    mergers (after blocks 0 and 1, added after text layers 0 and 1), and a
    2-layer Qwen3 decoder (q/k norms, interleaved multimodal rope)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = gguf_tokenizer_files(
        qwen_gguf, out, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=(TEMPLATES / "qwen3_vl.jinja").read_text())
    vocab = len(tok["model"]["vocab"])
    mx.random.seed(seed)
    w = {}
    def normal(name, shape, scale=0.1):
        w[name] = mx.random.normal(shape) * scale
    def norm(name, d, bias=False):
        w[f"{name}.weight"] = 1 + mx.random.normal((d,)) * 0.1
        if bias:
            normal(f"{name}.bias", (d,), 0.05)
    def linear(name, o, k, scale=0.15, bias=True):
        normal(f"{name}.weight", (o, k), scale)
        if bias:
            normal(f"{name}.bias", (o,), 0.05)
    lm = "language_model.model"
    normal(f"{lm}.embed_tokens.weight", (vocab, 64), 0.5)
    norm(f"{lm}.norm", 64)
    for i in range(2):
        p = f"{lm}.layers.{i}"
        for n, (o, k) in [("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)), ("self_attn.v_proj", (32, 64)),
                          ("self_attn.o_proj", (64, 64)), ("mlp.gate_proj", (128, 64)), ("mlp.up_proj", (128, 64)),
                          ("mlp.down_proj", (64, 128))]:
            linear(f"{p}.{n}", o, k, bias=False)
        for n, d in [("self_attn.q_norm", 16), ("self_attn.k_norm", 16), ("input_layernorm", 64),
                     ("post_attention_layernorm", 64)]:
            norm(f"{p}.{n}", d)
    qwen3_vl_tower(normal, norm, linear, deepstack=2)
    mx.eval(w)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    text = {"model_type": "qwen3_vl_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": vocab, "rope_theta": 5000000.0, "max_position_embeddings": 4096,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            "tie_word_embeddings": True}
    config = {"model_type": "qwen3_vl", "text_config": text,
              "vision_config": {"model_type": "qwen3_vl", "depth": 3, "hidden_size": 32, "intermediate_size": 64,
                                "out_hidden_size": 64, "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                                "temporal_patch_size": 2, "num_position_embeddings": 64,
                                "deepstack_visual_indexes": [0, 1], "hidden_act": "gelu_pytorch_tanh"},
              "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
              "vision_end_token_id": 151653, "tie_word_embeddings": True, "eos_token_id": [151645, 151643]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
         "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}, "patch_size": 16,
         "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
         "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
         "do_convert_rgb": True}, indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
         "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128 * 8}, "patch_size": 16,
         "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
         "fps": 2, "min_frames": 4, "max_frames": 16, "do_sample_frames": True}, indent=2) + "\n")


def tiny_qwen3_5(qwen_gguf, out, seed):
    """A tiny Qwen3.5: the Qwen2.5 tokenizer (the vision tokens at Qwen2.5's ids:
    Qwen3.5's own 248k vocabulary is not packaged anywhere here), Qwen3-VL's chat
    template and processor configs, and random weights under mlx-community's
    names: Qwen3-VL's 3-block tower without deepstack, and a 4-layer hybrid
    decoder (layers 0-2 Gated DeltaNet with a 4-tap depthwise convolution, layer
    3 gated attention with partial rotary 0.25 and interleaved multimodal rope)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = gguf_tokenizer_files(
        qwen_gguf, out, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=(TEMPLATES / "qwen3_vl.jinja").read_text())
    vocab = len(tok["model"]["vocab"])
    mx.random.seed(seed)
    w = {}
    def normal(name, shape, scale=0.1):
        w[name] = mx.random.normal(shape) * scale
    def norm(name, d, bias=False):
        w[f"{name}.weight"] = 1 + mx.random.normal((d,)) * 0.1
        if bias:
            normal(f"{name}.bias", (d,), 0.05)
    def linear(name, o, k, scale=0.15, bias=True):
        normal(f"{name}.weight", (o, k), scale)
        if bias:
            normal(f"{name}.bias", (o,), 0.05)
    hidden, hk, hv, dk, dv, kernel = 64, 2, 4, 32, 16, 4
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    lm = "language_model.model"
    normal(f"{lm}.embed_tokens.weight", (vocab, hidden), 0.5)
    norm(f"{lm}.norm", hidden)
    for i in range(4):
        p = f"{lm}.layers.{i}"
        for n, (o, k) in [("mlp.gate_proj", (128, hidden)), ("mlp.up_proj", (128, hidden)),
                          ("mlp.down_proj", (hidden, 128))]:
            linear(f"{p}.{n}", o, k, bias=False)
        norm(f"{p}.input_layernorm", hidden)
        norm(f"{p}.post_attention_layernorm", hidden)
        if i == 3:
            for n, (o, k) in [("q_proj", (2 * 4 * 32, hidden)), ("k_proj", (2 * 32, hidden)),
                              ("v_proj", (2 * 32, hidden)), ("o_proj", (hidden, 4 * 32))]:
                linear(f"{p}.self_attn.{n}", o, k, bias=False)
            norm(f"{p}.self_attn.q_norm", 32)
            norm(f"{p}.self_attn.k_norm", 32)
        else:
            a = f"{p}.linear_attn"
            for n, (o, k) in [("in_proj_qkv", (conv_dim, hidden)), ("in_proj_z", (value_dim, hidden)),
                              ("in_proj_b", (hv, hidden)), ("in_proj_a", (hv, hidden)),
                              ("out_proj", (hidden, value_dim))]:
                linear(f"{a}.{n}", o, k, bias=False)
            # MLX's Conv1d layout [channels, kernel, 1] (what mlx-vlm's sanitize leaves).
            normal(f"{a}.conv1d.weight", (conv_dim, kernel, 1), 0.3)
            w[f"{a}.dt_bias"] = mx.ones((hv,)) + mx.random.normal((hv,)) * 0.1
            w[f"{a}.A_log"] = mx.log(mx.random.uniform(1.0, 16.0, (hv,)))
            norm(f"{a}.norm", dv)
    qwen3_vl_tower(normal, norm, linear, deepstack=0)
    mx.eval(w)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    text = {"model_type": "qwen3_5_text", "hidden_size": hidden, "num_hidden_layers": 4, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
            "vocab_size": vocab, "max_position_embeddings": 4096, "full_attention_interval": 4,
            "linear_num_value_heads": hv, "linear_num_key_heads": hk, "linear_key_head_dim": dk,
            "linear_value_head_dim": dv, "linear_conv_kernel_dim": kernel, "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25, "mrope_interleaved": True},
            "tie_word_embeddings": True, "eos_token_id": [151645, 151643]}
    config = {"model_type": "qwen3_5", "text_config": text,
              "vision_config": {"model_type": "qwen3_5", "depth": 3, "hidden_size": 32, "intermediate_size": 64,
                                "out_hidden_size": hidden, "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                                "temporal_patch_size": 2, "num_position_embeddings": 64,
                                "deepstack_visual_indexes": [], "hidden_act": "gelu_pytorch_tanh"},
              "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
              "vision_end_token_id": 151653, "tie_word_embeddings": True, "eos_token_id": [151645, 151643]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    src = out.parent / "tiny-qwen3-vl"
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        shutil.copy(src / name, out / name)


# Gemma 4's special tokens at their ids in Gemma 4's 262,144-piece vocabulary;
# in Gemma 3's (the one reachable here) these ids hold unused or image markers.
GEMMA4_SPECIAL = {46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>",
                  51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>",
                  105: "<|turn>", 106: "<turn|>", 255999: "<|image>", 256000: "<|audio>", 258880: "<|image|>",
                  258881: "<|audio|>", 258882: "<image|>", 258883: "<audio|>", 258884: "<|video|>"}


def gemma4_tokenizer(gemma_gguf, out):
    """Gemma's vocabulary from the Gemma 3 GGUF with Gemma 4's special tokens
    written over the pieces at their ids (said so in the README)."""
    tok = gguf_tokenizer.hf_tokenizer(gguf_tokenizer.read_metadata(gemma_gguf))
    vocab = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    added = {a["id"]: a for a in tok["added_tokens"]}
    for i, content in GEMMA4_SPECIAL.items():
        del vocab[by_id[i]]
        vocab[content] = i
        entry = added.setdefault(i, {"id": i, "single_word": False, "lstrip": False, "rstrip": False,
                                     "normalized": False})
        entry.update(content=content, special=True)
    tok["added_tokens"] = sorted(added.values(), key=lambda a: a["id"])
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=131072, bos_token="<bos>",
               eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", add_bos_token=True,
               chat_template=(TEMPLATES / "gemma4.jinja").read_text(),
               extra_special_tokens={"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                                     "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
                                     "video_token": "<|video|>"})
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return len(vocab)


def tiny_gemma4(gemma_gguf, out, seed):
    """A tiny Gemma 4 (E-model shape): 6 decoder layers (two of sliding-window
    32, one full, twice), head_dim 32 on sliding and 64 on full layers with
    proportional rope on a quarter of them, per-layer input embeddings of 8,
    the last two layers sharing the KV of layers 3 and 2 with double-wide
    MLPs, logit soft-cap 30, images bidirectional; a 2-layer vision tower
    (16-pixel patches, a 2x256 position table, 2-D rope, clippable linears
    with finite clamps, 3x3 pooling) with a 70-token budget per image; a 2-block Conformer audio tower (two
    stride-2 convolutions, chunked local attention with relative positions,
    clippable linears with clamps that bite, an output projection of 48)."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = gemma4_tokenizer(gemma_gguf, out)
    mx.random.seed(seed)
    w = {}
    def normal(name, shape, scale=0.1):
        w[name] = mx.random.normal(shape) * scale
    def norm(name, d):
        w[f"{name}.weight"] = 1 + mx.random.normal((d,)) * 0.1
    hidden, layers, ple, inter, heads = 64, 6, 8, 128, 2
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    shared_from = 4
    lm = "language_model.model"
    normal(f"{lm}.embed_tokens.weight", (vocab, hidden), 0.1)
    normal(f"{lm}.embed_tokens_per_layer.weight", (vocab, layers * ple), 0.5)
    normal(f"{lm}.per_layer_model_projection.weight", (layers * ple, hidden), 0.15)
    norm(f"{lm}.per_layer_projection_norm", ple)
    norm(f"{lm}.norm", hidden)
    for i, kind in enumerate(types):
        p = f"{lm}.layers.{i}"
        hd = 64 if kind == "full_attention" else 32
        width = inter * (2 if i >= shared_from else 1)
        attn = [("q_proj", (heads * hd, hidden)), ("o_proj", (hidden, heads * hd))]
        if i < shared_from:
            attn += [("k_proj", (hd, hidden)), ("v_proj", (hd, hidden))]
            norm(f"{p}.self_attn.k_norm", hd)
        for n, shape in attn:
            normal(f"{p}.self_attn.{n}.weight", shape, 0.3)
        norm(f"{p}.self_attn.q_norm", hd)
        for n, shape in [("gate_proj", (width, hidden)), ("up_proj", (width, hidden)), ("down_proj", (hidden, width))]:
            normal(f"{p}.mlp.{n}.weight", shape, 0.3)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_per_layer_input_norm"):
            norm(f"{p}.{n}", hidden)
        normal(f"{p}.per_layer_input_gate.weight", (ple, hidden), 0.15)
        normal(f"{p}.per_layer_projection.weight", (hidden, ple), 0.15)
        w[f"{p}.layer_scalar"] = 1 + mx.random.normal((1,)) * 0.1
    vt, vh, vi = "vision_tower", 32, 64
    normal(f"{vt}.patch_embedder.input_proj.weight", (vh, 3 * 16 * 16), 0.05)
    normal(f"{vt}.patch_embedder.position_embedding_table", (2, 256, vh), 0.1)
    for i in range(2):
        p = f"{vt}.encoder.layers.{i}"
        for n, (o, k) in [("self_attn.q_proj", (vh, vh)), ("self_attn.k_proj", (vh, vh)),
                          ("self_attn.v_proj", (vh, vh)), ("self_attn.o_proj", (vh, vh)),
                          ("mlp.gate_proj", (vi, vh)), ("mlp.up_proj", (vi, vh)), ("mlp.down_proj", (vh, vi))]:
            normal(f"{p}.{n}.linear.weight", (o, k), 0.2)
            # Clamps that bite: a few inputs and outputs fall outside them.
            w[f"{p}.{n}.input_min"] = mx.array(-1.5)
            w[f"{p}.{n}.input_max"] = mx.array(1.5)
            w[f"{p}.{n}.output_min"] = mx.array(-1.0)
            w[f"{p}.{n}.output_max"] = mx.array(1.0)
        norm(f"{p}.self_attn.q_norm", 16)
        norm(f"{p}.self_attn.k_norm", 16)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            norm(f"{p}.{n}", vh)
    normal("embed_vision.embedding_projection.weight", (hidden, vh), 0.2)
    # The audio tower (drawn after everything else, so the weights above stay
    # what they were without it): a 2-block Conformer of width 32.
    at, ah, ao = "audio_tower", 32, 48
    sub = f"{at}.subsample_conv_projection"
    normal(f"{sub}.layer0.conv.weight", (8, 3, 3, 1), 0.3)
    norm(f"{sub}.layer0.norm", 8)
    normal(f"{sub}.layer1.conv.weight", (4, 3, 3, 8), 0.3)
    norm(f"{sub}.layer1.norm", 4)
    normal(f"{sub}.input_proj_linear.weight", (ah, 32 * 4), 0.1)
    def clippable(name, shape, scale):
        normal(f"{name}.linear.weight", shape, scale)
        w[f"{name}.input_min"], w[f"{name}.input_max"] = mx.array(-4.0), mx.array(4.0)
        w[f"{name}.output_min"], w[f"{name}.output_max"] = mx.array(-3.0), mx.array(3.0)
    for i in range(2):
        p = f"{at}.layers.{i}"
        for ff in ("feed_forward1", "feed_forward2"):
            norm(f"{p}.{ff}.pre_layer_norm", ah)
            clippable(f"{p}.{ff}.ffw_layer_1", (4 * ah, ah), 0.2)
            clippable(f"{p}.{ff}.ffw_layer_2", (ah, 4 * ah), 0.1)
            norm(f"{p}.{ff}.post_layer_norm", ah)
        for n in ("q_proj", "k_proj", "v_proj", "post"):
            clippable(f"{p}.self_attn.{n}", (ah, ah), 0.3)
        normal(f"{p}.self_attn.relative_k_proj.weight", (ah, ah), 0.3)
        normal(f"{p}.self_attn.per_dim_scale", (16,), 0.5)
        norm(f"{p}.lconv1d.pre_layer_norm", ah)
        clippable(f"{p}.lconv1d.linear_start", (2 * ah, ah), 0.3)
        normal(f"{p}.lconv1d.depthwise_conv1d.weight", (ah, 5, 1), 0.4)
        norm(f"{p}.lconv1d.conv_norm", ah)
        clippable(f"{p}.lconv1d.linear_end", (ah, ah), 0.3)
        for n in ("norm_pre_attn", "norm_post_attn", "norm_out"):
            norm(f"{p}.{n}", ah)
    normal(f"{at}.output_proj.weight", (ao, ah), 0.2)
    normal(f"{at}.output_proj.bias", (ao,), 0.1)
    normal("embed_audio.embedding_projection.weight", (hidden, ao), 0.2)
    mx.eval(w)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    text = {"model_type": "gemma4_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": 1,
            "head_dim": 32, "global_head_dim": 64, "rms_norm_eps": 1e-6, "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab, "hidden_size_per_layer_input": ple,
            "num_kv_shared_layers": layers - shared_from, "use_double_wide_mlp": True, "layer_types": types,
            "sliding_window": 32, "final_logit_softcapping": 30.0, "max_position_embeddings": 4096,
            "use_bidirectional_attention": "vision", "attention_k_eq_v": False, "enable_moe_block": False,
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                   "rope_type": "proportional"},
                                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
            "tie_word_embeddings": True}
    vision = {"model_type": "gemma4_vision", "hidden_size": vh, "intermediate_size": vi, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 16,
              "position_embedding_size": 256, "pooling_kernel_size": 3, "default_output_length": 70,
              "use_clipped_linears": True, "standardize": False, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}}
    audio = {"model_type": "gemma4_audio", "hidden_size": ah, "num_hidden_layers": 2, "num_attention_heads": 2,
             "subsampling_conv_channels": [8, 4], "conv_kernel_size": 5, "residual_weight": 0.5,
             "attention_chunk_size": 12, "attention_context_left": 13, "attention_context_right": 0,
             "attention_logit_cap": 50.0, "attention_invalid_logits_value": -1e9, "use_clipped_linears": True,
             "rms_norm_eps": 1e-6, "gradient_clipping": 1e10, "output_proj_dims": ao}
    config = {"model_type": "gemma4", "text_config": text, "vision_config": vision, "audio_config": audio,
              "image_token_id": 258880, "audio_token_id": 258881, "video_token_id": 258884, "boi_token_id": 255999,
              "eoi_token_id": 258882, "boa_token_id": 256000, "eoa_token_id": 258883,
              "vision_soft_tokens_per_image": 70, "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0,
              "tie_word_embeddings": True}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma4Processor", "image_seq_length": 70, "audio_seq_length": 750,
         "image_processor": {"image_processor_type": "Gemma4ImageProcessor", "do_resize": True, "resample": 3,
                             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
                             "patch_size": 16, "max_soft_tokens": 70, "pooling_kernel_size": 3},
         "video_processor": {"video_processor_type": "Gemma4VideoProcessor", "patch_size": 16,
                             "max_soft_tokens": 70, "pooling_kernel_size": 3, "num_frames": 32}}, indent=2) + "\n")


def tiny_gemma4_moe(src, out, seed):
    """tiny-gemma4 with Gemma 4's mixture-of-experts block on every layer
    (26B-A4B's feed-forward: the dense MLP beside a router — RMS norm with a
    learned scale, projection, top 2 of 4 experts, softmax, per-expert scale —
    and GELU-gated experts of 32, each branch normed, their sum normed
    again). The rest is tiny-gemma4's weights, unchanged; the audio tower is
    dropped (26B-A4B has none)."""
    out.mkdir(parents=True, exist_ok=True)
    w = {k: v for k, v in mx.load(str(src / "model.safetensors")).items()
         if not k.startswith(("audio_tower.", "embed_audio."))}
    cfg = json.loads((src / "config.json").read_text())
    t = cfg["text_config"]
    experts, top_k, inter, hidden = 4, 2, 32, t["hidden_size"]
    t.update({"enable_moe_block": True, "num_experts": experts, "top_k_experts": top_k, "moe_intermediate_size": inter})
    cfg["audio_config"] = None
    mx.random.seed(seed)
    for i in range(t["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}"
        w[f"{p}.router.proj.weight"] = mx.random.normal((experts, hidden)) * 0.5
        w[f"{p}.router.scale"] = 1 + mx.random.normal((hidden,)) * 0.1
        w[f"{p}.router.per_expert_scale"] = 1 + mx.random.normal((experts,)) * 0.1
        e = f"{p}.experts.switch_glu"
        w[f"{e}.gate_proj.weight"] = mx.random.normal((experts, inter, hidden)) * 0.3
        w[f"{e}.up_proj.weight"] = mx.random.normal((experts, inter, hidden)) * 0.3
        w[f"{e}.down_proj.weight"] = mx.random.normal((experts, hidden, inter)) * 0.3
        for n in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            w[f"{p}.{n}.weight"] = 1 + mx.random.normal((hidden,)) * 0.1
    mx.eval(w)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def tiny_gemma4_unified(gemma_gguf, out, seed, hidden=64, layers=6, d=32, posemb=64):
    """A tiny Gemma 4 unified (or, with the real widths, `wide_gemma4_unified`'s): no tower. Images as 48x48 patches through
    LayerNorm -> Linear -> LayerNorm, learned x/y positions, LayerNorm, then
    the RMS-normed projection; audio as raw 640-sample frames through its
    projection. The decoder: 6 layers (5 sliding of window 32 : 1 full),
    head_dim 32 sliding / 64 full with proportional rope, values = keys on
    the full layers (attention_k_eq_v, one global KV head), no per-layer
    inputs, no KV sharing, logit soft-cap 30; a 280-token image budget
    (mlx-vlm's AutoProcessor path keeps 280 whatever the config says), 70 per
    video frame."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = gemma4_tokenizer(gemma_gguf, out)
    mx.random.seed(seed)
    w = {}
    def normal(name, shape, scale=0.1):
        w[name] = mx.random.normal(shape) * scale
    def norm(name, d, bias=False):
        w[f"{name}.weight"] = 1 + mx.random.normal((d,)) * 0.1
        if bias:
            w[f"{name}.bias"] = mx.random.normal((d,)) * 0.1
    inter, heads = 128, 2
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    lm = "language_model.model"
    normal(f"{lm}.embed_tokens.weight", (vocab, hidden), 0.1)
    norm(f"{lm}.norm", hidden)
    for i, kind in enumerate(types):
        p = f"{lm}.layers.{i}"
        full = kind == "full_attention"
        hd = 64 if full else 32
        attn = [("q_proj", (heads * hd, hidden)), ("o_proj", (hidden, heads * hd)), ("k_proj", (hd, hidden))]
        if not full:
            attn.append(("v_proj", (hd, hidden)))
        for n, shape in attn:
            normal(f"{p}.self_attn.{n}.weight", shape, 0.3)
        norm(f"{p}.self_attn.q_norm", hd)
        norm(f"{p}.self_attn.k_norm", hd)
        for n, shape in [("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))]:
            normal(f"{p}.mlp.{n}.weight", shape, 0.3)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            norm(f"{p}.{n}", hidden)
        w[f"{p}.layer_scalar"] = 1 + mx.random.normal((1,)) * 0.1
    ve, patch = "vision_embedder", 48 * 48 * 3
    norm(f"{ve}.patch_ln1", patch, bias=True)
    normal(f"{ve}.patch_dense.weight", (d, patch), 0.05)
    normal(f"{ve}.patch_dense.bias", (d,), 0.1)
    norm(f"{ve}.patch_ln2", d, bias=True)
    normal(f"{ve}.pos_embedding", (posemb, 2, d), 0.3)
    norm(f"{ve}.pos_norm", d, bias=True)
    normal("embed_vision.embedding_projection.weight", (hidden, d), 0.2)
    normal("embed_audio.embedding_projection.weight", (hidden, 640), 0.05)
    mx.eval(w)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    text = {"model_type": "gemma4_unified_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": 1,
            "num_global_key_value_heads": 1, "head_dim": 32, "global_head_dim": 64, "rms_norm_eps": 1e-6,
            "vocab_size": vocab, "vocab_size_per_layer_input": vocab, "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0, "use_double_wide_mlp": False, "layer_types": types,
            "sliding_window": 32, "final_logit_softcapping": 30.0, "max_position_embeddings": 4096,
            "use_bidirectional_attention": "vision", "attention_k_eq_v": True, "enable_moe_block": False,
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                   "rope_type": "proportional"},
                                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
            "tie_word_embeddings": True}
    vision = {"model_type": "gemma4_unified_vision", "patch_size": 16, "pooling_kernel_size": 3,
              "model_patch_size": 48, "mm_embed_dim": d, "mm_posemb_size": posemb, "num_soft_tokens": 280,
              "rms_norm_eps": 1e-6, "output_proj_dims": d}
    audio = {"model_type": "gemma4_unified_audio", "audio_samples_per_token": 640, "audio_embed_dim": 640,
             "hidden_size": 640, "output_proj_dims": 640, "rms_norm_eps": 1e-6}
    config = {"model_type": "gemma4_unified", "text_config": text, "vision_config": vision, "audio_config": audio,
              "image_token_id": 258880, "audio_token_id": 258881, "video_token_id": 258884, "boi_token_id": 255999,
              "eoi_token_id": 258882, "boa_token_id": 256000, "eoa_token_index": 258883,
              "vision_soft_tokens_per_image": 280, "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0,
              "tie_word_embeddings": True}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma4UnifiedProcessor", "image_seq_length": 280, "audio_seq_length": 750,
         "image_processor": {"image_processor_type": "Gemma4UnifiedImageProcessor", "do_resize": True,
                             "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
                             "patch_size": 16, "max_soft_tokens": 280, "pooling_kernel_size": 3,
                             "model_patch_size": 48},
         "video_processor": {"video_processor_type": "Gemma4UnifiedVideoProcessor", "patch_size": 16,
                             "max_soft_tokens": 70, "pooling_kernel_size": 3, "model_patch_size": 48,
                             "num_frames": 32},
         "feature_extractor": {"feature_extractor_type": "Gemma4UnifiedAudioFeatureExtractor",
                               "feature_size": 640, "sampling_rate": 16000, "audio_samples_per_token": 640}},
        indent=2) + "\n")


def wide_gemma4_unified(gemma_gguf, out):
    """For `scripts/bench images` only (not a test fixture): Gemma 4 unified's
    patch embedder and projection at the released widths (6912 -> 3840, a
    1120-row position table, 3840 -> 3840), so that encoding an image costs
    what it costs in the real model, and so does storing its 280 x 3840 soft
    tokens. The decoder is 3840 wide too but 2 layers deep, with the 262,144
    embedding rows in 4 bits (the embedder stays f32): the bench asks whether
    the feature store pays for itself here, and that is the embedder's time
    against the store's."""
    tmp = out.with_name(out.name + "-f32")
    tiny_gemma4_unified(gemma_gguf, tmp, 13, hidden=3840, layers=2, d=3840, posemb=1120)
    quantized_copy(tmp, out, group=64)
    shutil.rmtree(tmp)


def quantized_copy(src, out, bits=4, group=32):
    """An mlx-community style 4-bit copy: the language model's 2-D weights whose
    rows split into groups become (weight uint32, scales, biases); norms and
    biases stay as they are, and so do the vision tower and the projector
    (mlx-vlm's converter leaves multimodal modules unquantized)."""
    out.mkdir(parents=True, exist_ok=True)
    w = mx.load(str(src / "model.safetensors"))
    q = {}
    for k, v in w.items():
        # 2-D weights, and the experts' stacked [experts, out, in] ones.
        if k.startswith("language_model.") and k.endswith(".weight") and v.ndim in (2, 3) and v.shape[-1] % group == 0:
            wq, scales, biases = mx.quantize(v, group_size=group, bits=bits)
            base = k[: -len(".weight")]
            q[k], q[base + ".scales"], q[base + ".biases"] = wq, scales, biases
        else:
            q[k] = v
    write_copy(src, out, q, quantization={"group_size": group, "bits": bits})


def bf16_copy(src, out):
    """An mlx-community style bf16 copy: every floating-point tensor (towers,
    projectors, clamps and norms included) in bfloat16."""
    out.mkdir(parents=True, exist_ok=True)
    w = mx.load(str(src / "model.safetensors"))
    w = {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in w.items()}
    write_copy(src, out, w, torch_dtype="bfloat16")


def write_copy(src, out, weights, **config):
    """`weights` as OUT's model.safetensors, SRC's other files beside them,
    and SRC's config with `config`'s keys set."""
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main():
    if sys.argv[1] == "--wide-unified":
        wide_gemma4_unified(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    gguf, tok_dir, out, gemma_gguf, qwen_gguf = map(Path, sys.argv[1:6])
    out.mkdir(parents=True, exist_ok=True)
    smol = out / "smollm2-mlx"
    subprocess.run([sys.executable, str(HERE / "gguf_to_mlx.py"), str(gguf), str(smol),
                    "--tokenizer-dir", str(tok_dir), "--dtype", "float32"], check=True)
    for seed, arch in enumerate(TINY, start=1):
        tiny_model(arch, tok_dir, out / f"tiny-{arch}", seed)
    tiny_gemma3_vlm(gemma_gguf, out / "tiny-gemma3-vlm", 7)
    quantized_copy(out / "tiny-gemma3-vlm", out / "tiny-gemma3-vlm-4bit")
    tiny_qwen25_vl(qwen_gguf, out / "tiny-qwen25-vl", 8)
    quantized_copy(out / "tiny-qwen25-vl", out / "tiny-qwen25-vl-4bit")
    tiny_qwen3_vl(qwen_gguf, out / "tiny-qwen3-vl", 9)
    quantized_copy(out / "tiny-qwen3-vl", out / "tiny-qwen3-vl-4bit")
    tiny_qwen3_5(qwen_gguf, out / "tiny-qwen3_5", 10)
    quantized_copy(out / "tiny-qwen3_5", out / "tiny-qwen3_5-4bit")
    tiny_gemma4(gemma_gguf, out / "tiny-gemma4", 11)
    quantized_copy(out / "tiny-gemma4", out / "tiny-gemma4-4bit")
    tiny_gemma4_unified(gemma_gguf, out / "tiny-gemma4-unified", 12)
    tiny_gemma4_moe(out / "tiny-gemma4", out / "tiny-gemma4-moe", 14)
    quantized_copy(out / "tiny-gemma4-moe", out / "tiny-gemma4-moe-4bit")
    quantized_copy(out / "tiny-gemma4-unified", out / "tiny-gemma4-unified-4bit")
    for family in ("tiny-qwen3-vl", "tiny-qwen3_5", "tiny-gemma4", "tiny-gemma4-unified"):
        bf16_copy(out / family, out / f"{family}-bf16")
    hashes = {d.name: sha256(d / "model.safetensors") for d in sorted(out.iterdir()) if (d / "model.safetensors").exists()}
    (out / "hashes.json").write_text(json.dumps(hashes, indent=2) + "\n")
    print(json.dumps(hashes, indent=2))


if __name__ == "__main__":
    main()
