#!/usr/bin/env bash
# Decode speed of two `strata` binaries on the default model, interleaved: A, B, B, A, A, B,
# ... so drift in the machine's load falls on both. Each run starts a fresh engine, drives
# CONCURRENCY streams of random token-id prompts (IN tokens, OUT tokens each, ignore_eos)
# with `strata bench`, and keeps the output tokens/s and the median inter-token latency.
# Prints per level the medians (min-max) of both and B's ratio to A.
#
#   bench/engine_ab_decode.sh A_BINARY B_BINARY [ROUNDS] [CONCURRENCY ...]
#                                                 (default: 3 rounds, levels 1 16)
#
# Used for a change that must not move decode speed (A: before it, B: after it), e.g. the
# step planner's contract (docs/BENCHMARKS.md, "Step planner as a contract").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
A="$1"; B="$2"; shift 2
ROUNDS="${1:-3}"; shift || true
LEVELS=("${@:-1 16}"); read -r -a LEVELS <<<"${LEVELS[*]}"
IN="${IN:-128}"; OUT_LEN="${OUT_LEN:-128}"
MODEL="$("$B" model pull 2>/dev/null)"
NAME=smollm2-135m-instruct
OUT="$(mktemp -d)"
trap 'kill $(cat "$OUT/pids" 2>/dev/null) 2>/dev/null || true; rm -rf "$OUT"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.2; done; return 1; }

run() { # label binary concurrency round
    local label=$1 bin=$2 c=$3 r=$4 port pid
    port=$(free_port)
    "$bin" engine --port "$port" --model "$MODEL" --served-model-name "$NAME" \
        --max-num-seqs "$c" --log-format json 2>"$OUT/$label.log" &
    pid=$!; echo "$pid" >>"$OUT/pids"
    wait_ready "$port"
    "$B" bench --url "http://127.0.0.1:$port" --model "$NAME" --workload random \
        --input-len "$IN" --output-len "$OUT_LEN" --prompt-token-ids \
        --concurrency "$c" --requests "$((c * 2))" --warmup 1 --seed 7 -q \
        --label "$label-c$c-r$r" --output "$OUT/$label-c$c-r$r.json" >/dev/null
    kill -INT "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    echo "$label c=$c r=$r $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >&2
}

for r in $(seq "$ROUNDS"); do
    for c in "${LEVELS[@]}"; do
        # Alternate which goes first, so neither always meets a warmer or cooler machine.
        if (( r % 2 )); then run a "$A" "$c" "$r"; run b "$B" "$c" "$r"
        else run b "$B" "$c" "$r"; run a "$A" "$c" "$r"; fi
    done
done

python3 - "$OUT" "$ROUNDS" "${LEVELS[@]}" <<'PY'
import json, pathlib, statistics, sys
out, rounds, levels = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def read(label):
    r = json.loads((out / f"{label}.json").read_text())
    return r["throughput"]["output_tokens_per_s"], r["latency_ms"]["itl"]["p50"]
fmt = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
print("| streams | A output tok/s | B output tok/s | B ÷ A | A ITL p50 ms | B ITL p50 ms | B ÷ A |")
print("|---|---|---|---|---|---|---|")
for c in levels:
    a = [read(f"a-c{c}-r{r}") for r in range(1, rounds + 1)]
    b = [read(f"b-c{c}-r{r}") for r in range(1, rounds + 1)]
    at, bt = [x[0] for x in a], [x[0] for x in b]
    ai, bi = [x[1] for x in a], [x[1] for x in b]
    print(f"| {c} | {fmt(at)} | {fmt(bt)} | {statistics.median(bt)/statistics.median(at):.3f} "
          f"| {fmt(ai)} | {fmt(bi)} | {statistics.median(bi)/statistics.median(ai):.3f} |")
PY
