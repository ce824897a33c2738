#!/usr/bin/env python3
"""Reference numbers for Whisper from mlx-whisper (0.4.3) on a converted
model directory (hf_whisper_to_mlx.py of scripts/whisper/ct2_to_hf.py's
output), f32 on CPU, for each 16 kHz mono WAV: the first 30-second
window's log-mel input [3000, n_mels] (f32) and the encoder's output
[1500, d_model] (f16, to keep the fixture small), in NAME.safetensors; the
greedy transcription's token ids and text in NAME.json. Tests compare the
daemon's frontend, tower and decoder with these (no Python at test time).

Usage: whisper_reference.py MLX_WHISPER_DIR OUT_DIR WAV...
"""
import json
import sys
import wave
from pathlib import Path

import mlx.core as mx
import mlx_whisper
import numpy as np
from mlx_whisper.audio import N_FRAMES, N_SAMPLES, log_mel_spectrogram, pad_or_trim
from mlx_whisper.load_models import load_model


def main():
    model_dir, out, wavs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(model_dir, dtype=mx.float32)
    for path in wavs:
        name = Path(path).stem
        with wave.open(path) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2), path
            audio = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
        mel = log_mel_spectrogram(audio, n_mels=model.dims.n_mels, padding=N_SAMPLES)
        window = pad_or_trim(mel[:N_FRAMES], N_FRAMES, axis=-2)
        features = model.encoder(window[None])[0]
        mx.save_safetensors(str(out / f"{name}.safetensors"),
                            {"mel": window.astype(mx.float32), "encoder": features.astype(mx.float16)})
        # A multilingual model detects the language itself (as the daemon does when none is given).
        language = None if model.is_multilingual else "en"
        result = mlx_whisper.transcribe(audio, path_or_hf_repo=model_dir, fp16=False, temperature=0.0,
                                        language=language, condition_on_previous_text=False)
        segments = [{"start": s["start"], "end": s["end"], "tokens": s["tokens"], "text": s["text"]}
                    for s in result["segments"]]
        (out / f"{name}.json").write_text(json.dumps({
            "audio_seconds": len(audio) / 16000, "text": result["text"], "segments": segments,
            "language": result["language"],
            "reference": f"mlx-whisper 0.4.3, mlx {mx.__version__}, f32, CPU, greedy (temperature 0), "
                         f"language {language or 'detected'}, condition_on_previous_text False",
        }, indent=1) + "\n")
        print(f"{name}: {len(audio) / 16000:.1f} s, mel {tuple(window.shape)}, encoder {tuple(features.shape)}, "
              f"{result['text'].strip()!r}")


if __name__ == "__main__":
    main()
