"""Speech to text, side by side on the same weights and clips, in one run:
mlxbcd (through its gateway's /v1/audio/transcriptions, a warm daemon) with
the encoder missing the feature store (each round's clip differs from the
last in one sample, so its hash is new) and hitting it (the same bytes
again); mlx-whisper 0.4.3 in process on the same weights (its layout);
faster-whisper 1.2.1 on the CTranslate2 original, int8 and f32. All with
Whisper's defaults (temperature fallback, conditioning on earlier text),
greedy (faster-whisper's beam_size=1). Rounds interleaved (each round
starts one engine later), medians. Real-time factor = wall time / audio
seconds over all clips; WER against the sentences espeak-ng spoke.
    audio_bench.py BASE_URL ROUNDS CLIPS_DIR SENTENCES MODEL:MLX_DIR:CT2_DIR..."""
import io
import json
import os
import re
import statistics
import sys
import time
import urllib.request
import uuid
import wave

import numpy as np

# mlx-whisper's word timings (numba, scipy) and hub download are not used
# here; where they are not installed (the lent GPU machine), stand-ins.
import types
try:
    import numba  # noqa: F401
    import scipy  # noqa: F401
except ImportError:
    sys.modules["mlx_whisper.timing"] = types.SimpleNamespace(add_word_timestamps=None)
try:
    import huggingface_hub  # noqa: F401
except ImportError:
    sys.modules["huggingface_hub"] = types.SimpleNamespace(snapshot_download=None)
try:
    from faster_whisper import WhisperModel
except ImportError as e:
    WhisperModel = None
    print(f"faster-whisper is not installed here ({e}): its rows are left out")

base, rounds, clips_dir, sentences_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
models = [m.split(":") for m in sys.argv[5:]]
device = os.environ.get("BENCH_DEVICE", "cpu")
f32_rounds = int(os.environ.get("F32_ROUNDS", "1"))
sentences = [l.strip() for l in open(sentences_path) if l.strip()]
names = [f"s{i}" for i in range(1, len(sentences) + 1)] + ["long"]
truth = {f"s{i + 1}": s for i, s in enumerate(sentences)}
truth["long"] = " ".join(sentences)


def read(path):
    with open(path, "rb") as f:
        return f.read()


clips = {n: read(f"{clips_dir}/{n}.wav") for n in names}


def samples(b):
    with wave.open(io.BytesIO(b)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


audio_seconds = sum(len(samples(b)) / 16000 for b in clips.values())


def words(t):
    return re.sub(r"[^a-z0-9' ]", " ", t.lower().replace("-", " ")).split()


def wer(ref, hyp):
    r, h = words(ref), words(hyp)
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            cur = min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
            prev, d[j] = d[j], cur
    return d[len(h)] / max(1, len(r))


def corpus_wer(texts):
    errors = sum(wer(truth[n], texts[n]) * len(words(truth[n])) for n in names)
    return errors / sum(len(words(truth[n])) for n in names)


def post(model, wav):
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{model}\r\n'.encode(),
             f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
             f'Content-Type: audio/wav\r\n\r\n'.encode() + wav + b"\r\n", f"--{boundary}--\r\n".encode()]
    req = urllib.request.Request(f"{base}/v1/audio/transcriptions", b"".join(parts),
                                 {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["text"]


def nudge(wav, k):
    """The same clip with its last sample changed by k: a new hash, the same speech."""
    b = bytearray(wav)
    last = int.from_bytes(b[-2:], "little", signed=True)
    b[-2:] = max(-32768, min(32767, last + k)).to_bytes(2, "little", signed=True)
    return bytes(b)


def run_all(fn):
    t = time.perf_counter()
    texts = {n: fn(n) for n in names}
    return time.perf_counter() - t, texts


rows = []
for name, mlx_dir, ct2_dir in models:
    import mlx_whisper
    fp16 = device == "gpu"
    multilingual = "base" in name or not name.endswith(".en")
    lang = "en"
    mlx_whisper.transcribe(samples(clips["s1"]), path_or_hf_repo=mlx_dir, fp16=fp16, language=lang)  # load, warm up
    post(name, nudge(clips["s1"], 7))  # load in the daemon, warm up
    ct2 = {ct: WhisperModel(ct2_dir, device="cpu", compute_type=ct, cpu_threads=os.cpu_count())
           for ct in ("int8", "float32")} if WhisperModel else {}
    engines = {
        "mlxbcd, encoder miss": lambda k: run_all(lambda n: post(name, nudge(clips[n], k + 1))),
        "mlxbcd, encoder hit": lambda k: run_all(lambda n: post(name, nudge(clips[n], k + 1))),
        "mlx-whisper 0.4.3": lambda k: run_all(lambda n: mlx_whisper.transcribe(
            samples(clips[n]), path_or_hf_repo=mlx_dir, fp16=fp16, language=lang)["text"]),
        "faster-whisper int8 (CPU)": lambda k: run_all(lambda n: "".join(s.text for s in ct2["int8"].transcribe(
            samples(clips[n]), beam_size=1, language=lang)[0])),
        "faster-whisper f32 (CPU)": lambda k: run_all(lambda n: "".join(s.text for s in ct2["float32"].transcribe(
            samples(clips[n]), beam_size=1, language=lang)[0])),
    }
    if not ct2:
        engines = {e: f for e, f in engines.items() if not e.startswith("faster-whisper")}
    order = list(engines)
    times = {e: [] for e in order}
    texts = {}
    for r in range(rounds):
        # The miss must come before its hit (same nudge k = r + 100 * round's engine offset).
        k = 1000 + r
        rotated = order[r % len(order):] + order[:r % len(order)]
        rotated.remove("mlxbcd, encoder hit")
        rotated.insert(rotated.index("mlxbcd, encoder miss") + 1, "mlxbcd, encoder hit")
        for e in rotated:
            if e.startswith("faster-whisper f32") and r >= f32_rounds:
                continue
            dt, out = engines[e](k)
            times[e].append(dt)
            texts[e] = out
    for e in order:
        if times[e]:
            med = statistics.median(times[e])
            rows.append((name, e, med, med / audio_seconds, corpus_wer(texts[e]), len(times[e]), texts[e]))

print(f"\nSpeech to text: {len(names)} espeak-ng clips, {audio_seconds:.1f} s of audio, device {device}, "
      f"{rounds} rounds interleaved (faster-whisper f32: {f32_rounds}), medians")
print(f"{'model':<16} {'engine':<28} {'wall s':>8} {'RTF':>7} {'WER':>6} {'rounds':>6}")
for name, e, med, rtf, w, n, _ in rows:
    print(f"{name:<16} {e:<28} {med:>8.2f} {rtf:>7.3f} {w:>6.3f} {n:>6}")
by = {(r[0], r[1]): r for r in rows}
for name, *_ in models:
    miss, hit = by.get((name, "mlxbcd, encoder miss")), by.get((name, "mlxbcd, encoder hit"))
    fw = by.get((name, "faster-whisper int8 (CPU)"))
    if miss and hit:
        print(f"{name}: a repeat transcription takes {hit[2] / miss[2]:.0%} of the first (encoder hit vs miss)")
    if miss and fw:
        same = sum(miss[6][n].strip() == fw[6][n].strip() for n in names)
        print(f"{name}: mlxbcd and faster-whisper int8 give the same text on {same} of {len(names)} clips; "
              f"WER {miss[4]:.3f} vs {fw[4]:.3f}")
        for n in names:
            if miss[6][n].strip() != fw[6][n].strip():
                print(f"  {n}: mlxbcd {miss[6][n].strip()!r}\n  {' ' * len(n)}  faster-whisper {fw[6][n].strip()!r}")
