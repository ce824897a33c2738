"""The official `anthropic` SDK against /v1/messages: greedy text equal to
/v1/chat/completions' on the same prompt, plain and streamed (the SDK's own
stream accumulator); stop_sequences report the one that matched;
count_tokens equals the prompt's usage; a tool round trip on
Qwen2.5-Coder-0.5B (tool_choice any / a named tool give tool_use blocks
whose input validates, streamed too; a tool_result then gets text); a
base64 image on a vision model; refusals as Anthropic errors.
    anthropic_messages.py BASE_URL TEXT_MODEL TOOLS_MODEL VISION_MODEL PNG"""
import base64
import json
import sys
import urllib.request

import anthropic
import jsonschema

base, text_model, tools_model, vision_model, png = sys.argv[1:6]
client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
question = "What is the capital of France?"
# The current API has no sampling parameters; mlxbcd honours them in the body.
greedy = {"extra_body": {"temperature": 0}}


def chat_completion(model, content, max_tokens, system=None, messages=None, **extra):
    """The same prompt through OpenAI's chat completions: the reference."""
    if messages is None:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": content})
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "messages": messages, **extra}
    req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


# Plain text: the same greedy answer as chat completions, system blocks included.
want = chat_completion(text_model, question, 12, system="Answer briefly.")
m = client.messages.create(model=text_model, max_tokens=12, **greedy,
                           system=[{"type": "text", "text": "Answer briefly."}],
                           messages=[{"role": "user", "content": question}])
assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m
assert [b.type for b in m.content] == ["text"], m
assert m.content[0].text == want["choices"][0]["message"]["content"], (m, want)
assert m.stop_reason == "max_tokens" and m.stop_sequence is None, m
assert (m.usage.input_tokens, m.usage.output_tokens) == (want["usage"]["prompt_tokens"], 12), (m.usage, want)
print(f"text: {m.content[0].text!r}")

# Streamed with the SDK's accumulator: the same text, the same final message.
with client.messages.stream(model=text_model, max_tokens=12, **greedy, system="Answer briefly.",
                            messages=[{"role": "user", "content": question}]) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
assert streamed == m.content[0].text, (streamed, m)
assert final.content[0].text == streamed and final.stop_reason == "max_tokens", final
assert final.usage.output_tokens == 12 and final.usage.input_tokens == m.usage.input_tokens, final.usage
print(f"streamed: {streamed!r}")

# A stop sequence taken from inside the answer: stop_reason and which one matched.
words = m.content[0].text.split()
assert len(words) >= 3, m
stop_word = words[2]
s = client.messages.create(model=text_model, max_tokens=12, **greedy, system="Answer briefly.",
                           messages=[{"role": "user", "content": question}],
                           stop_sequences=["<never>", stop_word])
assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop_word, s
assert m.content[0].text.startswith(s.content[0].text) and stop_word not in s.content[0].text, (s, m)
print(f"stop_sequence: {s.stop_sequence!r} after {s.content[0].text!r}")

# count_tokens: what the generation's usage says the prompt was.
n = client.messages.count_tokens(model=text_model, system="Answer briefly.",
                                 messages=[{"role": "user", "content": question}])
assert n.input_tokens == m.usage.input_tokens, (n, m.usage)
print(f"count_tokens: {n.input_tokens}")

# Structured output: the answer is constrained to the schema.
person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
j = client.messages.create(model=text_model, max_tokens=60, **greedy,
                           messages=[{"role": "user", "content": "Invent a person."}],
                           output_config={"format": {"type": "json_schema", "schema": person}})
jsonschema.validate(json.loads(j.content[0].text), person)
assert j.stop_reason == "end_turn", j
print(f"output_config json_schema: {j.content[0].text}")

# Tools on a model whose template has them.
schema = {"type": "object",
          "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          "required": ["city"]}
tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": schema}]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
t = client.messages.create(model=tools_model, max_tokens=60, **greedy, tools=tools, messages=ask,
                           tool_choice={"type": "any"})
assert t.stop_reason == "tool_use", t
uses = [b for b in t.content if b.type == "tool_use"]
assert uses and uses[0].name == "get_weather", t
jsonschema.validate(uses[0].input, schema)
print(f"tool_use: {uses[0].name}({uses[0].input}) id {uses[0].id}")

n = client.messages.count_tokens(model=tools_model, tools=tools, messages=ask)
assert n.input_tokens == t.usage.input_tokens, (n, t.usage)

with client.messages.stream(model=tools_model, max_tokens=60, **greedy, tools=tools, messages=ask,
                            tool_choice={"type": "tool", "name": "get_weather"}) as stream:
    events = [e.type for e in stream]
    final = stream.get_final_message()
streamed_uses = [b for b in final.content if b.type == "tool_use"]
assert final.stop_reason == "tool_use" and streamed_uses[0].input == uses[0].input, final
assert events[0] == "message_start" and events[-1] == "message_stop", events
print(f"streamed tool_use: {streamed_uses[0].input}; events {sorted(set(events))}")

# The tool's result, then a text answer.
follow = ask + [{"role": "assistant", "content": [u.model_dump() for u in uses]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                              "content": json.dumps({"temperature": 18, "sky": "sunny"})}]}]
r = client.messages.create(model=tools_model, max_tokens=40, **greedy, tools=tools, messages=follow)
assert r.content and r.content[0].type == "text" and r.content[0].text.strip(), r
assert r.stop_reason in ("end_turn", "max_tokens") and not [b for b in r.content if b.type == "tool_use"], r
# The same conversation in OpenAI's form reads the same to the model: the same answer.
openai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                   "parameters": t["input_schema"]}} for t in tools]
call = {"id": uses[0].id, "type": "function", "function": {"name": uses[0].name, "arguments": json.dumps(uses[0].input)}}
want = chat_completion(tools_model, None, 40, tools=openai_tools, messages=ask + [
    {"role": "assistant", "content": None, "tool_calls": [call]},
    {"role": "tool", "tool_call_id": uses[0].id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}])
assert r.content[0].text == want["choices"][0]["message"]["content"], (r, want)
print(f"after tool_result: {r.content[0].text!r}")

# A base64 image on a vision model: the answer chat completions gives for it.
with open(png, "rb") as f:
    data = base64.b64encode(f.read()).decode()
want = chat_completion(vision_model, [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                                      {"type": "text", "text": "What is this?"}], 4)
v = client.messages.create(model=vision_model, max_tokens=4, **greedy, messages=[{"role": "user", "content": [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
    {"type": "text", "text": "What is this?"}]}])
assert v.content[0].text == want["choices"][0]["message"]["content"], (v, want)
assert v.usage.input_tokens == want["usage"]["prompt_tokens"], (v.usage, want["usage"])
print(f"image: {v.content[0].text!r} ({v.usage.input_tokens} prompt tokens)")

# Refusals in Anthropic's shape.
try:
    client.messages.create(model=vision_model, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    raise AssertionError("a URL image was accepted")
except anthropic.BadRequestError as e:
    assert e.body["error"]["type"] == "invalid_request_error" and "does not fetch" in str(e), e.body
try:
    client.messages.create(model="no-such-model", max_tokens=4, messages=ask)
    raise AssertionError("an unknown model answered")
except anthropic.NotFoundError as e:
    assert e.body["type"] == "error" and e.body["error"]["type"] == "not_found_error", e.body
try:
    client.messages.create(model=text_model, max_tokens=4, messages=ask, tools=tools)
    raise AssertionError("tools were accepted by a model whose template has none")
except anthropic.BadRequestError as e:
    assert "no tool support" in str(e), e
print("refusals: url image 400, unknown model 404, tools without support 400")
print("OK")
