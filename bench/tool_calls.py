"""Time per output token of a running Strata engine with tool calls held by their
grammars vs plain text, at a given number of concurrent streams.

Usage:
  python3 bench/tool_calls.py URL STREAMS [REQUESTS_PER_STREAM] [ROUNDS]

Start the engine with --enable-auto-tool-choice --tool-call-parser hermes. Each round runs
three workloads one after another, STREAMS threads each sending REQUESTS_PER_STREAM chat
requests (temperature 1.0, seeded, non-streamed):

  plain     the question alone, no tools, 40 tokens (ignore_eos)
  required  the same question with two tools and tool_choice "required" (the call's
            grammar holds every token; the call ends when the grammar does, ~30 tokens)
  auto      the same with tool_choice "auto" (the lazy grammar: free text until the model
            writes <tool_call>), 40 tokens (ignore_eos)

Time per output token is the engine's own: the change in
vllm:request_time_per_output_token_seconds (sum / count) over each workload, so queueing
and prefill are left out. Prints one JSON line per round and a last line with the median
ratios required / plain and auto / plain.
"""

import json
import statistics
import sys
import threading
import time
import urllib.request

url = sys.argv[1].rstrip("/")
streams = int(sys.argv[2])
per_stream = int(sys.argv[3]) if len(sys.argv) > 3 else 4
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {
            "timezone": {"type": "string", "maxLength": 16}},
            "required": ["timezone"]}, "strict": True}},
]
QUESTION = "What is the weather in Paris, and what time is it there?"
with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
    MODEL = json.loads(r.read())["data"][0]["id"]


def body(workload, seed):
    b = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 40,
    }
    if workload == "plain":
        b["ignore_eos"] = True
    elif workload == "required":
        b.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    elif workload == "auto":
        b.update(tools=TOOLS, tool_choice="auto", ignore_eos=True)
    return b


def post(path, payload):
    req = urllib.request.Request(
        url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def tpot_counters():
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    total, count = 0.0, 0.0
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name == "vllm:request_time_per_output_token_seconds_sum":
            total += float(line.rsplit(" ", 1)[1])
        elif name == "vllm:request_time_per_output_token_seconds_count":
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def run(workload, round_no):
    tokens, calls, errors = [0], [0], []
    lock = threading.Lock()

    def worker(w):
        for k in range(per_stream):
            seed = round_no * 10_000 + w * 100 + k
            try:
                resp = post("/v1/chat/completions", body(workload, seed))
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                tokens[0] += resp["usage"]["completion_tokens"]
                calls[0] += bool(resp["choices"][0]["message"].get("tool_calls"))

    s0, c0 = tpot_counters()
    t = time.time()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(streams)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.time() - t
    s1, c1 = tpot_counters()
    if errors:
        raise SystemExit(f"{workload}: {len(errors)} requests failed: {errors[0]}")
    tpot_ms = 1000 * (s1 - s0) / max(c1 - c0, 1)
    return {"tpot_ms": round(tpot_ms, 2), "tokens": tokens[0], "calls": calls[0], "wall_s": round(wall, 1)}


ratios = {"required": [], "auto": []}
for r in range(rounds):
    out = {"round": r, "streams": streams}
    for workload in ("plain", "required", "auto"):
        out[workload] = run(workload, r)
    for w in ratios:
        ratios[w].append(out[w]["tpot_ms"] / out["plain"]["tpot_ms"])
    with open("/proc/loadavg") as f:
        out["load"] = f.read().split()[0]
    print(json.dumps(out), flush=True)
print(json.dumps({
    "streams": streams,
    "median_required_over_plain": round(statistics.median(ratios["required"]), 3),
    "median_auto_over_plain": round(statistics.median(ratios["auto"]), 3),
    "range_required": [round(min(ratios["required"]), 3), round(max(ratios["required"]), 3)],
    "range_auto": [round(min(ratios["auto"]), 3), round(max(ratios["auto"]), 3)],
}))
