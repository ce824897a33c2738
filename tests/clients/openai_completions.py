"""The official `openai` SDK's completions: fill-in-the-middle with
`suffix` on Qwen2.5-Coder-0.5B (real weights) fills the gap; a plain
prompt continues it, streamed the same; n > 1 and logprobs are refused.
    openai_completions.py BASE_URL FIM_MODEL OTHER_MODEL"""
import sys

import openai

base, model, other = sys.argv[1:4]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
prefix, suffix = "def add(a, b):\n    return ", "\n\n\nprint(add(1, 2))\n"
r = client.completions.create(model=model, prompt=prefix, suffix=suffix, max_tokens=12, temperature=0)
middle = r.choices[0].text
assert "a + b" in middle or "a+b" in middle, repr(middle)
print(f"fim: {middle!r} ({r.usage.prompt_tokens} prompt tokens)")

r = client.completions.create(model=model, prompt="# A function that adds two numbers\ndef", max_tokens=10, temperature=0)
text = r.choices[0].text
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt="# A function that adds two numbers\ndef", max_tokens=10, temperature=0, stream=True)
    if c.choices)
assert text and streamed == text, (text, streamed)
print(f"completion: {text!r} (streamed the same)")

for kwargs in ({"n": 2}, {"logprobs": 2}):
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, **kwargs)
        raise AssertionError(f"{kwargs} was accepted")
    except openai.BadRequestError as e:
        print(f"{kwargs}: {e.status_code}")
try:
    client.completions.create(model=other, prompt="x", suffix="y", max_tokens=2)
    raise AssertionError("a suffix was accepted by a model without FIM tokens")
except openai.BadRequestError as e:
    assert "fill-in-the-middle" in str(e), e
    print(f"no FIM tokens: {e.status_code}")
print("OK")
