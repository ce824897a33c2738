#!/usr/bin/env python3
"""mlx-vlm 0.7.10's Gemma 4 on the tiny fixtures, for the daemon to match.

On tiny-gemma4 (and its 4-bit copy): the chat template, the processor and
greedy decoding (`mlx_vlm.generate`) for an image and a question
(tests/fixtures/reference/vlm-pipeline-432x336.png), for that image twice, for text
alone, and for a long text prompt past the sliding window (32 on the fixture)
and a follow-up sharing its first blocks; the tower's features of the image
(from mlx-vlm's own pixels), and the first logits of the text prompt and of the
image prompt (whose per-layer inputs see the spliced image features); a clip
(tests/fixtures/reference/gemma4-video.mp4, drawn here: 20 frames of 432x336
at 4 fps, lossless, at the video processor's size so neither side resizes)
alone and after an image: mlx-vlm's frame sampling, `mm:ss` times, prompt ids,
greedy ids, the first logits (every frame bidirectional) and the first frame's
features; an audio clip (tests/fixtures/reference/gemma4-audio.wav, drawn here:
1.37 s at 16 kHz, so the frontend pads and masks) alone and after an image:
the log-mel, the audio tower's soft tokens, prompt ids, greedy ids and the
first logits. Writes tests/fixtures/reference/gemma4.json and gemma4.safetensors.

Usage: mlx_vlm_gemma4.py FIXTURES_MLX_DIR REFERENCE_DIR
       (venv with mlx[cpu]==0.32.4 mlx-vlm==0.7.10; see scripts/bench)
"""
import hashlib
import json
import subprocess
import sys
import wave
from pathlib import Path

import mlx.core as mx
from mlx_vlm import generate, load
import numpy as np
from mlx_vlm.utils import load_video, prepare_inputs, resolve_video_sampling

STEPS = 8
# Logits are kept for the first LOGITS vocabulary entries only (the whole
# 262,144 would be 1 MiB a vector); greedy ids check the rest end to end.
LOGITS = 16384
QUESTION = "What is in this picture?"
VIDEO_QUESTION = "What happens in this video?"
AUDIO_QUESTION = "What do you hear?"
TEXT = "Name three colours of the rainbow."
LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))
FOLLOW_UP = LONG + " Now count the lines."


def test_audio(path: Path):
    """1.37 s of 16 kHz mono 16-bit: a rising chirp with two harmonics and a
    little deterministic noise under a smooth envelope."""
    rate, n = 16000, 21920
    t = np.arange(n) / rate
    phase = 2 * np.pi * (300 * t + 700 * t ** 2)
    tone = np.sin(phase) + 0.4 * np.sin(2 * phase) + 0.2 * np.sin(3 * phase)
    noise = np.random.default_rng(7).normal(0, 0.05, n)
    envelope = np.clip(np.sin(np.pi * t / t[-1]), 0, None) ** 0.5
    pcm = np.round((0.5 * tone * envelope + noise) * 12000).clip(-32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())


def read_audio(path: Path):
    """The clip as the daemon reads it: 16-bit samples / 32768."""
    with wave.open(str(path)) as f:
        return np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").astype(np.float32) / 32768.0


def greedy_forward(model, inputs, steps):
    """Greedy ids from mlx-vlm's own forward pass (the whole prompt at once,
    images attending both ways via mm_token_type_ids), then one token at a
    time on its cache."""
    media = {k: inputs[k] for k in ("pixel_values", "input_features", "input_features_mask", "mm_token_type_ids")
             if inputs.get(k) is not None}
    cache = model.language_model.make_cache()
    logits = model(inputs["input_ids"], cache=cache, **media).logits[0, -1]
    ids = []
    for _ in range(steps):
        ids.append(int(mx.argmax(logits).item()))
        logits = model.language_model(mx.array([[ids[-1]]]), cache=cache).logits[0, -1]
    return ids


def case(model, processor, text, images=None, videos=None, audio=None):
    """One greedy run; the ids recorded are the ones `generate` is fed. The
    template writes <bos>, and with media mlx-vlm's processor call adds
    another: a media prompt goes in without the template's, so that every
    prompt holds one BOS, as Gemma is trained."""
    content = ([{"type": "image"} for _ in images or []] + [{"type": "video"} for _ in videos or []]
               + [{"type": "audio"} for _ in audio or []])
    messages = [{"role": "user", "content": content + [{"type": "text", "text": text}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if images or videos or audio:
        prompt = prompt.removeprefix("<bos>")
    inputs = prepare_inputs(processor, images=images, videos=videos, audio=audio, prompts=prompt,
                            image_token_index=model.config.image_token_id)
    result = generate(model, processor, prompt, image=images, video=videos, audio=audio, max_tokens=STEPS,
                      temperature=0.0, verbose=False)
    ids = inputs["input_ids"].tolist()[0]
    assert ids[:2] == [2, 105], ids[:4]
    return inputs, {"text": text, "prompt": prompt, "prompt_ids": ids, "generated_ids": list(result.token_ids)}


def test_clip(path: Path):
    """20 frames of 432x336 at 4 fps, lossless: a disc crossing a gradient."""
    y, x = np.mgrid[0:336, 0:432].astype(np.float32)
    frames = []
    for t in range(20):
        disc = ((x - 40 - 18 * t) ** 2 + (y - 168) ** 2) < 50 ** 2
        rgb = np.stack([x / 431 * 255, y / 335 * 255, np.where(disc, 230.0, 40.0 + 8 * t)], axis=-1)
        frames.append(rgb.round().astype(np.uint8))
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", "432x336",
                    "-r", "4", "-i", "pipe:0", "-c:v", "libx264rgb", "-qp", "0", "-preset", "veryslow",
                    "-movflags", "+faststart", str(path)], input=np.stack(frames).tobytes(), check=True)


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    # At the processor's size for a 70-token budget (PIL's bicubic of
    # vlm-pipeline.png), so no resize runs on either side: the daemon resizes
    # with the `image` crate, whose bicubic differs from PIL's by a level in
    # places, and that is not what these goldens are about.
    image = out / "vlm-pipeline-432x336.png"
    clip = out / "gemma4-video.mp4"
    test_clip(clip)
    sound = out / "gemma4-audio.wav"
    test_audio(sound)
    samples = read_audio(sound)
    golden = {"reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}", "image": image.name,
              "clip": clip.name, "clip_sha256": hashlib.sha256(clip.read_bytes()).hexdigest(),
              "audio": sound.name, "audio_sha256": hashlib.sha256(sound.read_bytes()).hexdigest()}
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
        for name, images in [("video", None), ("image_video", [str(image)])]:
            inputs, g[name] = case(model, processor, VIDEO_QUESTION, images, [str(clip)])
            if name == "video":
                _, metadata = load_video(str(clip), resolve_video_sampling(processor, {}))
                golden["frames_indices"] = list(map(int, metadata.frames_indices))
                frames = inputs["pixel_values_videos"][0]
                positions = inputs["video_position_ids"][0]
                tensors[f"{family}.video_frame0"] = model.encode_image(frames[:1], positions[:1])[0]
                tensors[f"{family}.video_logits"] = model(
                    inputs["input_ids"], pixel_values_videos=inputs["pixel_values_videos"],
                    video_position_ids=inputs["video_position_ids"],
                    mm_token_type_ids=inputs.get("mm_token_type_ids")).logits[0, -1, :LOGITS]
        for name, images in [("audio", None), ("image_audio", [str(image)])]:
            inputs, g[name] = case(model, processor, AUDIO_QUESTION, images, audio=[samples])
            # mlx-vlm's generate prefills a prompt holding both images and
            # audio in chunks, which drops the images' bidirectional overlay
            # (language.py's chunked_prefill_policy: "keep mixed image+audio
            # prompts causal"); its forward pass, as HF's, keeps it. The
            # daemon follows the model: greedy ids from the forward pass.
            forward = greedy_forward(model, inputs, STEPS)
            if name == "audio":
                assert forward == g[name]["generated_ids"], (forward, g[name]["generated_ids"])
            else:
                g[name]["generate_generated_ids"] = g[name]["generated_ids"]
                g[name]["generated_ids"] = forward
            if name == "audio":
                mel, valid = inputs["input_features"], inputs["input_features_mask"]
                tokens = g[name]["prompt_ids"].count(model.config.audio_token_id)
                encoded, _ = model.audio_tower(mel, ~valid.astype(mx.bool_))
                tensors["audio.mel"] = mel[0]
                tensors["audio.valid"] = valid[0].astype(mx.int32)
                tensors[f"{family}.audio_features"] = model.embed_audio(encoded)[0, :tokens]
                tensors[f"{family}.audio_logits"] = model(
                    inputs["input_ids"], input_features=mel, input_features_mask=valid,
                    mm_token_type_ids=inputs.get("mm_token_type_ids")).logits[0, -1, :LOGITS]
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
