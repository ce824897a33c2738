#!/usr/bin/env python3
"""Reference features from mlx-vlm's own vision classes on tiny random towers.

Builds Gemma 3's SigLIP tower + projector with mlx-vlm 0.7.10 (its model
classes, random seeded weights), runs it on fixed pixel values, and writes one
safetensors file holding the tower's weights (under checkpoint names), the
input pixels and the expected features. The file is small and committed, so
the Rust test needs no Python. mlx-vlm needs mlx >= 0.32.4 while mlxbcd pins
0.32.2: features are compared with a tolerance (see the test).

Usage: mlx_vlm_towers.py OUT_DIR   (run in a venv with mlx[cpu]==0.32.4 mlx-vlm==0.7.10)
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_vlm.models.gemma3 import gemma3 as g3
from mlx_vlm.models.gemma3.config import ModelConfig, TextConfig, VisionConfig

VISION = dict(model_type="siglip_vision_model", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
              num_attention_heads=4, patch_size=8, image_size=64, layer_norm_eps=1e-6)
TEXT = dict(model_type="gemma3_text", hidden_size=96, num_hidden_layers=1, intermediate_size=128,
            mm_tokens_per_image=16, vocab_size=8)


def gemma3_tower(out: Path):
    mx.random.seed(3)
    vc, tc = VisionConfig.from_dict(VISION), TextConfig.from_dict(TEXT)
    cfg = ModelConfig(text_config=tc, vision_config=vc, model_type="gemma3")
    tower = g3.VisionModel(vc)
    projector = g3.Gemma3MultiModalProjector(cfg)
    # mlx-vlm initialises these two to ones; randomise so the test can fail.
    projector.mm_input_projection_weight = mx.random.normal(projector.mm_input_projection_weight.shape) * 0.1
    projector.mm_soft_emb_norm.weight = mx.random.normal(projector.mm_soft_emb_norm.weight.shape) * 0.1
    pixels = mx.random.uniform(-1, 1, (2, VISION["image_size"], VISION["image_size"], 3))
    hidden, _, _ = tower(pixels, output_hidden_states=True)
    features = projector(hidden)
    tensors = {f"vision_tower.{k}": v for k, v in tree_flatten(tower.parameters())}
    tensors.update({f"multi_modal_projector.{k}": v for k, v in tree_flatten(projector.parameters())})
    tensors["test.pixels"] = pixels
    tensors["test.tower_output"] = hidden
    tensors["test.features"] = features
    mx.eval(tensors)
    meta = {"config": json.dumps({"vision_config": VISION, "text_config": TEXT}),
            "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}"}
    mx.save_safetensors(str(out / "gemma3-tower.safetensors"), tensors, metadata=meta)
    print("gemma3 tower features", features.shape)


# A whole tiny Gemma 3 VLM: 2 text layers (one sliding, one global), a small
# vocabulary with the image token inside it, greedy ids from mlx-vlm's own
# prefill order (all but the last position from embeddings, then step).
VLM_TEXT = dict(model_type="gemma3_text", hidden_size=96, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                vocab_size=300, sliding_window_pattern=2, sliding_window=1024, mm_tokens_per_image=16)
IMAGE_TOKEN, BOI, EOI = 250, 251, 252
PROMPT = [2, 17, 42, BOI] + [IMAGE_TOKEN] * 16 + [EOI, 99, 7, 123]
STEPS = 12


def gemma3_vlm(out: Path):
    mx.random.seed(4)
    vc, tc = VisionConfig.from_dict(VISION), TextConfig.from_dict(VLM_TEXT)
    cfg = ModelConfig(text_config=tc, vision_config=vc, model_type="gemma3", image_token_index=IMAGE_TOKEN,
                      hidden_size=VLM_TEXT["hidden_size"], vocab_size=VLM_TEXT["vocab_size"])
    model = g3.Model(cfg)
    mp = model.multi_modal_projector
    mp.mm_input_projection_weight = mx.random.normal(mp.mm_input_projection_weight.shape) * 0.1
    mp.mm_soft_emb_norm.weight = mx.random.normal(mp.mm_soft_emb_norm.weight.shape) * 0.1
    # Gemma norms are offsets from 1; give them spread so the test can fail.
    for name, p in tree_flatten(model.language_model.parameters()):
        if name.endswith("norm.weight"):
            parent = model.language_model
            *path, leaf = name.split(".")
            for part in path:
                parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
            setattr(parent, leaf, mx.random.normal(p.shape) * 0.2)
    pixels = mx.random.uniform(-1, 1, (1, VISION["image_size"], VISION["image_size"], 3))
    ids = mx.array([PROMPT])
    emb = model.get_input_embeddings(ids, pixels.transpose(0, 3, 1, 2), mask=mx.ones(ids.shape)).inputs_embeds
    lm = model.language_model
    cache = lm.make_cache()
    lm(inputs=ids[:, :-1], inputs_embeds=emb[:, :-1], cache=cache)
    logits = lm(inputs=ids[:, -1:], inputs_embeds=emb[:, -1:], cache=cache).logits[:, -1]
    first_logits = logits[0]
    generated = []
    for _ in range(STEPS):
        y = int(mx.argmax(logits, axis=-1).item())
        generated.append(y)
        logits = lm(mx.array([[y]]), cache=cache).logits[:, -1]
    tensors = {k: v for k, v in tree_flatten(model.parameters())}
    tensors["test.pixels"] = pixels
    tensors["test.prompt"] = ids.astype(mx.uint32)
    tensors["test.generated"] = mx.array(generated, mx.uint32)
    tensors["test.first_logits"] = first_logits
    mx.eval(tensors)
    meta = {"config": json.dumps({"vision_config": VISION, "text_config": VLM_TEXT, "image_token_index": IMAGE_TOKEN}),
            "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}"}
    mx.save_safetensors(str(out / "gemma3-vlm-tiny.safetensors"), tensors, metadata=meta)
    print("gemma3 vlm greedy ids", generated)


QWEN_VISION = dict(model_type="qwen2_5_vl", depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=48,
                   num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                   fullatt_block_indexes=[1])
QWEN_GRID = (1, 8, 12)  # t, h, w in patches: 4 x 6 merged units, windows of 2 x 2 (last column partial)


def qwen25_vl_tower(out: Path):
    from mlx_vlm.models.qwen2_5_vl.config import VisionConfig as QVC
    from mlx_vlm.models.qwen2_5_vl.vision import VisionModel as QVM
    mx.random.seed(5)
    tower = QVM(QVC.from_dict(QWEN_VISION))
    # RMS norm weights start at one; spread them so the test can fail.
    for i, blk in enumerate(tower.blocks):
        blk.norm1.weight = 1 + mx.random.normal(blk.norm1.weight.shape) * 0.2
        blk.norm2.weight = 1 + mx.random.normal(blk.norm2.weight.shape) * 0.2
    t, h, w = QWEN_GRID
    patches = mx.random.uniform(-1, 1, (t * h * w, 3 * 2 * 14 * 14))
    features = tower(patches, mx.array([list(QWEN_GRID)]))
    tensors = {f"visual.{k}": v for k, v in tree_flatten(tower.parameters())}
    tensors["test.patches"] = patches
    tensors["test.features"] = features
    # HF Qwen2VLImageProcessor's patchify, for normalized pixels [H, W, 3]
    # (H = 56, W = 84: a 4 x 6 patch grid): duplicate the frame (temporal 2),
    # then order patches 2 x 2 merge group by merge group.
    import numpy as np
    pixels = np.asarray(mx.random.uniform(-1, 1, (56, 84, 3)))
    chw = pixels.transpose(2, 0, 1)[None]
    frames = np.concatenate([chw, chw], axis=0)
    gh, gw = 56 // 14, 84 // 14
    cubes = frames.reshape(1, 2, 3, gh // 2, 2, 14, gw // 2, 2, 14).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    tensors["test.qwen_pixels"] = mx.array(pixels)
    tensors["test.qwen_patchified"] = mx.array(cubes.reshape(gh * gw, 3 * 2 * 14 * 14))
    mx.eval(tensors)
    meta = {"config": json.dumps({"vision_config": QWEN_VISION, "grid": QWEN_GRID}),
            "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}"}
    mx.save_safetensors(str(out / "qwen25-vl-tower.safetensors"), tensors, metadata=meta)
    print("qwen2.5-vl tower features", features.shape)


QWEN_TEXT = dict(model_type="qwen2_5_vl", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=300,
                 rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                 tie_word_embeddings=False, max_position_embeddings=2048)
# 3 text tokens, vision start, 6 image tokens (a 4 x 6 patch grid, 2 x 3 merged), vision end, 3 text tokens.
QWEN_PROMPT = [11, 12, 13, 251, 250, 250, 250, 250, 250, 250, 252, 14, 15, 16]
QWEN_STEPS = 8


def qwen25_vl_language(out: Path):
    from mlx_vlm.models.qwen2_5_vl.config import ModelConfig as QMC, TextConfig as QTC, VisionConfig as QVC
    from mlx_vlm.models.qwen2_5_vl.language import LanguageModel as QLM
    from mlx_vlm.models.cache import KVCache
    mx.random.seed(6)
    tc = QTC.from_dict(QWEN_TEXT)
    mc = QMC(text_config=tc, vision_config=QVC.from_dict(QWEN_VISION), model_type="qwen2_5_vl",
             image_token_id=250, vision_start_token_id=251, vision_end_token_id=252)
    lm = QLM(tc, mc)
    ids = mx.array([QWEN_PROMPT])
    pos, delta = lm.get_rope_index(ids, mx.array([[1, 4, 6]]))
    cache = [KVCache() for _ in lm.model.layers]
    n = len(QWEN_PROMPT)
    lm.model(ids[:, : n - 1], cache=cache, position_ids=pos[:, :, : n - 1])
    h = lm.model(ids[:, n - 1 :], cache=cache, position_ids=pos[:, :, n - 1 :])
    logits = lm.lm_head(h)[:, -1]
    first = logits[0]
    generated = []
    for step in range(QWEN_STEPS):
        y = int(mx.argmax(logits, axis=-1).item())
        generated.append(y)
        p = n + step + int(delta.item())
        h = lm.model(mx.array([[y]]), cache=cache, position_ids=mx.full((3, 1, 1), p, mx.int32))
        logits = lm.lm_head(h)[:, -1]
    tensors = {f"language_model.{k}": v for k, v in tree_flatten(lm.parameters())}
    tensors["test.prompt"] = ids.astype(mx.uint32)
    tensors["test.first_logits"] = first
    tensors["test.generated"] = mx.array(generated, mx.uint32)
    mx.eval(tensors)
    meta = {"config": json.dumps(QWEN_TEXT), "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}"}
    mx.save_safetensors(str(out / "qwen25-vl-language.safetensors"), tensors, metadata=meta)
    print("qwen2.5-vl language greedy ids", generated, "delta", int(delta.item()))


def qwen25_vl_whole(out: Path):
    """A whole tiny Qwen2.5-VL: mlx-vlm's get_input_embeddings (tower + splice)
    and its get_rope_index positions, then greedy decoding."""
    from mlx_vlm.models.cache import KVCache
    from mlx_vlm.models.qwen2_5_vl import qwen2_5_vl as q
    from mlx_vlm.models.qwen2_5_vl.config import ModelConfig as QMC, TextConfig as QTC, VisionConfig as QVC
    mx.random.seed(9)
    vision = dict(QWEN_VISION, out_hidden_size=QWEN_TEXT["hidden_size"])
    mc = QMC(text_config=QTC.from_dict(QWEN_TEXT), vision_config=QVC.from_dict(vision), model_type="qwen2_5_vl",
             image_token_id=250, vision_start_token_id=251, vision_end_token_id=252)
    model = q.Model(mc)
    for blk in model.vision_tower.blocks:
        blk.norm1.weight = 1 + mx.random.normal(blk.norm1.weight.shape) * 0.2
    t, h, w = QWEN_GRID
    patches = mx.random.uniform(-1, 1, (t * h * w, 3 * 2 * 14 * 14))
    tokens = (h // 2) * (w // 2)
    ids = mx.array([[11, 12, 251] + [250] * tokens + [252, 14, 15, 16]])
    grid = mx.array([list(QWEN_GRID)])
    emb = model.get_input_embeddings(ids, patches, image_grid_thw=grid).inputs_embeds
    lm = model.language_model
    pos, delta = lm.get_rope_index(ids, grid)
    cache = [KVCache() for _ in lm.model.layers]
    n = ids.shape[1]
    lm.model(ids[:, : n - 1], inputs_embeds=emb[:, : n - 1], cache=cache, position_ids=pos[:, :, : n - 1])
    hs = lm.model(ids[:, n - 1 :], inputs_embeds=emb[:, n - 1 :], cache=cache, position_ids=pos[:, :, n - 1 :])
    logits = lm.lm_head(hs)[:, -1]
    first = logits[0]
    generated = []
    for step in range(QWEN_STEPS):
        y = int(mx.argmax(logits, axis=-1).item())
        generated.append(y)
        p = n + step + int(delta.item())
        hs = lm.model(mx.array([[y]]), cache=cache, position_ids=mx.full((3, 1, 1), p, mx.int32))
        logits = lm.lm_head(hs)[:, -1]
    tensors = {k: v for k, v in tree_flatten(model.parameters())}
    tensors["test.patches"] = patches
    tensors["test.prompt"] = ids.astype(mx.uint32)
    tensors["test.first_logits"] = first
    tensors["test.generated"] = mx.array(generated, mx.uint32)
    mx.eval(tensors)
    meta = {"config": json.dumps({"text": QWEN_TEXT, "vision": vision, "grid": QWEN_GRID}),
            "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}"}
    mx.save_safetensors(str(out / "qwen25-vl-tiny.safetensors"), tensors, metadata=meta)
    print("qwen2.5-vl whole-model greedy ids", generated)


# A tiny Qwen3-VL tower: LayerNorm blocks, the interpolated position table,
# two deepstack mergers. Every parameter random (mlx-vlm initialises norms to
# ones and biases to zeros, which would hide a missing bias), on an image
# grid (1, 8, 12) and a two-frame video grid (2, 4, 6).
QWEN3_VISION = dict(model_type="qwen3_vl", depth=3, hidden_size=32, intermediate_size=64, out_hidden_size=48,
                    num_heads=2, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                    num_position_embeddings=36, deepstack_visual_indexes=[0, 2])


def qwen3_vl_tower(out: Path):
    from mlx.utils import tree_unflatten
    from mlx_vlm.models.qwen3_vl.config import VisionConfig as QVC
    from mlx_vlm.models.qwen3_vl.vision import VisionModel as QVM
    mx.random.seed(11)
    tower = QVM(QVC.from_dict(QWEN3_VISION))
    def randomised(k, v):
        scale = 0.3 if "pos_embed" in k else 0.1
        base = 1.0 if "norm" in k and k.endswith("weight") else 0.0
        return k, mx.random.normal(v.shape) * scale + base
    tower.update(tree_unflatten([randomised(k, v) for k, v in tree_flatten(tower.parameters())]))
    tensors = {f"vision_tower.{k}": v for k, v in tree_flatten(tower.parameters())}
    for name, grid in [("image", (1, 8, 12)), ("video", (2, 4, 6))]:
        n = grid[0] * grid[1] * grid[2]
        patches = mx.random.uniform(-1, 1, (n, 3 * 2 * 16 * 16))
        features, deepstack = tower(patches, mx.array([list(grid)]))
        tensors[f"test.{name}.patches"] = patches
        tensors[f"test.{name}.features"] = features
        for j, d in enumerate(deepstack):
            tensors[f"test.{name}.deepstack.{j}"] = d
    mx.eval(tensors)
    meta = {"config": json.dumps(QWEN3_VISION),
            "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}"}
    mx.save_safetensors(str(out / "qwen3-vl-tower.safetensors"), tensors, metadata=meta)
    print("qwen3-vl tower features", features.shape, len(deepstack))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    gemma3_tower(out)
    gemma3_vlm(out)
    qwen25_vl_tower(out)
    qwen25_vl_language(out)
    qwen25_vl_whole(out)
    qwen3_vl_tower(out)
