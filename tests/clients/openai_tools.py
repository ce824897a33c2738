"""The official `openai` SDK: a tool round trip on Qwen2.5-Coder-0.5B (real
weights): tool_choice "required" gives a get_weather call whose arguments
validate against its schema; the same call streamed reassembles from its
deltas; a `role: tool` result then gets a final answer in text.
    openai_tools.py BASE_URL MODEL"""
import json
import sys

import jsonschema
import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
params = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": params}}]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]

r = client.chat.completions.create(model=model, temperature=0, max_tokens=60, messages=messages, tools=tools,
                                   tool_choice="required")
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", choice
calls = choice.message.tool_calls
assert calls and calls[0].function.name == "get_weather", choice
args = json.loads(calls[0].function.arguments)
jsonschema.validate(args, params)
print(f"required: {calls[0].function.name}({args}) id {calls[0].id}")

# The same request streamed: the deltas reassemble to the same call.
name, arguments, finish = "", "", None
for chunk in client.chat.completions.create(model=model, temperature=0, max_tokens=60, messages=messages,
                                            tools=tools, tool_choice="required", stream=True):
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    for tc in d.tool_calls or []:
        name += tc.function.name or ""
        arguments += tc.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
assert (name, json.loads(arguments), finish) == ("get_weather", args, "tool_calls"), (name, arguments, finish)
print(f"streamed: {name}({arguments})")

# A named function is enforced the same way.
r = client.chat.completions.create(model=model, temperature=0, max_tokens=60, messages=messages, tools=tools,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
assert r.choices[0].message.tool_calls[0].function.name == "get_weather", r

# The tool's result, then the final answer.
messages += [
    {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
    {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"temperature": 18, "sky": "sunny"})},
]
r = client.chat.completions.create(model=model, temperature=0, max_tokens=40, messages=messages, tools=tools)
final = r.choices[0]
assert final.message.content and not final.message.tool_calls, final
assert final.finish_reason in ("stop", "length"), final
print(f"final: {final.message.content!r}")

# A model without tool support says so (400), not silently ignoring them.
try:
    client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", max_tokens=5, messages=messages[:1],
                                   tools=tools)
    raise AssertionError("tools were accepted by a model whose template has none")
except openai.BadRequestError as e:
    assert "no tool support" in str(e), e
    print(f"no tool support: {e.status_code}")
print("OK")
