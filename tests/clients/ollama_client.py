"""The official `ollama` Python client against mlxbcd's gateway (its host
set to the gateway): list, show with capabilities, chat plain and streamed,
generate, chat with tools (Qwen2.5-Coder), chat with `format=` a schema,
an image to a vision model, and errors in ollama's shape.
    ollama_client.py BASE_URL TEXT_MODEL TOOLS_MODEL VISION_MODEL PNG"""
import base64
import json
import sys

import jsonschema
import ollama

base, text_model, tools_model, vision_model, png = sys.argv[1:6]
c = ollama.Client(host=base)

names = [m.model for m in c.list().models]
assert text_model in names and tools_model in names, names
print(f"list: {names}")

show = c.show(tools_model)
assert "tools" in show.capabilities and "completion" in show.capabilities, show.capabilities
assert "tools" not in c.show(text_model).capabilities
assert "vision" in c.show(vision_model).capabilities
print(f"show: {tools_model} {show.capabilities}")

opts = {"temperature": 0, "num_predict": 8}
r = c.chat(model=text_model, messages=[{"role": "user", "content": "What is the capital of France?"}], options=opts)
assert r.done and r.message.role == "assistant" and r.message.content, r
assert 0 < r.eval_count <= 8 and r.done_reason in ("stop", "length"), r
streamed = "".join(p.message.content for p in c.chat(
    model=text_model, messages=[{"role": "user", "content": "What is the capital of France?"}], options=opts,
    stream=True))
assert streamed == r.message.content, (streamed, r.message.content)
print(f"chat: {r.message.content!r} (streamed the same)")

g = c.generate(model=text_model, prompt="What is the capital of France?", options=opts)
assert g.response == r.message.content, (g.response, r.message.content)
print(f"generate: {g.response!r}")

schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 30}},
          "required": ["name", "age"], "additionalProperties": False}
f = c.chat(model=text_model, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
           format=schema, options={"temperature": 0, "num_predict": 80})
jsonschema.validate(json.loads(f.message.content), schema)
print(f"format: {f.message.content!r}")


def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
      city: the city
    """
    return "sunny"


t = c.chat(model=tools_model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
           tools=[get_weather], options={"temperature": 0, "num_predict": 60})
assert t.message.tool_calls and t.message.tool_calls[0].function.name == "get_weather", t.message
assert "city" in t.message.tool_calls[0].function.arguments, t.message
print(f"tools: {t.message.tool_calls[0].function}")

img = base64.b64encode(open(png, "rb").read()).decode()
v = c.chat(model=vision_model, messages=[{"role": "user", "content": "What is this?", "images": [img]}],
           options={"temperature": 0, "num_predict": 4})
assert v.done and 0 < v.eval_count <= 4, v
print(f"image: {v.message.content!r}")

try:
    c.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("an unknown model answered")
except ollama.ResponseError as e:
    assert e.status_code == 404 and e.error, e
    print(f"unknown model: {e.status_code} {e.error!r}")
print("OK")
