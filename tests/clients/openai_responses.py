"""The official `openai` SDK's Responses API (what Codex speaks) against
/v1/responses: greedy text equal to chat completions' on the same prompt,
whole, as raw events (in order, numbered) and through the SDK's stream
accumulator; text.format json_schema validates; a function-call round trip
on Qwen2.5-Coder-0.5B (items in, function_call out, streamed too, a
function_call_output then gets the text chat completions gives);
previous_response_id refused.
    openai_responses.py BASE_URL TEXT_MODEL TOOLS_MODEL"""
import json
import sys

import jsonschema
import openai

base, text_model, tools_model = sys.argv[1:4]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
question = "What is the capital of France?"

want = client.chat.completions.create(model=text_model, temperature=0, max_tokens=12, messages=[
    {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}])
r = client.responses.create(model=text_model, instructions="Answer briefly.", input=question, temperature=0,
                            max_output_tokens=12)
assert r.object == "response" and r.id.startswith("resp_"), r
assert r.output_text == want.choices[0].message.content, (r.output_text, want)
assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
assert (r.usage.input_tokens, r.usage.output_tokens) == (want.usage.prompt_tokens, 12), r.usage
print(f"text: {r.output_text!r}")

# Raw events: in the API's order, numbered from 0, deltas adding up to the text.
events = list(client.responses.create(model=text_model, instructions="Answer briefly.", input=question,
                                      temperature=0, max_output_tokens=12, stream=True))
types = [e.type for e in events]
assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"], types
assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                      "response.incomplete"], types
assert [e.sequence_number for e in events] == list(range(len(events))), events
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert deltas == r.output_text and events[-1].response.output_text == deltas, (deltas, events[-1])
print(f"streamed: {len(events)} events")

# Structured output through text.format.
person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
j = client.responses.create(model=text_model, input="Invent a person.", temperature=0, max_output_tokens=60,
                            text={"format": {"type": "json_schema", "name": "person", "schema": person,
                                             "strict": True}})
jsonschema.validate(json.loads(j.output_text), person)
assert j.status == "completed", j
print(f"json_schema: {j.output_text!r}")

# The SDK's accumulator over the same answer streamed (it wants `response.completed`,
# which an answer cut by max_output_tokens does not end with: `response.incomplete`).
with client.responses.stream(model=text_model, input="Invent a person.", temperature=0, max_output_tokens=60,
                             text={"format": {"type": "json_schema", "name": "person", "schema": person,
                                              "strict": True}}) as stream:
    final = stream.get_final_response()
assert final.output_text == j.output_text and final.usage.output_tokens == j.usage.output_tokens, final

# A function call, Codex's way: tools in, a function_call item out.
params = {"type": "object",
          "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          "required": ["city"]}
tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": params, "strict": False}]
ask = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}]
t = client.responses.create(model=tools_model, input=ask, tools=tools, tool_choice="required", temperature=0,
                            max_output_tokens=60)
calls = [o for o in t.output if o.type == "function_call"]
assert calls and calls[0].name == "get_weather" and t.status == "completed", t
args = json.loads(calls[0].arguments)
jsonschema.validate(args, params)
print(f"function_call: {calls[0].name}({args}) call_id {calls[0].call_id}")

events = list(client.responses.create(model=tools_model, input=ask, tools=tools, temperature=0,
                                      max_output_tokens=60, stream=True,
                                      tool_choice={"type": "function", "name": "get_weather"}))
done = [e for e in events if e.type == "response.function_call_arguments.done"]
assert done and json.loads(done[0].arguments) == args, events
assert events[-1].type == "response.completed", events[-1]

# Its output, then the answer: what chat completions says to the same conversation.
follow = ask + [{"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                 "arguments": calls[0].arguments},
                {"type": "function_call_output", "call_id": calls[0].call_id,
                 "output": json.dumps({"temperature": 18, "sky": "sunny"})}]
a = client.responses.create(model=tools_model, input=follow, tools=tools, temperature=0, max_output_tokens=40)
assert a.output_text and not [o for o in a.output if o.type == "function_call"], a
want = client.chat.completions.create(model=tools_model, temperature=0, max_tokens=40, tools=[
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": params}}], messages=[
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
        "name": "get_weather", "arguments": calls[0].arguments}}]},
    {"role": "tool", "tool_call_id": calls[0].call_id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}])
assert a.output_text == want.choices[0].message.content, (a.output_text, want)
print(f"after function_call_output: {a.output_text!r}")

try:
    client.responses.create(model=text_model, input="and then?", previous_response_id=r.id)
    raise AssertionError("previous_response_id was accepted")
except openai.BadRequestError as e:
    assert "stores no responses" in str(e), e
print("previous_response_id: 400")
print("OK")
