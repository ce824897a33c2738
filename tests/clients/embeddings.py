"""The official `openai` SDK's `embeddings.create` (float, and base64, which
the SDK asks for by default) and the `ollama` client's `embed` against
mlxbcd's gateway: the same vectors through both, normalized, in input
order; token ids of the model's tokenizer embed as its text does;
`dimensions` cuts and normalizes again; a too-long input is an
OpenAI 400 and is truncated by ollama (its default); bad requests get each
API's error shape.
    embeddings.py BASE_URL EMBEDDING_MODEL CHAT_MODEL"""
import math
import sys

import ollama
import openai

base, model, chat_model = sys.argv[1:4]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
texts = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
assert [d.index for d in floats.data] == [0, 1, 2], floats
assert all(len(d.embedding) == 384 for d in floats.data)
assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0, floats.usage
vectors = [d.embedding for d in floats.data]
for v in vectors:
    assert abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4
assert cosine(vectors[0], vectors[1]) > 0.7 > cosine(vectors[0], vectors[2]), [cosine(vectors[0], v) for v in vectors]

default = client.embeddings.create(model=model, input=texts)  # base64 on the wire
for a, b in zip(default.data, floats.data):
    assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6

one = client.embeddings.create(model=model, input=texts[1])
assert len(one.data) == 1 and cosine(one.data[0].embedding, vectors[1]) > 0.99999

short = client.embeddings.create(model=model, input=texts[0], dimensions=64)
v = short.data[0].embedding
assert len(v) == 64 and abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4
assert cosine(v, vectors[0][:64]) > 0.99999

# Token ids of the model's own tokenizer ([CLS] a man is eating food . [SEP]
# in MiniLM's vocabulary), embedded as given: the text's vector; a list of
# them; an id past the vocabulary refused with a sentence.
ids = [101, 1037, 2158, 2003, 5983, 2833, 1012, 102]
by_ids = client.embeddings.create(model=model, input=[ids, ids[:-1]], encoding_format="float")
assert len(by_ids.data) == 2 and cosine(by_ids.data[0].embedding, vectors[0]) > 0.99999, by_ids
assert by_ids.usage.prompt_tokens == 15, by_ids.usage
assert cosine(by_ids.data[1].embedding, vectors[0]) < 0.99999
try:
    client.embeddings.create(model=model, input=[[101, 99999, 102]])
    raise AssertionError("an id past the vocabulary should be refused")
except openai.BadRequestError as e:
    assert "vocabulary" in str(e), e

long_text = "word " * 2000
try:
    client.embeddings.create(model=model, input=long_text)
    raise AssertionError("a 2,000-word input should be refused by the OpenAI API")
except openai.BadRequestError as e:
    assert "tokens" in str(e), e
for bad, why in [([], "nothing to embed"), (texts, "not an embedding model")]:
    try:
        client.embeddings.create(model=model if bad == [] else chat_model, input=bad)
        raise AssertionError(f"{bad!r} should be refused")
    except openai.BadRequestError as e:
        assert why in str(e), e

o = ollama.Client(host=base)
r = o.embed(model=model, input=texts)
assert len(r.embeddings) == 3
for a, b in zip(r.embeddings, vectors):
    assert cosine(a, b) > 0.99999
assert r.prompt_eval_count == floats.usage.prompt_tokens, (r.prompt_eval_count, floats.usage)
truncated = o.embed(model=model, input=long_text)
assert len(truncated.embeddings[0]) == 384
try:
    o.embed(model=model, input=long_text, truncate=False)
    raise AssertionError("truncate=False should refuse a long input")
except ollama.ResponseError as e:
    assert e.status_code == 400 and "tokens" in e.error, e
assert "embedding" in (o.show(model).capabilities or []), o.show(model)
legacy = o.embeddings(model=model, prompt=texts[0])
assert cosine(legacy.embedding, vectors[0]) > 0.99999
print("OK")
