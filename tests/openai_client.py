"""Drives a running Strata engine with the official OpenAI Python client.

Usage: python3 tests/openai_client.py BASE_URL MODEL
Exits non-zero (with the failed assertion) when any check fails.
"""

import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

# Models
models = client.models.list()
ids = [m.id for m in models.data]
assert model in ids, f"/v1/models lists {ids}, not {model}"

# Chat, non-streaming, greedy
chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    max_tokens=24,
    temperature=0,
)
text = chat.choices[0].message.content
assert chat.object == "chat.completion", chat.object
assert "Paris" in text, f"chat answer does not mention Paris: {text!r}"
assert chat.choices[0].finish_reason in ("stop", "length"), chat.choices[0].finish_reason
assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens > 0, chat.usage
assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

# Chat, streaming with usage
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    max_tokens=24,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
pieces, finish, usage, n_chunks = [], None, None, 0
for chunk in stream:
    n_chunks += 1
    if chunk.usage is not None:
        usage = chunk.usage
        assert chunk.choices == [], "the usage chunk must have no choices"
        continue
    delta = chunk.choices[0].delta
    if delta.content:
        pieces.append(delta.content)
    if chunk.choices[0].finish_reason:
        finish = chunk.choices[0].finish_reason
streamed = "".join(pieces)
assert streamed == text, f"streamed {streamed!r} != non-streamed {text!r}"
assert finish in ("stop", "length"), finish
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage
assert n_chunks > 3, f"only {n_chunks} chunks: not streamed token by token"

# Completions, non-streaming and streaming
comp = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=8, temperature=0
)
assert comp.object == "text_completion", comp.object
assert "Paris" in comp.choices[0].text, comp.choices[0].text
cstream = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
)
ctext = "".join(c.choices[0].text for c in cstream if c.choices)
assert ctext == comp.choices[0].text, f"{ctext!r} != {comp.choices[0].text!r}"

# Seeded sampling is reproducible; n > 1 gives n choices
a = client.completions.create(
    model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7
)
b = client.completions.create(
    model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7
)
assert a.choices[0].text == b.choices[0].text, "same seed, different output"
multi = client.completions.create(
    model=model, prompt="Once upon a time", max_tokens=4, n=3, temperature=1.0
)
assert sorted(c.index for c in multi.choices) == [0, 1, 2], multi.choices

# Logprobs
lp = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say hi"}],
    max_tokens=4,
    temperature=0,
    logprobs=True,
    top_logprobs=3,
)
content = lp.choices[0].logprobs.content
assert len(content) == lp.usage.completion_tokens, (len(content), lp.usage)
assert all(len(t.top_logprobs) == 3 for t in content)
assert all(t.logprob <= 0 for t in content)

# Errors arrive as the client's typed exceptions
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("unknown model accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404
try:
    client.chat.completions.create(model=model, messages=[], max_tokens=4)
    raise AssertionError("empty messages accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400
    assert e.body["param"] == "messages", e.body

# Structured outputs: the SDK's parse() turns a pydantic model into a strict json_schema
# response_format and parses the answer back into the model.
from typing import List, Literal

from pydantic import BaseModel, Field


class Landmark(BaseModel):
    name: str = Field(max_length=40)
    kind: Literal["museum", "tower", "church", "park"]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)
    landmarks: List[Landmark] = Field(max_length=3)


for temperature in (0, 1):
    completion = client.beta.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=300,
        temperature=temperature,
        seed=11,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", completion.choices[0]
    assert isinstance(message.parsed, City), message
    assert all(l.kind in ("museum", "tower", "church", "park") for l in message.parsed.landmarks)
    assert City.model_validate_json(message.content) == message.parsed

# vLLM's guided_choice through extra_body
pick = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
    max_tokens=8,
    temperature=1.0,
    extra_body={"guided_choice": ["yes", "no"]},
)
assert pick.choices[0].message.content in ("yes", "no"), pick.choices[0].message.content

# A schema keyword that cannot be enforced is a 400 naming it
try:
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "if": {}, "then": {}}},
        },
    )
    raise AssertionError("unenforceable schema accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400
    assert e.body["param"] == "response_format", e.body
    assert '"if"' in e.body["message"], e.body

print("openai client: all checks passed")
