#!/usr/bin/env bash
# What serving Anthropic's Messages API and OpenAI's Responses API by translation costs the
# gateway over plain chat: the same fixed backend (one constant 4-token chat completion,
# no timers), the gateway pinned to one core (GW_CPU, default 1) with one tokio worker,
# the backend and the load generator on the other (LOAD_CPUS, default 0), key auth, rate
# limits, cost accounting, the SQLite ledger and metrics on, as in gateway_overhead.sh.
# One interleaved run: every round runs chat, messages, responses (store: false) and
# responses-store (each response kept in SQLite) back to back, first at a fixed open-loop
# rate (RATE, default 500 req/s: latency), then closed-loop with CONC (default 32)
# clients (max req/s and the gateway's CPU seconds per request, from /proc/PID/stat).
# Raw JSON lines go to target/gateway-apis/results.jsonl, medians (min–max) to stdout.
#
#   bench/gateway_apis.sh [ROUNDS=3] [SECONDS=8]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${2:-8}
RATE=${RATE:-500}
CONC=${CONC:-32}
GW_CPU=${GW_CPU:-1}
LOAD_CPUS=${LOAD_CPUS:-0}
OUT=target/gateway-apis
mkdir -p "$OUT"
: > "$OUT/results.jsonl"

[ "${SKIP_BUILD:-0}" = 1 ] || cargo build -q --release -p strata-gateway --example gateway_bench
BIN=${BIN:-target/release/examples/gateway_bench}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 600); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done; echo "no answer from $1" >&2; return 1; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TCK=$(getconf CLK_TCK)

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM

BACK_PORT=$(free_port); GW_PORT=$(free_port)
taskset -c "$LOAD_CPUS" $BIN --workers 1 fixed --port "$BACK_PORT" 2>/dev/null & PIDS+=($!)
wait_http "http://127.0.0.1:$BACK_PORT/health"

cat > "$OUT/gateway.yaml" <<YAML
upstreams:
  - {name: fixed, base_url: "http://127.0.0.1:$BACK_PORT"}
models:
  - name: m
    targets: [{upstream: fixed}]
    price: {input_per_1m: 0.15, output_per_1m: 0.6}
limits:
  default_key: {rpm: 1000000000, tpm: 1000000000000}
  default_tenant: {rpm: 1000000000, tpm: 1000000000000}
YAML
rm -f "$OUT/gateway.db"*
taskset -c "$GW_CPU" $BIN --workers 1 gateway --config "$OUT/gateway.yaml" --port "$GW_PORT" \
  --db "$OUT/gateway.db" --create-key-for bench > "$OUT/gateway.out" 2>"$OUT/gateway.err" & GW_PID=$!; PIDS+=($GW_PID)
wait_http "http://127.0.0.1:$GW_PORT/health"
GW_KEY=$(grep -o 'sk-strata-[0-9a-f-]*' "$OUT/gateway.out")
GW=http://127.0.0.1:$GW_PORT

run() { # api mode args...
  local api=$1 mode=$2; shift 2
  local t0 t1 res
  t0=$(cpu_ticks "$GW_PID")
  res=$(taskset -c "$LOAD_CPUS" $BIN --workers 1 load --url "$GW" --key "$GW_KEY" --seconds "$SECS" --api "$api" "$@")
  t1=$(cpu_ticks "$GW_PID")
  echo "{\"round\":$ROUND,\"api\":\"$api\",\"mode\":\"$mode\",\"cpu_ticks\":$((t1 - t0)),\"load\":\"$LOADAVG\",\"result\":$res}" >> "$OUT/results.jsonl"
  echo "round $ROUND $api $mode: $res"
}

for ROUND in $(seq 1 "$ROUNDS"); do
  LOADAVG=$(uptime | sed 's/.*load average: //')
  echo "round $ROUND: load average $LOADAVG"
  for api in chat messages responses responses-store; do run "$api" rate --rate "$RATE"; done
  for api in chat messages responses responses-store; do run "$api" max --concurrency "$CONC"; done
done

python3 - "$OUT/results.jsonl" "$TCK" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tck = float(sys.argv[2])
def med(xs): return statistics.median(xs), min(xs), max(xs)
def fmt(t, unit=""): return f"{t[0]:.1f}{unit} ({t[1]:.1f}–{t[2]:.1f})"
def cpu(r): return r['cpu_ticks'] / tck / max(1, r['result']['requests']) * 1e6
apis = ["chat", "messages", "responses", "responses-store"]
base_cpu = {r['round']: cpu(r) for r in rows if r['api'] == 'chat' and r['mode'] == 'max'}
base_p50 = {r['round']: r['result']['p50_ms'] for r in rows if r['api'] == 'chat' and r['mode'] == 'rate'}
for api in apis:
    rate = [r for r in rows if r['api'] == api and r['mode'] == 'rate']
    mx = [r for r in rows if r['api'] == api and r['mode'] == 'max']
    p50 = med([r['result']['p50_ms'] * 1e3 for r in rate])
    p99 = med([r['result']['p99_ms'] * 1e3 for r in rate])
    added = med([(r['result']['p50_ms'] - base_p50[r['round']]) * 1e3 for r in rate])
    c = med([cpu(r) for r in mx])
    rel = med([cpu(r) / base_cpu[r['round']] * 100 - 100 for r in mx])
    rps = med([r['result']['rps'] for r in mx])
    errs = sum(r['result']['errors'] for r in rate + mx)
    print(f"{api:16s} p50 {fmt(p50,' us')}, p99 {fmt(p99,' us')}, p50 vs chat {fmt(added,' us')}; "
          f"max {fmt(rps,' req/s')}, CPU/request {fmt(c,' us')} ({fmt(rel,' %')} vs chat); errors {errs}")
print("load averages per round:", sorted({(r['round'], r['load']) for r in rows}))
PY
