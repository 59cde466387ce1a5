"""Drives the gateway's Responses API with the official OpenAI Python SDK.

Usage: python3 tests/openai_responses.py BASE_URL API_KEY MODEL   (BASE_URL ends in /v1)
Exits non-zero, with the failed assertion, when any check fails; prints "all checks
passed" last.
"""

import json
import sys

import openai

base_url, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)

# Create.
first = client.responses.create(
    model=model,
    instructions="You answer in one short sentence.",
    input="What is the capital of France?",
    max_output_tokens=16,
    temperature=0,
)
assert first.object == "response" and first.id.startswith("resp_"), first
assert first.status in ("completed", "incomplete"), first.status
assert first.output_text, first.output
assert first.usage.input_tokens > 0 and 0 < first.usage.output_tokens <= 16, first.usage

# previous_response_id continues it; GET gives it back.
second = client.responses.create(
    model=model,
    input="And of Germany?",
    previous_response_id=first.id,
    max_output_tokens=16,
    temperature=0,
)
assert second.previous_response_id == first.id, second
# The second prompt holds the first turn: more input tokens than the first had.
assert second.usage.input_tokens > first.usage.input_tokens, (first.usage, second.usage)
got = client.responses.retrieve(first.id)
assert got.id == first.id and got.output_text == first.output_text, got

# Stream: the deltas add up to the final response's text.
with client.responses.stream(
    model=model, input="Say hello.", max_output_tokens=12, temperature=0
) as stream:
    deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    final = stream.get_final_response()
assert deltas and "".join(deltas) == final.output_text, (deltas, final.output_text)
assert final.usage.output_tokens > 0, final.usage
# A streamed response is kept too, and can be continued.
after = client.responses.create(
    model=model, input="Again.", previous_response_id=final.id, max_output_tokens=8
)
assert after.output_text, after

# A function tool: the named function is called, its output goes back.
tools = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
        # Strict: the grammar admits no other argument, so the call always closes within
        # max_output_tokens (a sampled model may otherwise add keys until it is cut).
        "strict": True,
    }
]
called = client.responses.create(
    model=model,
    input="What is the weather in Paris?",
    tools=tools,
    tool_choice={"type": "function", "name": "get_weather"},
    max_output_tokens=48,
)
calls = [o for o in called.output if o.type == "function_call"]
assert calls and calls[0].name == "get_weather", called.output
assert isinstance(json.loads(calls[0].arguments).get("city"), str), calls[0].arguments
answered = client.responses.create(
    model=model,
    previous_response_id=called.id,
    input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
    tools=tools,
    tool_choice="none",
    max_output_tokens=16,
)
assert answered.output_text, answered.output

# text.format: a JSON schema the output follows.
schema = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
structured = client.responses.create(
    model=model,
    input="Name a city in France as JSON.",
    text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    max_output_tokens=32,
)
assert isinstance(json.loads(structured.output_text)["city"], str), structured.output_text

# Errors are OpenAI-shaped.
try:
    client.responses.create(model=model, input="x", previous_response_id="resp_missing")
    raise AssertionError("an unknown previous_response_id was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "previous_response_id", e.body
try:
    client.responses.retrieve("resp_missing")
    raise AssertionError("an unknown response was found")
except openai.NotFoundError:
    pass

print("all checks passed")
