#!/usr/bin/env python3
"""mlx-vlm's whole pipeline on the test fixtures' tiny VLMs, for the daemon to match.

For each family (tiny-gemma3-vlm, tiny-qwen25-vl, tiny-qwen3-vl: real tokenizers, real chat
templates, processor configs, random weights), runs what `mlx_vlm.generate`
runs for one image and one question: the chat template, the HF processor
(resize, rescale, normalize, patchify, image-token expansion), the tower and
projector, and greedy decoding. Writes tests/fixtures/reference/vlm-pipeline.json
(prompt ids, generated ids, the fixture's sha256) and vlm-pipeline.safetensors
(the processed pixels and the features the tower makes from them).

The test image is drawn here (a smooth picture: resize filters agree on it)
and committed beside the goldens.

Usage: mlx_vlm_pipeline.py FIXTURES_MLX_DIR REFERENCE_DIR
       (venv with mlx[cpu]==0.32.4 mlx-vlm==0.7.10; see scripts/bench)
"""
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image
from mlx_vlm import generate, load
from mlx_vlm.utils import prepare_inputs

QUESTION = "What is in this picture?"
STEPS = 8
FAMILIES = ["tiny-gemma3-vlm", "tiny-qwen25-vl", "tiny-qwen3-vl"]


def test_image(path: Path):
    """100 x 75, smooth gradients and a disc: not square, not a multiple of any patch size."""
    y, x = np.mgrid[0:75, 0:100].astype(np.float32)
    disc = ((x - 60) ** 2 + (y - 30) ** 2) < 18 ** 2
    rgb = np.stack([x / 99 * 255, y / 74 * 255, np.where(disc, 230.0, 40.0)], axis=-1)
    Image.fromarray(rgb.round().astype(np.uint8)).save(path)


def features(model, family, inputs):
    pixels = inputs["pixel_values"]
    if family.startswith("tiny-gemma3"):
        hidden, _, _ = model.vision_tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
        return model.multi_modal_projector(hidden)
    if family.startswith("tiny-gemma4"):
        return model.encode_image(pixels)
    out = model.vision_tower(pixels, inputs["image_grid_thw"])
    if family.startswith("tiny-qwen3"):
        # Qwen3-VL: the merged features, and one deepstack tensor per
        # injected layer (the rows the language model adds after its first layers).
        features, deepstack = out
        return mx.concatenate([features] + list(deepstack), axis=-1)
    return out


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    image = out / "vlm-pipeline.png"
    test_image(image)
    golden, tensors = {"question": QUESTION, "image": image.name,
                       "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}"}, {}
    for family in FAMILIES:
        model_dir = fixtures / family
        model, processor = load(str(model_dir))
        # The image before the question, as HF's model cards show both
        # families (mlx-vlm's own apply_chat_template puts Gemma's after it).
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        token = getattr(model.config, "image_token_index", None) or getattr(model.config, "image_token_id", None)
        inputs = prepare_inputs(processor, images=[str(image)], prompts=prompt, image_token_index=token)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        result = generate(model, processor, prompt, image=[str(image)], max_tokens=STEPS, temperature=0.0,
                          verbose=False)
        feats = features(model, family, inputs)
        mx.eval(feats)
        tensors[f"{family}.pixels"] = inputs["pixel_values"]
        tensors[f"{family}.features"] = feats.reshape(-1, feats.shape[-1])
        golden[family] = {
            "weights_sha256": hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest(),
            "prompt": prompt,
            "prompt_ids": inputs["input_ids"].tolist()[0],
            "generated_ids": list(result.token_ids),
            "processor_outputs": {k: np.array(v).tolist() for k, v in extra.items()},
        }
        print(family, len(golden[family]["prompt_ids"]), golden[family]["generated_ids"])
    (out / "vlm-pipeline.json").write_text(json.dumps(golden, indent=1) + "\n")
    mx.save_safetensors(str(out / "vlm-pipeline.safetensors"), tensors)


if __name__ == "__main__":
    main()
