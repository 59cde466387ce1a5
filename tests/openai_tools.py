"""A whole tool loop with the official OpenAI Python client against a Strata engine
served with --enable-auto-tool-choice --tool-call-parser hermes (directly, or through the
gateway): two tools, tool_choice "required", the call parsed into message.tool_calls, a
`tool` message with the result, and the final answer in words; the same call streamed as
tool-call deltas; a named function; seeded required calls at temperature 1.0 whose
arguments validate; and an unknown named function refused as a 400 naming tool_choice.

Usage: python3 tests/openai_tools.py BASE_URL MODEL [API_KEY]
Exits non-zero (with the failed assertion) when any check fails.
"""

import json
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
api_key = sys.argv[3] if len(sys.argv) > 3 else "unused"
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=180)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a timezone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 16}},
                "required": ["timezone"],
            },
            "strict": True,
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


def validate(name, arguments):
    """The arguments string of a call of `name`, checked against its schema."""
    assert name in SCHEMAS, f"unknown function {name!r}"
    schema = SCHEMAS[name]
    args = json.loads(arguments)
    assert isinstance(args, dict), f"arguments are not an object: {arguments!r}"
    for key in schema["required"]:
        assert key in args, f"{name}: missing {key} in {arguments!r}"
    for key, value in args.items():
        prop = schema["properties"].get(key)
        assert prop is not None, f"{name}: unexpected {key} in {arguments!r}"
        assert isinstance(value, str), f"{name}: {key} is not a string in {arguments!r}"
        assert len(value) <= prop.get("maxLength", len(value)), f"{key} too long: {arguments!r}"
        assert value in prop.get("enum", [value]), f"{key} outside its enum: {arguments!r}"
    return args


def one_call(choice):
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1, choice.message
    call = calls[0]
    assert call.type == "function" and call.id, call
    validate(call.function.name, call.function.arguments)
    return call


# 1. required: the call, parsed.
first = client.chat.completions.create(
    model=model,
    messages=QUESTION,
    tools=TOOLS,
    tool_choice="required",
    parallel_tool_calls=False,
    temperature=1.0,
    seed=3,
    max_tokens=64,
)
call = one_call(first.choices[0])

# 2. The call and its result in the history; the final answer in words.
history = QUESTION + [
    first.choices[0].message.model_dump(exclude_none=True),
    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny; 14:05"},
]
final = client.chat.completions.create(
    model=model,
    messages=history,
    tools=TOOLS,
    tool_choice="none",
    temperature=0,
    max_tokens=24,
)
answer = final.choices[0].message
assert not answer.tool_calls, answer
assert answer.content and answer.content.strip(), f"no final answer: {answer!r}"
assert final.choices[0].finish_reason in ("stop", "length"), final.choices[0].finish_reason

# 3. The same call streamed: a first delta with id, type and name, then arguments.
stream = client.chat.completions.create(
    model=model,
    messages=QUESTION,
    tools=TOOLS,
    tool_choice="required",
    parallel_tool_calls=False,
    temperature=1.0,
    seed=3,
    max_tokens=64,
    stream=True,
)
name, arguments, ids, finish = None, "", [], None
for chunk in stream:
    if not chunk.choices:
        continue
    c = chunk.choices[0]
    finish = c.finish_reason or finish
    for tc in c.delta.tool_calls or []:
        assert tc.index == 0, tc
        if tc.id:
            ids.append(tc.id)
            assert tc.type == "function" and tc.function.name, tc
            name = tc.function.name
        arguments += tc.function.arguments or ""
assert len(ids) == 1, f"one first delta with an id, got {ids}"
assert finish == "tool_calls", finish
assert (name, arguments) == (call.function.name, call.function.arguments), (name, arguments, call)

# 4. A named function is the one called.
named = client.chat.completions.create(
    model=model,
    messages=QUESTION,
    tools=TOOLS,
    tool_choice={"type": "function", "function": {"name": "get_time"}},
    temperature=1.0,
    seed=11,
    max_tokens=64,
)
assert one_call(named.choices[0]).function.name == "get_time"

# 5. Seeded required calls at temperature 1.0: every one validates.
for seed in range(100, 108):
    r = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=64,
    )
    one_call(r.choices[0])

# 6. An unknown named function: a 400 naming tool_choice.
try:
    client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "nope"}},
        max_tokens=4,
    )
    raise AssertionError("an unknown named function was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400, e
    assert e.body and e.body.get("param") == "tool_choice", e.body

print("all checks passed")
