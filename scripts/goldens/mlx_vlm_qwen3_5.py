#!/usr/bin/env python3
"""mlx-vlm 0.7.10's Qwen3.5 on the tiny fixtures, for the daemon to match.

On tiny-qwen3_5 (and its 4-bit copy): the chat template, the processor and
greedy decoding (`mlx_vlm.generate`) for an image and a question
(tests/fixtures/reference/vlm-pipeline.png), for that image twice, for
the committed clip (vlm-video.mp4, sampled as mlx-vlm's `load_video`), for text alone, and for a long
text prompt of several prompt-cache blocks and a follow-up that shares its
first blocks (the recurrent state's reuse); the tower's features of the
image and the first logits of the text prompt. Writes
tests/fixtures/reference/qwen3_5.json and qwen3_5.safetensors.

Usage: mlx_vlm_qwen3_5.py FIXTURES_MLX_DIR REFERENCE_DIR
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
QUESTION = "What is in this picture?"
TEXT = "Name three colours of the rainbow."
LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))
FOLLOW_UP = LONG + " Now count the lines."


def ids_of(processor, messages):
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return prompt, processor.tokenizer.encode(prompt, add_special_tokens=False)


def text_case(model, processor, text):
    prompt, ids = ids_of(processor, [{"role": "user", "content": [{"type": "text", "text": text}]}])
    result = generate(model, processor, prompt, max_tokens=STEPS, temperature=0.0, verbose=False)
    return {"text": text, "prompt": prompt, "prompt_ids": ids, "generated_ids": list(result.token_ids)}


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    image = out / "vlm-pipeline.png"
    golden = {"reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}", "image": image.name}
    tensors = {}
    for family in ["tiny-qwen3_5", "tiny-qwen3_5-4bit"]:
        model_dir = fixtures / family
        model, processor = load(str(model_dir))
        g = {"weights_sha256": hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()}
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = prepare_inputs(processor, images=[str(image)], prompts=prompt,
                                image_token_index=model.config.image_token_id)
        result = generate(model, processor, prompt, image=[str(image)], max_tokens=STEPS, temperature=0.0,
                          verbose=False)
        g["image"] = {"text": QUESTION, "prompt_ids": inputs["input_ids"].tolist()[0],
                      "generated_ids": list(result.token_ids)}
        features, _ = model.vision_tower(inputs["pixel_values"], inputs["image_grid_thw"])
        tensors[f"{family}.features"] = features
        tensors[f"{family}.pixels"] = inputs["pixel_values"]
        tensors[f"{family}.grid"] = inputs["image_grid_thw"]
        clip = out / "vlm-video.mp4"
        for case, content, images, videos in [
                ("two_images", [{"type": "image"}, {"type": "image"}], [str(image), str(image)], None),
                ("video", [{"type": "video"}], None, [str(clip)])]:
            messages = [{"role": "user", "content": content + [{"type": "text", "text": QUESTION}]}]
            prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs = prepare_inputs(processor, images=images, videos=videos, prompts=prompt,
                                    image_token_index=model.config.image_token_id)
            result = generate(model, processor, prompt, image=images, video=videos, max_tokens=STEPS,
                              temperature=0.0, verbose=False)
            g[case] = {"text": QUESTION, "prompt_ids": inputs["input_ids"].tolist()[0],
                       "generated_ids": list(result.token_ids)}
        g["text"] = text_case(model, processor, TEXT)
        g["long"] = text_case(model, processor, LONG)
        g["follow_up"] = text_case(model, processor, FOLLOW_UP)
        ids = mx.array([g["text"]["prompt_ids"]])
        logits = model.language_model(ids).logits[0, -1]
        tensors[f"{family}.text_logits"] = logits
        golden[family] = g
        print(family, {k: (len(v["prompt_ids"]), v["generated_ids"]) for k, v in g.items() if isinstance(v, dict)})
    mx.eval(tensors)
    (out / "qwen3_5.json").write_text(json.dumps(golden, indent=1) + "\n")
    mx.save_safetensors(str(out / "qwen3_5.safetensors"), tensors)


if __name__ == "__main__":
    main()
