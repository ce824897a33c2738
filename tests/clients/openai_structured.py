"""The official `openai` SDK against mlxbcd's gateway: `response_format`
json_schema (strict) answers for 20 prompts, asked at once (they batch),
all parse and validate (`jsonschema`); json_object answers parse; streamed
usage arrives with `stream_options.include_usage`.
    openai_structured.py BASE_URL MODEL"""
import concurrent.futures
import json
import sys

import jsonschema
import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome", "Madrid", "Lisbon"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "is_capital"],
    "additionalProperties": False,
}
countries = ["France", "Germany", "Italy", "Spain", "Portugal"]
prompts = [f"Name a big city in {c} (question {i}) and answer in JSON." for i in range(4) for c in countries]


def ask(prompt):
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )
    return r.choices[0]


with concurrent.futures.ThreadPoolExecutor(20) as pool:
    answers = list(pool.map(ask, prompts))
for prompt, choice in zip(prompts, answers):
    text = choice.message.content
    value = json.loads(text)  # raises on anything that is not JSON
    jsonschema.validate(value, schema)
    assert choice.finish_reason == "stop", (prompt, choice.finish_reason, text)
print(f"json_schema: {len(answers)} answers, all valid; e.g. {answers[0].message.content!r}")

r = client.chat.completions.create(
    model=model, temperature=0, max_tokens=300, response_format={"type": "json_object"},
    messages=[{"role": "user", "content": "Give me a JSON object with a cat's name and age."}])
assert r.choices[0].finish_reason == "stop", r.choices[0]
obj = json.loads(r.choices[0].message.content)
assert isinstance(obj, dict), obj
print(f"json_object: {r.choices[0].message.content!r}")

chunks = list(client.chat.completions.create(
    model=model, temperature=0, max_tokens=5, stream=True, stream_options={"include_usage": True},
    messages=[{"role": "user", "content": "Say hi."}]))
assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5, chunks[-1]
assert chunks[-1].choices == [], chunks[-1]
print(f"include_usage: {chunks[-1].usage}")

# logprobs with top_logprobs: one entry per token, spelling the answer; the
# greedy token is the likeliest; streamed, the last chunk carries the same.
r = client.chat.completions.create(model=model, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3,
                                   messages=[{"role": "user", "content": "Say hi."}])
content = r.choices[0].logprobs.content
assert len(content) == r.usage.completion_tokens == 6, r
assert "".join(c.token for c in content) == r.choices[0].message.content, r
for c in content:
    assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token, c
    assert c.logprob <= 0 and abs(c.top_logprobs[0].logprob - c.logprob) < 1e-4, c
    assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob, c
streamed = [ch for ch in client.chat.completions.create(
    model=model, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3, stream=True,
    messages=[{"role": "user", "content": "Say hi."}]) if ch.choices and ch.choices[0].logprobs]
assert [c.logprob for c in streamed[-1].choices[0].logprobs.content] == [c.logprob for c in content], streamed
print(f"logprobs: {[(c.token, round(c.logprob, 3)) for c in content]}")
try:
    client.chat.completions.create(model=model, max_tokens=2, logprobs=True, top_logprobs=21,
                                   messages=[{"role": "user", "content": "x"}])
    raise AssertionError("top_logprobs=21 was accepted")
except openai.BadRequestError as e:
    print(f"top_logprobs=21: {e.status_code}")

# A schema llguidance cannot compile is the client's error (400), in OpenAI's shape.
try:
    client.chat.completions.create(
        model=model, max_tokens=5, messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})
    raise AssertionError("a bad schema was accepted")
except openai.BadRequestError as e:
    print(f"bad schema: {e.status_code} {e.body}")
print("OK")
