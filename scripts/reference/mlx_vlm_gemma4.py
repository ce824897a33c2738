#!/usr/bin/env python3
"""mlx-vlm 0.7.10's Gemma 4 on the tiny fixtures, for the daemon to match.

On tiny-gemma4 (and its 4-bit copy): the chat template, the processor and
greedy decoding (`mlx_vlm.generate`) for an image and a question
(tests/fixtures/reference/vlm-pipeline-432x336.png), for that image twice, for text
alone, and for a long text prompt past the sliding window (32 on the fixture)
and a follow-up sharing its first blocks; the tower's features of the image
(from mlx-vlm's own pixels), and the first logits of the text prompt and of the
image prompt (whose per-layer inputs see the spliced image features). Writes
tests/fixtures/reference/gemma4.json and gemma4.safetensors.

Usage: mlx_vlm_gemma4.py FIXTURES_MLX_DIR REFERENCE_DIR
       (venv with mlx[cpu]==0.32.4 mlx-vlm==0.7.10; see scripts/bench)
"""
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_vlm import generate, load
from mlx_vlm.utils import prepare_inputs

STEPS = 8
# Logits are kept for the first LOGITS vocabulary entries only (the whole
# 262,144 would be 1 MiB a vector); greedy ids check the rest end to end.
LOGITS = 16384
QUESTION = "What is in this picture?"
TEXT = "Name three colours of the rainbow."
LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))
FOLLOW_UP = LONG + " Now count the lines."


def case(model, processor, text, images=None):
    """One greedy run; the ids recorded are the ones `generate` is fed. The
    template writes <bos>, and with images mlx-vlm's processor call adds
    another: an image prompt goes in without the template's, so that every
    prompt holds one BOS, as Gemma is trained."""
    content = [{"type": "image"} for _ in images or []] + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if images:
        prompt = prompt.removeprefix("<bos>")
    inputs = prepare_inputs(processor, images=images, prompts=prompt, image_token_index=model.config.image_token_id)
    result = generate(model, processor, prompt, image=images, max_tokens=STEPS, temperature=0.0, verbose=False)
    ids = inputs["input_ids"].tolist()[0]
    assert ids[:2] == [2, 105], ids[:4]
    return inputs, {"text": text, "prompt": prompt, "prompt_ids": ids, "generated_ids": list(result.token_ids)}


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    # At the processor's size for a 70-token budget (PIL's bicubic of
    # vlm-pipeline.png), so no resize runs on either side: the daemon resizes
    # with the `image` crate, whose bicubic differs from PIL's by a level in
    # places, and that is not what these goldens are about.
    image = out / "vlm-pipeline-432x336.png"
    golden = {"reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}", "image": image.name}
    tensors = {}
    for family in ["tiny-gemma4", "tiny-gemma4-4bit"]:
        model_dir = fixtures / family
        model, processor = load(str(model_dir))
        g = {"weights_sha256": hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()}
        for name, images in [("image", [str(image)]), ("two_images", [str(image), str(image)])]:
            inputs, g[name] = case(model, processor, QUESTION, images)
            if name == "image":
                pixels = inputs["pixel_values"]
                tensors["pixels"] = pixels  # one processor, the same pixels for both
                tensors[f"{family}.features"] = model.encode_image(pixels)[0]
                ids = inputs["input_ids"]
                kinds = inputs.get("mm_token_type_ids")
                tensors[f"{family}.image_logits"] = model(ids, pixel_values=pixels,
                                                         mm_token_type_ids=kinds).logits[0, -1, :LOGITS]
                tensors[f"{family}.image_logits_causal"] = model(ids, pixel_values=pixels).logits[0, -1, :LOGITS]
        for name, text in [("text", TEXT), ("long", LONG), ("follow_up", FOLLOW_UP)]:
            _, g[name] = case(model, processor, text)
        ids = mx.array([g["text"]["prompt_ids"]])
        tensors[f"{family}.text_logits"] = model(ids).logits[0, -1, :LOGITS]
        golden[family] = g
        print(family, {k: (len(v["prompt_ids"]), v["generated_ids"]) for k, v in g.items() if isinstance(v, dict)})
    mx.eval(tensors)
    (out / "gemma4.json").write_text(json.dumps(golden, indent=1) + "\n")
    mx.save_safetensors(str(out / "gemma4.safetensors"), tensors)


if __name__ == "__main__":
    main()
