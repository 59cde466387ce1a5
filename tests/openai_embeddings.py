"""Drives a running Strata engine that serves an embedding model with the official OpenAI
Python client.

Usage: python3 tests/openai_embeddings.py BASE_URL MODEL REFERENCE_JSON
Exits non-zero (with the failed assertion) when any check fails.
"""

import json
import math
import sys

import openai

base_url, model, reference_path = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
reference = json.load(open(reference_path))["items"]


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


ids = [m.id for m in client.models.list().data]
assert model in ids, f"/v1/models lists {ids}, not {model}"

# The SDK's default: it asks for base64 and decodes little-endian float32 itself.
texts = [item["text"] for item in reference]
# The last of the ten is longer than the model's 256 tokens; the reference cut it there.
resp = client.embeddings.create(
    model=model, input=texts, extra_body={"truncate_prompt_tokens": -1}
)
assert resp.object == "list", resp.object
assert len(resp.data) == len(texts), len(resp.data)
want_tokens = sum(len(item["input_ids"]) for item in reference)
assert resp.usage.prompt_tokens == want_tokens, (resp.usage, want_tokens)
assert resp.usage.total_tokens == want_tokens, resp.usage
for i, (d, item) in enumerate(zip(resp.data, reference)):
    assert d.index == i, d.index
    v = list(d.embedding)
    assert len(v) == 384, len(v)
    c = cosine(v, item["embedding"])
    assert c >= 0.999, f"input {i}: cosine {c} with the reference"

# Floats on request: the same vectors.
floats = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
assert abs(cosine(floats.data[0].embedding, list(resp.data[0].embedding)) - 1) < 1e-6

# Token-id input.
tok = client.embeddings.create(model=model, input=reference[1]["input_ids"])
assert cosine(tok.data[0].embedding, reference[1]["embedding"]) >= 0.999
assert tok.usage.prompt_tokens == len(reference[1]["input_ids"]), tok.usage

# Errors are OpenAI errors.
try:
    client.embeddings.create(model=model, input="")
    raise AssertionError("an empty input was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400, e.status_code
try:
    client.embeddings.create(model="no-such-model", input="hi")
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404, e.status_code
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    raise AssertionError("chat on an embedding model was accepted")
except openai.BadRequestError as e:
    assert "embedding model" in str(e), str(e)

print("all checks passed")
