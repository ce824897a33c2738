#!/usr/bin/env python3
"""faster-whisper 1.2.1's greedy text on the CTranslate2 original of a
Whisper model (what the daemon's weights were converted from), per WAV:
int8 and float32 on CPU, beam 1, temperature 0, language en, no
conditioning (as the daemon's reference transcriptions are made). The
daemon's tests compare their word error rate with these.
    faster_whisper_texts.py CT2_DIR OUT_JSON WAV..."""
import json
import sys
import wave
from pathlib import Path

import numpy as np
from faster_whisper import WhisperModel


def samples(path):
    with wave.open(path) as w:
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


ct2, out, wavs = sys.argv[1], sys.argv[2], sys.argv[3:]
result = {"reference": "faster-whisper 1.2.1, CPU, beam 1, temperature 0, language en, condition_on_previous_text False"}
for compute in ("int8", "float32"):
    model = WhisperModel(ct2, device="cpu", compute_type=compute, cpu_threads=2)
    texts = {}
    for path in wavs:
        segments, _ = model.transcribe(samples(path), beam_size=1, temperature=0.0, language="en",
                                       condition_on_previous_text=False)
        texts[Path(path).stem] = "".join(s.text for s in segments).strip()
    result[compute] = texts
    print(f"faster-whisper {compute}: {texts}")
Path(out).write_text(json.dumps(result, indent=1) + "\n")
