"""The official `openai` SDK's completions: fill-in-the-middle with
`suffix` on Qwen2.5-Coder-0.5B (real weights) fills the gap; a plain
prompt continues it, streamed the same; logprobs (legacy shape) add up
to the text; n > 1 is refused.
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

# logprobs: the tokens spell the text; a greedy token is its own likeliest alternative.
r = client.completions.create(model=model, prompt="# A function that adds two numbers\ndef", max_tokens=10,
                              temperature=0, logprobs=2)
lp = r.choices[0].logprobs
assert "".join(lp.tokens) == text and len(lp.token_logprobs) == 10, lp
assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs), lp
assert all(abs(max(t.values()) - v) < 1e-4 for t, v in zip(lp.top_logprobs, lp.token_logprobs)), lp
assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(text) - len(lp.tokens[-1]), lp
print(f"logprobs: {list(zip(lp.tokens, [round(v, 3) for v in lp.token_logprobs]))[:4]}...")

try:
    client.completions.create(model=model, prompt="x", max_tokens=2, n=2)
    raise AssertionError("n=2 was accepted")
except openai.BadRequestError as e:
    assert "send n requests" in str(e), e
    print(f"n=2: {e.status_code}")
try:
    client.completions.create(model=other, prompt="x", suffix="y", max_tokens=2)
    raise AssertionError("a suffix was accepted by a model without FIM tokens")
except openai.BadRequestError as e:
    assert "fill-in-the-middle" in str(e), e
    print(f"no FIM tokens: {e.status_code}")
print("OK")
