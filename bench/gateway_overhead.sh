#!/usr/bin/env bash
# Gateway overhead, measured the way bench/router_overhead.sh measures the router: the
# gateway pinned to one core (GW_CPU, default 1) with one tokio worker, the fast mock
# backend and the load generator on the other core(s) (LOAD_CPUS, default 0). Key auth,
# rate limits (per key and per tenant, requests and tokens), cost accounting, the SQLite
# usage ledger and metrics are all on. Interleaved rounds; raw JSON lines go to
# target/gateway-overhead/results.jsonl and a summary (medians, min–max) to stdout.
#
#   bench/gateway_overhead.sh [ROUNDS=3] [SECONDS=10]
#
# Per round: direct-to-mock and through-the-gateway latency at a fixed open-loop rate
# (RATE, default 2000 req/s; added latency = gateway minus direct in the same round), and
# max req/s with CONC (default 64) closed-loop clients with the gateway's CPU seconds per
# request (from /proc/PID/stat). `uptime` is printed before every round: the machine is
# shared, so read the numbers with the load average next to them.
#
# BACKEND=fixed (default) answers every POST with one constant 4-token chat completion
# (with usage) and no timers; BACKEND=mock uses strata-mock, whose zero-delay sleep still
# waits for the runtime's next 1 ms timer tick and so adds jitter to both sides.
# The backend and the load generator each get LOAD_WORKERS (default 1) tokio workers.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${2:-10}
RATE=${RATE:-2000}
CONC=${CONC:-64}
GW_CPU=${GW_CPU:-1}
LOAD_CPUS=${LOAD_CPUS:-0}
BACKEND=${BACKEND:-fixed}
LOAD_WORKERS=${LOAD_WORKERS:-1}
OUT=target/gateway-overhead
mkdir -p "$OUT"
: > "$OUT/results.jsonl"

[ "${SKIP_BUILD:-0}" = 1 ] || cargo build -q --release -p strata-gateway --example gateway_bench
BIN=target/release/examples/gateway_bench
# The gateway may come from another build of the same example (A/B runs: GW_BIN=old copy).
GW_BIN=${GW_BIN:-$BIN}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 600); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done; echo "no answer from $1" >&2; return 1; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TCK=$(getconf CLK_TCK)

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM

MOCK_PORT=$(free_port); GW_PORT=$(free_port)
taskset -c "$LOAD_CPUS" $BIN --workers "$LOAD_WORKERS" "$BACKEND" --port "$MOCK_PORT" 2>/dev/null & PIDS+=($!)
wait_http "http://127.0.0.1:$MOCK_PORT/health"

cat > "$OUT/gateway.yaml" <<YAML
upstreams:
  - {name: mock, base_url: "http://127.0.0.1:$MOCK_PORT"}
models:
  - name: m
    targets: [{upstream: mock}]
    price: {input_per_1m: 0.15, output_per_1m: 0.6}
limits:
  default_key: {rpm: 1000000000, tpm: 1000000000000}
  default_tenant: {rpm: 1000000000, tpm: 1000000000000}
YAML
rm -f "$OUT/gateway.db"*
taskset -c "$GW_CPU" $GW_BIN --workers 1 gateway --config "$OUT/gateway.yaml" --port "$GW_PORT" \
  --db "$OUT/gateway.db" --create-key-for bench > "$OUT/gateway.out" 2>"$OUT/gateway.err" & GW_PID=$!; PIDS+=($GW_PID)
wait_http "http://127.0.0.1:$GW_PORT/health"
GW_KEY=$(grep -o 'sk-strata-[0-9a-f-]*' "$OUT/gateway.out")
MOCK=http://127.0.0.1:$MOCK_PORT; GW=http://127.0.0.1:$GW_PORT

run() { # name url key pid args...
  local name=$1 url=$2 key=$3 pid=$4; shift 4
  local t0 t1 res
  t0=$( [ "$pid" = - ] && echo 0 || cpu_ticks "$pid")
  res=$(taskset -c "$LOAD_CPUS" $BIN --workers "$LOAD_WORKERS" load --url "$url" --key "$key" --seconds "$SECS" "$@")
  t1=$( [ "$pid" = - ] && echo 0 || cpu_ticks "$pid")
  echo "{\"round\":$ROUND,\"name\":\"$name\",\"args\":\"$*\",\"cpu_ticks\":$((t1 - t0)),\"load\":\"$LOADAVG\",\"result\":$res}" >> "$OUT/results.jsonl"
  echo "round $ROUND $name $*: $res"
}

for ROUND in $(seq 1 "$ROUNDS"); do
  LOADAVG=$(uptime | sed 's/.*load average: //')
  echo "round $ROUND: load average $LOADAVG"
  run direct "$MOCK" ""       -       --rate "$RATE"
  run strata "$GW"   "$GW_KEY" $GW_PID --rate "$RATE"
  run strata "$GW"   "$GW_KEY" $GW_PID --concurrency "$CONC"
done

python3 - "$OUT/results.jsonl" "$TCK" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tck = float(sys.argv[2])
def med(xs): return statistics.median(xs), min(xs), max(xs)
def fmt(t, unit=""): return f"{t[0]:.3f}{unit} ({t[1]:.3f}–{t[2]:.3f})"
rate = [r for r in rows if r['args'].startswith('--rate')]
base = {r['round']: r['result'] for r in rate if r['name'] == 'direct'}
gw = [r for r in rate if r['name'] == 'strata']
p50 = [r['result']['p50_ms'] - base[r['round']]['p50_ms'] for r in gw]
p99 = [r['result']['p99_ms'] - base[r['round']]['p99_ms'] for r in gw]
print(f"{gw[0]['args']}: direct p50/p99 {fmt(med([b['p50_ms'] for b in base.values()]),' ms')} / {fmt(med([b['p99_ms'] for b in base.values()]),' ms')}")
print(f"{gw[0]['args']}: through the gateway p50/p99 {fmt(med([r['result']['p50_ms'] for r in gw]),' ms')} / {fmt(med([r['result']['p99_ms'] for r in gw]),' ms')}")
cpu_rate = [r['cpu_ticks'] / tck / max(1, r['result']['requests']) * 1e6 for r in gw]
print(f"{gw[0]['args']}: gateway CPU/request {fmt(med(cpu_rate),' us')}; load generator late sends p99 {fmt(med([r['result'].get('late_p99_ms') or 0 for r in rate]),' ms')}")
print(f"{gw[0]['args']}: gateway added p50 {fmt(med(p50),' ms')}, added p99 {fmt(med(p99),' ms')}, achieved {fmt(med([r['result']['rps'] for r in gw]),' req/s')}, errors {sum(r['result']['errors'] for r in gw)}")
mx = [r for r in rows if r['args'].startswith('--concurrency')]
cpu = [r['cpu_ticks'] / tck / max(1, r['result']['requests']) * 1e6 for r in mx]
print(f"{mx[0]['args']}: gateway max {fmt(med([r['result']['rps'] for r in mx]),' req/s')}, CPU/request {fmt(med(cpu),' us')}, errors {sum(r['result']['errors'] for r in mx)}")
print("load averages per round:", sorted({(r['round'], r['load']) for r in rows}))
PY
