"""Drives a Strata engine serving LoRA adapters with the official OpenAI Python client.

Usage: python3 tests/openai_lora.py BASE_URL BASE_MODEL REAL_ADAPTER ZERO_B_ADAPTER
REAL_ADAPTER changes the model's output; ZERO_B_ADAPTER has B = 0, so it must answer
exactly as the base model does. Exits non-zero (with the failed assertion) when a check fails.
"""

import sys

import openai

base_url, base, real, zero = sys.argv[1:5]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

# /v1/models lists both adapters with the base model as their parent.
cards = {m.id: m for m in client.models.list().data}
for name in (real, zero):
    assert name in cards, f"/v1/models lists {list(cards)}, not {name}"
    parent = getattr(cards[name], "parent", None) or (cards[name].model_extra or {}).get("parent")
    assert parent == base, f"{name}'s parent is {parent!r}, not {base!r}"

# An open-ended prompt: many continuations are close, so an adapter shows at once.
messages = [{"role": "user", "content": "Write a short poem about the sea."}]


def chat(model):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert r.model == model, f"asked {model}, answered as {r.model}"
    assert r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason
    assert r.usage.completion_tokens > 0, r.usage
    return r.choices[0].message.content


base_text = chat(base)
assert chat(zero) == base_text, "the zero-B adapter must answer as the base model does"
real_text = chat(real)
assert real_text != base_text, f"the real adapter changed nothing: {real_text!r}"

# Streaming through an adapter gives the same text as the non-streaming answer.
pieces = []
for chunk in client.chat.completions.create(
    model=real, messages=messages, max_tokens=16, temperature=0, stream=True
):
    assert chunk.model == real, chunk.model
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
assert "".join(pieces) == real_text, f"{''.join(pieces)!r} != {real_text!r}"

# An adapter that is not loaded is the SDK's NotFoundError.
try:
    client.chat.completions.create(model="no-such-adapter", messages=messages, max_tokens=1)
    raise AssertionError("an unknown adapter was accepted")
except openai.NotFoundError:
    pass

print("all checks passed")
