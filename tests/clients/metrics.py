"""`GET /metrics` read by prometheus_client's own text parser, before and
after a chat completion (the `openai` SDK), an embedding request twice
(the second from the store), a transcription and a 404: the counters move
by what was served, each counted by the time its client has the answer,
the histograms hold the generation, the gauges are there.
    metrics.py BASE_URL CHAT_MODEL EMBEDDING_MODEL SPEECH_MODEL WAV"""
import sys
import urllib.error
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

base, model, embed_model, speech_model, wav = sys.argv[1:6]


def scrape():
    with urllib.request.urlopen(f"{base}/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain"), r.headers["Content-Type"]
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


before = scrape()
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6,
                                      temperature=0)
for _ in range(2):
    client.embeddings.create(model=embed_model, input=["alpha", "beta", "gamma"])
with open(wav, "rb") as f:
    heard = client.audio.transcriptions.create(model=speech_model, file=("clip.wav", f, "audio/wav"))
assert heard.text.strip(), heard
try:
    urllib.request.urlopen(f"{base}/v1/no-such-thing")
except urllib.error.HTTPError as e:
    assert e.code == 404
after = scrape()


def moved(name, **labels):
    return value(after, name, **labels) - value(before, name, **labels)


assert moved("mlxbc_requests_total", kind="generate", model=model, outcome="done") == 1
assert moved("mlxbc_generated_tokens_total", model=model) == chat.usage.completion_tokens, chat.usage
assert moved("mlxbc_prompt_tokens_total", model=model) == chat.usage.prompt_tokens, chat.usage
assert moved("mlxbc_time_to_first_token_seconds_count", model=model) == 1
assert value(after, "mlxbc_time_to_first_token_seconds_bucket", model=model, le="+Inf") >= 1
assert moved("mlxbc_requests_total", kind="embed", model=embed_model, outcome="done") == 2
assert moved("mlxbc_embedded_inputs_total", model=embed_model) == 6
assert moved("mlxbc_embedded_from_store_total", model=embed_model) >= 3
assert moved("mlxbc_store_hits_total") >= 3
assert moved("mlxbc_requests_total", kind="transcribe", model=speech_model, outcome="done") == 1
assert 0.5 < moved("mlxbc_transcribed_audio_seconds_total", model=speech_model) < 60
assert moved("mlxbc_http_requests_total", route="/v1/chat/completions", code="200") == 1
assert moved("mlxbc_http_requests_total", route="/v1/embeddings", code="200") == 2
assert value(after, "mlxbc_model_memory_bytes", model=model) > 0
assert value(after, "mlxbc_memory_budget_bytes") > 0
assert value(after, "mlxbc_uptime_seconds") >= 0
print("OK")
