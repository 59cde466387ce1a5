"""Drives the gateway's Messages API with the official Anthropic Python SDK.

Usage: python3 tests/anthropic_client.py GATEWAY_URL API_KEY MODEL
(GATEWAY_URL without /v1: the SDK adds it.) Exits non-zero, with the failed assertion,
when any check fails; prints "all checks passed" last.
"""

import json
import sys

import anthropic

base_url, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=300)

# Create: a system prompt as a string, one user turn.
msg = client.messages.create(
    model=model,
    max_tokens=16,
    system="You answer in one short sentence.",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
)
assert msg.type == "message" and msg.role == "assistant", msg
assert msg.id.startswith("msg_"), msg.id
assert msg.content and msg.content[0].type == "text" and msg.content[0].text, msg.content
assert msg.stop_reason in ("end_turn", "max_tokens"), msg.stop_reason
assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 16, msg.usage

# Stream: the text deltas add up to the final message's text.
with client.messages.stream(
    model=model,
    max_tokens=12,
    system=[{"type": "text", "text": "You are brief."}],
    messages=[{"role": "user", "content": "Say hello."}],
) as stream:
    pieces = list(stream.text_stream)
    final = stream.get_final_message()
assert pieces, "no text deltas"
assert "".join(pieces) == final.content[0].text, (pieces, final.content)
assert final.stop_reason in ("end_turn", "max_tokens"), final.stop_reason
assert final.usage.output_tokens > 0, final.usage

# A tool-use round trip: the named tool is called, its result goes back, the model answers.
tools = [
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
        },
    }
]
question = {"role": "user", "content": "What is the weather in Paris?"}
# Greedy (the Messages API's `temperature`; this SDK sends it as an extra body field):
# sampled at the default temperature, the small model now and then adds keys the schema
# allows until it runs out of tokens, and the call ends on `max_tokens`.
called = client.messages.create(
    model=model,
    max_tokens=48,
    extra_body={"temperature": 0},
    tools=tools,
    tool_choice={"type": "tool", "name": "get_weather"},
    messages=[question],
)
uses = [b for b in called.content if b.type == "tool_use"]
assert called.stop_reason == "tool_use", called
assert len(uses) >= 1 and uses[0].name == "get_weather", called.content
assert isinstance(uses[0].input.get("city"), str), uses[0].input
answer = client.messages.create(
    model=model,
    max_tokens=16,
    tools=tools,
    tool_choice={"type": "none"},
    messages=[
        question,
        {"role": "assistant", "content": called.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}],
        },
    ],
)
assert answer.content[0].type == "text" and answer.content[0].text, answer.content

# Streamed tool use: the SDK assembles the input from input_json_delta events.
with client.messages.stream(
    model=model,
    max_tokens=48,
    extra_body={"temperature": 0},
    tools=tools,
    tool_choice={"type": "tool", "name": "get_weather"},
    messages=[question],
) as stream:
    final = stream.get_final_message()
streamed_uses = [b for b in final.content if b.type == "tool_use"]
assert streamed_uses and isinstance(streamed_uses[0].input.get("city"), str), final.content
assert final.stop_reason == "tool_use", final.stop_reason

# count_tokens: the model's tokenizer after its chat template; more text, more tokens.
short = client.messages.count_tokens(
    model=model, system="You are brief.", messages=[{"role": "user", "content": "Hi"}]
)
long = client.messages.count_tokens(
    model=model,
    system="You are brief.",
    messages=[{"role": "user", "content": "Hi there, how are you doing on this fine day?"}],
)
assert 0 < short.input_tokens < long.input_tokens, (short, long)

# Structured output: output_config's JSON schema holds the answer to it.
schema = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
structured = client.messages.create(
    model=model,
    max_tokens=32,
    messages=[{"role": "user", "content": "Name a city in France as JSON."}],
    output_config={"format": {"type": "json_schema", "schema": schema}},
)
assert isinstance(json.loads(structured.content[0].text)["city"], str), structured.content

# Errors come in Anthropic's shape, as the SDK's typed exceptions.
try:
    client.messages.create(model=model, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    raise AssertionError("max_tokens=0 was accepted")
except anthropic.BadRequestError as e:
    assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body
try:
    anthropic.Anthropic(base_url=base_url, api_key="sk-wrong", max_retries=0).messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": "x"}]
    )
    raise AssertionError("a wrong key was accepted")
except anthropic.AuthenticationError as e:
    assert e.body["error"]["type"] == "authentication_error", e.body
try:
    client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    raise AssertionError("an unknown model was accepted")
except anthropic.NotFoundError as e:
    assert e.body["error"]["type"] == "not_found_error", e.body

print("all checks passed")
