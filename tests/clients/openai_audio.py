"""The official `openai` SDK's speech-to-text on the gateway, with Whisper
tiny.en (real weights): `audio.transcriptions.create` in every
response_format gives mlx-whisper's text; verbose_json has timed segments;
`whisper-1` names the default speech model; an audio file sent to a text
model, word timestamps and a bad format are 400s; a .en model refuses to
translate.
    openai_audio.py BASE_URL WAV REFERENCE_TEXT TEXT_MODEL"""
import sys

import openai

base, wav, want, text_model = sys.argv[1:5]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def create(**kw):
    with open(wav, "rb") as f:
        return client.audio.transcriptions.create(file=("clip.wav", f, "audio/wav"), **kw)


r = create(model="whisper-1")
assert r.text == want, (r.text, want)
print(f"json: {r.text!r}")
assert create(model="whisper-tiny.en", response_format="text").strip() == want
v = create(model="whisper-1", response_format="verbose_json", timestamp_granularities=["segment"], language="en")
assert v.language == "english" and v.duration > 1 and v.text == want, v
assert v.segments and v.segments[0].start == 0.0 and v.segments[-1].end > 1, v.segments
print(f"verbose_json: {len(v.segments)} segments, {v.duration:.1f} s")
srt = create(model="whisper-1", response_format="srt")
assert srt.startswith("1\n00:00:00,000 --> ") and want.split()[-1] in srt, srt
vtt = create(model="whisper-1", response_format="vtt")
assert vtt.startswith("WEBVTT"), vtt
prompted = create(model="whisper-1", prompt="Stella, the store.")
assert prompted.text, prompted

for bad, says in [(dict(model=text_model), "cannot take audio"),
                  (dict(model="whisper-1", timestamp_granularities=["word"]), "word"),
                  (dict(model="whisper-1", response_format="xml"), "response_format")]:
    try:
        create(**bad)
        raise AssertionError(f"{bad} was accepted")
    except openai.BadRequestError as e:
        assert says in str(e), (bad, str(e))
with open(wav, "rb") as f:
    try:
        client.audio.translations.create(model="whisper-1", file=("clip.wav", f, "audio/wav"))
        raise AssertionError("a .en model translated")
    except openai.BadRequestError as e:
        assert "English-only" in str(e), str(e)
print("errors: text model, word timestamps, bad format, translation on .en")
print("OK")
