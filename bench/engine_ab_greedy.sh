#!/usr/bin/env bash
# Greedy answers of two `strata` binaries on the default model, compared byte for byte: eight
# chat prompts sent at once (so they share steps), temperature 0, 64 tokens each. For a change
# that must not move outputs (A: before it, B: after it). Exits non-zero when they differ.
#
#   bench/engine_ab_greedy.sh A_BINARY B_BINARY
set -euo pipefail
A="$1"; B="$2"
MODEL="$("$B" model pull 2>/dev/null)"
OUT="$(mktemp -d)"
trap 'kill $(cat "$OUT/pids" 2>/dev/null) 2>/dev/null || true; rm -rf "$OUT"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.2; done; return 1; }

answers() { # binary output
    local port pid
    port=$(free_port)
    "$1" engine --port "$port" --model "$MODEL" --served-model-name m 2>"$OUT/log" &
    pid=$!; echo "$pid" >>"$OUT/pids"
    wait_ready "$port"
    python3 - "$port" >"$2" <<'PY'
import concurrent.futures as cf, http.client, json, sys
port = int(sys.argv[1])
prompts = ["Write a haiku about the sea.", "What is 17 times 23?", "Name three prime numbers.",
           "Explain what a KV cache is in one sentence.", "Say hello in French.",
           "List the planets of the solar system.", "What colour is the sky on Mars?",
           "Give a short tip for writing clean code."]
def ask(p):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": "m", "temperature": 0, "max_tokens": 64,
            "messages": [{"role": "user", "content": p}]}
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.status
    return json.loads(r.read())["choices"][0]["message"]["content"]
with cf.ThreadPoolExecutor(len(prompts)) as ex:
    for p, a in zip(prompts, ex.map(ask, prompts)):
        print(json.dumps({"prompt": p, "answer": a}))
PY
    kill -INT "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
}

answers "$A" "$OUT/a.jsonl"
answers "$B" "$OUT/b.jsonl"
if cmp -s "$OUT/a.jsonl" "$OUT/b.jsonl"; then
    echo "identical: $(wc -l <"$OUT/b.jsonl") greedy answers"
else
    diff "$OUT/a.jsonl" "$OUT/b.jsonl"; exit 1
fi
