#!/usr/bin/env python3
"""Checks a converted Whisper directory against the original: the text
mlx-whisper (0.4.3) gives on the converted weights (hf_whisper_to_mlx.py of
ct2_to_hf.py's output) and the text faster-whisper (1.2.1) gives on the
CTranslate2 original, greedy, for each 16 kHz mono WAV given.
Runs without torch: pip install --no-deps mlx-whisper==0.4.3, then numpy,
numba, scipy, tiktoken, more-itertools, tqdm, huggingface_hub, and
faster-whisper==1.2.1 with its dependencies.

Usage: whisper_parity.py MLX_WHISPER_DIR CT2_DIR WAV...
"""
import sys
import wave

import mlx_whisper
import numpy as np
from faster_whisper import WhisperModel


def samples(path):
    with wave.open(path) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2), f"{path}: 16 kHz mono s16"
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


def main():
    mlx_dir, ct2_dir, wavs = sys.argv[1], sys.argv[2], sys.argv[3:]
    ct2 = WhisperModel(ct2_dir, device="cpu", compute_type="float32", cpu_threads=2)
    parted = 0
    for path in wavs:
        a = samples(path)
        ours = mlx_whisper.transcribe(a, path_or_hf_repo=mlx_dir, fp16=False, temperature=0.0, language="en")["text"]
        segments, _ = ct2.transcribe(a, beam_size=1, temperature=0.0, language="en", condition_on_previous_text=False)
        theirs = "".join(s.text for s in segments)
        same = ours.strip() == theirs.strip()
        parted += not same
        print(f"{'same ' if same else 'PARTS'} {path}: {ours.strip()!r}" + ("" if same else f" vs {theirs.strip()!r}"))
    sys.exit(1 if parted else 0)


if __name__ == "__main__":
    main()
