#!/usr/bin/env bash
# Gateway overhead: Strata gateway vs LiteLLM proxy in front of the same fast mock backend,
# interleaved rounds on this machine. Writes raw JSON lines to target/gateway-bench/ and a
# summary (medians, min–max) to stdout.
#
#   bench/gateway_vs_litellm.sh [ROUNDS=3] [SECONDS=10]
#
# Needs: cargo, python3 (LiteLLM is installed with pip into target/litellm-venv on first run).
# Measures, per round: added latency p50/p99 at a fixed open-loop rate both proxies sustain
# (LOW_RATE, default 100 req/s) and at HIGH_RATE (default 2000 req/s, Strata only), max req/s
# with 64 concurrent closed-loop clients, CPU seconds per request of the proxy process, and
# RSS at idle.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${2:-10}
LOW_RATE=${LOW_RATE:-100}
HIGH_RATE=${HIGH_RATE:-2000}
CONC=${CONC:-64}
OUT=target/gateway-bench
mkdir -p "$OUT"
: > "$OUT/results.jsonl"

# SKIP_BUILD=1 reuses an existing binary (the build may wait on a shared target dir).
[ "${SKIP_BUILD:-0}" = 1 ] || cargo build -q --release -p strata-gateway --example gateway_bench
BIN=target/release/examples/gateway_bench
if [ ! -x target/litellm-venv/bin/litellm ]; then
  python3 -m venv target/litellm-venv
  target/litellm-venv/bin/pip install -q 'litellm[proxy]'
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 600); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done; echo "no answer from $1" >&2; return 1; }
rss_kb() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM

MOCK_PORT=$(free_port); GW_PORT=$(free_port); LL_PORT=$(free_port)
$BIN mock --port "$MOCK_PORT" 2>/dev/null & PIDS+=($!)
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
$BIN gateway --config "$OUT/gateway.yaml" --port "$GW_PORT" --db "$OUT/gateway.db" \
  --create-key-for bench > "$OUT/gateway.out" 2>"$OUT/gateway.err" & GW_PID=$!; PIDS+=($GW_PID)
wait_http "http://127.0.0.1:$GW_PORT/health"
GW_KEY=$(grep -o 'sk-strata-[0-9a-f-]*' "$OUT/gateway.out")

cat > "$OUT/litellm.yaml" <<YAML
model_list:
  - model_name: m
    litellm_params:
      model: openai/m
      api_base: http://127.0.0.1:$MOCK_PORT/v1
      api_key: unused
      rpm: 1000000000
general_settings:
  master_key: sk-litellm-bench-master
YAML
target/litellm-venv/bin/litellm --config "$OUT/litellm.yaml" --host 127.0.0.1 --port "$LL_PORT" --num_workers 1 \
  > "$OUT/litellm.log" 2>&1 & LL_PID=$!; PIDS+=($LL_PID)
wait_http "http://127.0.0.1:$LL_PORT/health/liveliness"
sleep 2
LL_KEY=sk-litellm-bench-master
# LiteLLM starts a child when run through its CLI wrapper; measure the process that listens.
LL_SRV=$(python3 - "$LL_PORT" <<'PY'
import os, sys
port = int(sys.argv[1]); inode = None
for line in open('/proc/net/tcp').readlines()[1:]:
    f = line.split()
    if int(f[1].split(':')[1], 16) == port and f[3] == '0A': inode = f[9]; break
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        for fd in os.listdir(f'/proc/{pid}/fd'):
            if os.readlink(f'/proc/{pid}/fd/{fd}') == f'socket:[{inode}]': print(pid); sys.exit()
    except OSError: pass
PY
)
echo "gateway pid $GW_PID (idle RSS $(rss_kb $GW_PID) kB), litellm server pid $LL_SRV (idle RSS $(rss_kb $LL_SRV) kB)"
echo "{\"kind\":\"idle_rss_kb\",\"strata\":$(rss_kb $GW_PID),\"litellm\":$(rss_kb $LL_SRV)}" >> "$OUT/results.jsonl"

run() { # name target_url key pid mode(args...)
  local name=$1 url=$2 key=$3 pid=$4; shift 4
  local t0 t1 res
  t0=$( [ "$pid" = - ] && echo 0 || cpu_ticks "$pid")
  res=$($BIN load --url "$url" --key "$key" --seconds "$SECS" "$@")
  t1=$( [ "$pid" = - ] && echo 0 || cpu_ticks "$pid")
  echo "{\"round\":$ROUND,\"name\":\"$name\",\"args\":\"$*\",\"cpu_ticks\":$((t1 - t0)),\"result\":$res}" >> "$OUT/results.jsonl"
  echo "round $ROUND $name $*: $res"
}

MOCK=http://127.0.0.1:$MOCK_PORT; GW=http://127.0.0.1:$GW_PORT; LL=http://127.0.0.1:$LL_PORT
for ROUND in $(seq 1 "$ROUNDS"); do
  run direct   "$MOCK" ""       -        --rate "$LOW_RATE"
  run strata   "$GW"   "$GW_KEY" $GW_PID --rate "$LOW_RATE"
  run litellm  "$LL"   "$LL_KEY" $LL_SRV --rate "$LOW_RATE"
  run direct   "$MOCK" ""       -        --rate "$HIGH_RATE"
  run strata   "$GW"   "$GW_KEY" $GW_PID --rate "$HIGH_RATE"
  run strata   "$GW"   "$GW_KEY" $GW_PID --concurrency "$CONC"
  run litellm  "$LL"   "$LL_KEY" $LL_SRV --concurrency "$CONC"
  run direct   "$MOCK" ""       -        --concurrency "$CONC"
done
echo "{\"kind\":\"after_rss_kb\",\"strata\":$(rss_kb $GW_PID),\"litellm\":$(rss_kb $LL_SRV)}" >> "$OUT/results.jsonl"

python3 - "$OUT/results.jsonl" "$(getconf CLK_TCK)" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tck = float(sys.argv[2])
def med(xs): return statistics.median(xs), min(xs), max(xs)
def fmt(t, unit=""): return f"{t[0]:.3f}{unit} ({t[1]:.3f}–{t[2]:.3f})"
runs = [r for r in rows if 'name' in r]
def pick(name, arg): return [r for r in runs if r['name'] == name and r['args'] == arg]
rounds = sorted({r['round'] for r in runs})
for arg in sorted({r['args'] for r in runs if r['args'].startswith('--rate')}):
    base = {r['round']: r['result'] for r in pick('direct', arg)}
    for name in ('strata', 'litellm'):
        rs = pick(name, arg)
        if not rs: continue
        p50 = [r['result']['p50_ms'] - base[r['round']]['p50_ms'] for r in rs]
        p99 = [r['result']['p99_ms'] - base[r['round']]['p99_ms'] for r in rs]
        err = sum(r['result']['errors'] for r in rs)
        cpu = [r['cpu_ticks'] / tck / max(1, r['result']['requests']) * 1e6 for r in rs]
        print(f"{arg}: {name}: added p50 {fmt(med(p50),' ms')}, added p99 {fmt(med(p99),' ms')}, CPU/request {fmt(med(cpu),' us')}, errors {err}")
arg = [r['args'] for r in runs if r['args'].startswith('--concurrency')][0]
rps = {}
for name in ('direct', 'strata', 'litellm'):
    rs = pick(name, arg)
    rps[name] = [r['result']['rps'] for r in rs]
    cpu = [r['cpu_ticks'] / tck / max(1, r['result']['requests']) * 1e6 for r in rs]
    print(f"{arg}: {name}: {fmt(med(rps[name]),' req/s')}, CPU/request {fmt(med(cpu),' us')}, errors {sum(r['result']['errors'] for r in rs)}")
ratios = [s / l for s, l in zip(rps['strata'], rps['litellm'])]
print(f"max req/s ratio strata/litellm per round: {fmt(med(ratios),'x')}")
for r in rows:
    if r.get('kind'): print(r)
PY
