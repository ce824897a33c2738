#!/usr/bin/env python3
"""mlx-vlm 0.7.10's Gemma 4 unified on the tiny fixture, for the daemon to match.

On tiny-gemma4-unified, with Gemma 4's test media (scripts/goldens/
mlx_vlm_gemma4.py draws the clips; the image, 864x672, is drawn here): text, an image, two images, the clip, the audio
clip, and an image then the audio clip — prompt ids and greedy ids (an image
with audio from mlx-vlm's forward pass, as for Gemma 4: its generate drops the
image's bidirectional overlay when audio is present); the patch embedder's
soft tokens of the image (from mlx-vlm's own patches) and the audio
projector's of the clip; the first logits of the image and the audio prompt.

mlx-vlm's unified `Model.__call__` does not hand `mm_token_type_ids` to its
language model (a plain forward pass attends causally over images), and its
`generate` prefills an image-with-audio prompt causally; Hugging Face's Gemma 4
unified lets an image's positions attend both ways. The goldens follow the
model: mlx-vlm's own embeddings and layers with the token types handed to the
language model (`forward`); where `generate` parts from that (image with
audio), its ids are kept beside them (`generate_generated_ids`).
Writes tests/fixtures/reference/gemma4-unified.json and .safetensors.

Usage: mlx_vlm_gemma4_unified.py FIXTURES_MLX_DIR REFERENCE_DIR
       (venv with mlx[cpu]==0.32.4 mlx-vlm==0.7.10; see scripts/bench)
"""
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_vlm import load

sys.path.insert(0, str(Path(__file__).parent))
from mlx_vlm_gemma4 import (AUDIO_QUESTION, LOGITS, QUESTION, STEPS, TEXT, VIDEO_QUESTION,  # noqa: E402
                            case, read_audio)

FAMILY = "tiny-gemma4-unified"


def test_image(path: Path):
    """864x672: already the processor's size for 280 soft tokens (14 x 18
    patches of 48), so neither side resizes; gradients and a disc."""
    from PIL import Image
    y, x = np.mgrid[0:672, 0:864].astype(np.float32)
    disc = ((x - 300) ** 2 + (y - 350) ** 2) < 160 ** 2
    rgb = np.stack([x / 863 * 255, y / 671 * 255, np.where(disc, 220.0, 60.0)], axis=-1)
    Image.fromarray(rgb.round().astype(np.uint8)).save(path, optimize=True)


MEDIA_KEYS = ("pixel_values", "image_position_ids", "pixel_values_videos", "video_position_ids",
              "input_features", "input_features_mask")


def forward(model, inputs, cache):
    """mlx-vlm's embeddings and layers on the whole prompt, the token types
    reaching the language model (images attending both ways)."""
    media = {k: inputs[k] for k in MEDIA_KEYS if inputs.get(k) is not None}
    emb = model.get_input_embeddings(input_ids=inputs["input_ids"], **media)
    return model.language_model(None, inputs_embeds=emb.inputs_embeds, per_layer_inputs=emb.per_layer_inputs,
                                cache=cache, mm_token_type_ids=inputs.get("mm_token_type_ids")).logits[0, -1]


def greedy(model, inputs, steps):
    cache = model.language_model.make_cache()
    logits, ids = forward(model, inputs, cache), []
    for _ in range(steps):
        ids.append(int(mx.argmax(logits).item()))
        logits = model.language_model(mx.array([[ids[-1]]]), cache=cache).logits[0, -1]
    return ids


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    image, clip, sound = (out / "gemma4-unified-864x672.png", out / "gemma4-video.mp4", out / "gemma4-audio.wav")
    test_image(image)
    samples = read_audio(sound)
    model_dir = fixtures / FAMILY
    model, processor = load(str(model_dir))
    g = {"weights_sha256": hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()}
    tensors = {}
    for name, text, images, videos, audio in [
            ("text", TEXT, None, None, None), ("image", QUESTION, [str(image)], None, None),
            ("two_images", QUESTION, [str(image), str(image)], None, None),
            ("video", VIDEO_QUESTION, None, [str(clip)], None), ("audio", AUDIO_QUESTION, None, None, [samples]),
            ("image_audio", AUDIO_QUESTION, [str(image)], None, [samples])]:
        inputs, g[name] = case(model, processor, text, images, videos, audio)
        ours = greedy(model, inputs, STEPS)
        if ours != g[name]["generated_ids"]:
            g[name]["generate_generated_ids"] = g[name]["generated_ids"]
            g[name]["generated_ids"] = ours
        if name == "image":
            tokens = g[name]["prompt_ids"].count(model.config.image_token_id)
            tensors["image.patches"] = inputs["pixel_values"][0, :tokens]
            tensors["image.features"] = model.encode_image(inputs["pixel_values"], inputs["image_position_ids"])
            tensors["image.logits"] = forward(model, inputs, None)[:LOGITS]
        if name == "audio":
            tensors["audio.features"] = model.get_audio_features(inputs["input_features"],
                                                                 inputs["input_features_mask"])
            tensors["audio.logits"] = forward(model, inputs, None)[:LOGITS]
    tensors["text.logits"] = model(mx.array([g["text"]["prompt_ids"]])).logits[0, -1, :LOGITS]
    print(FAMILY, {k: (len(v["prompt_ids"]), v["generated_ids"]) for k, v in g.items() if isinstance(v, dict)})
    mx.eval(tensors)
    golden = {"image": image.name, "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}",
              FAMILY: g}
    (out / "gemma4-unified.json").write_text(json.dumps(golden, indent=1) + "\n")
    mx.save_safetensors(str(out / "gemma4-unified.safetensors"), tensors)


if __name__ == "__main__":
    main()
