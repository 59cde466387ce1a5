"""Output throughput of a running Strata (or vLLM) engine for speculative decoding and
structured outputs, at a given number of concurrent streams.

Usage:
  python3 bench/engine_features.py URL WORKLOAD STREAMS [REQUESTS_PER_STREAM]

WORKLOAD:
  repetitive  answers that copy or edit their input (code renames, quoting), greedy
  random      greedy continuations of prompts of 64 words drawn from 12, 128 tokens each
              (ignore_eos; the small model's greedy continuations repeat themselves)
  novel       sampled (temperature 1, seeded) continuations of 64 made-up words drawn
              from ~600, 128 tokens each: little for prompt lookup to find
  schema      a JSON-schema response_format (an order with items), sampled
  noschema    the same prompts as `schema` without the response_format

Prints one JSON line: output tokens, seconds, output tok/s, and the engine's
vllm:spec_decode_* counters accumulated during the run. Start the engine with and without
--speculative-config (or compare `schema` with `noschema`) to get the ratio.
"""

import json
import random
import sys
import threading
import time
import urllib.request

url, workload, streams = sys.argv[1].rstrip("/"), sys.argv[2], int(sys.argv[3])
per_stream = int(sys.argv[4]) if len(sys.argv) > 4 else 4

CODE = """def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price * item.quantity
    return subtotal + subtotal * tax


def cheapest_item(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best


def count_items(items):
    count = 0
    for item in items:
        count = count + item.quantity
    return count
"""
TEXT = (
    "The river flows through the valley, past the old mill and the stone bridge, "
    "and on to the sea. In spring the water rises and floods the meadows; in summer "
    "it runs slow and clear, and children swim near the mill. In autumn the leaves "
    "fall into the water and drift down to the bridge, where the old men fish in the "
    "mornings. In winter the river freezes at the edges, and the mill wheel stops "
    "until the spring comes back to the valley."
)
REPETITIVE = [
    f"Rename the function total_price to order_total in this code. Reply with the full code only.\n{CODE}",
    f"Copy this paragraph exactly, then stop:\n{TEXT}",
    f"Rewrite this code with the variable subtotal renamed to running. Full code only.\n{CODE}",
    f"Quote the following text word for word:\n{TEXT}",
]
WORDS = "apple river stone window quiet orange market seven lantern piano garden cloud".split()
# A large vocabulary of made-up words, for prompts whose continuation nothing predicts.
_SYL = "ka lo mi ten ru sa vo pel dri now gar ith ul ben cos fa".split()
_rng = random.Random(5)
NOVEL_WORDS = sorted({"".join(_rng.choice(_SYL) for _ in range(3)) for _ in range(600)})
SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 30},
        "items": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                },
                "required": ["name", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["customer", "items", "express"],
    "additionalProperties": False,
}


def body(stream, i):
    rng = random.Random(stream * 1000 + i)
    if workload == "repetitive":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": REPETITIVE[(stream + i) % len(REPETITIVE)]}],
            "max_tokens": 256,
            "temperature": 0,
        }
    if workload == "random":
        prompt = " ".join(rng.choice(WORDS) for _ in range(64))
        return "/v1/completions", {
            "prompt": prompt,
            "max_tokens": 128,
            "temperature": 0,
            "ignore_eos": True,
        }
    if workload == "novel":
        prompt = " ".join(rng.choice(NOVEL_WORDS) for _ in range(64))
        return "/v1/completions", {
            "prompt": prompt,
            "max_tokens": 128,
            "temperature": 1.0,
            "seed": stream * 1000 + i,
            "ignore_eos": True,
        }
    prompt = f"Write an order for customer number {stream * 100 + i} as JSON."
    b = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 200,
        "temperature": 0.7,
        "seed": stream * 1000 + i,
    }
    if workload == "schema":
        b["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "order", "schema": SCHEMA, "strict": True},
        }
    return "/v1/chat/completions", b


def post(path, payload):
    req = urllib.request.Request(
        url + path,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def counters():
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "per_pos" not in line:
            name = line.split("{")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


tokens = [0] * streams


def run(stream):
    for i in range(per_stream):
        path, payload = body(stream, i)
        tokens[stream] += post(path, payload)["usage"]["completion_tokens"]


post(*body(0, 999))  # warm up (and fill the prefix cache with the template)
before = counters()
start = time.time()
threads = [threading.Thread(target=run, args=(s,)) for s in range(streams)]
for t in threads:
    t.start()
for t in threads:
    t.join()
elapsed = time.time() - start
after = counters()
spec = {k.split(":")[1]: after[k] - before.get(k, 0.0) for k in after}
drafts = spec.get("spec_decode_num_draft_tokens_total", 0.0)
accepted = spec.get("spec_decode_num_accepted_tokens_total", 0.0)
print(
    json.dumps(
        {
            "workload": workload,
            "streams": streams,
            "output_tokens": sum(tokens),
            "seconds": round(elapsed, 2),
            "output_tok_per_s": round(sum(tokens) / elapsed, 1),
            "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
            **spec,
        }
    )
)
