#!/usr/bin/env bash
# Router overhead: Strata router vs sglang-router vs vllm-router (PyPI) in front of the same
# two fast mock backends (strata-mock: model `m`, 8 tokens, no delays), interleaved rounds
# on this machine. Writes raw JSON lines to target/router-bench/results.jsonl and a summary
# (medians over rounds) to stdout.
#
#   bench/router_overhead.sh [ROUNDS=3] [SECONDS=10]
#
# Per round and target (direct-to-mock baseline, strata, sglang, vllm):
#   - latency p50/p99 at a fixed open-loop rate (RATE, default 2000 req/s): added latency is
#     target minus direct;
#   - max req/s with CONC (default 64) closed-loop clients;
#   - the proxy's CPU seconds per request during the max run (from /proc/PID/stat).
# Each router is pinned to one core (ROUTER_CPU, default 1) so they compete at equal CPU;
# the load generator and mocks run on the other cores (LOAD_CPUS, default 0).
# Policies: each router's cache-aware default (Strata: queue 2, KV 2, approximate prefix 3;
# sglang-router and vllm-router: --policy cache_aware).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${2:-10}
RATE=${RATE:-2000}
CONC=${CONC:-64}
ROUTER_CPU=${ROUTER_CPU:-1}
LOAD_CPUS=${LOAD_CPUS:-0}
OUT=target/router-bench
VENV=target/router-bench-venv
mkdir -p "$OUT"
: > "$OUT/results.jsonl"

cargo build -q --release -p strata-router --example router_bench
BIN=target/release/examples/router_bench
if [ ! -x "$VENV/bin/sglang-router" ] || [ ! -x "$VENV/bin/vllm-router" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q sglang-router vllm-router
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 600); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "no answer from $1" >&2; return 1; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TCK=$(getconf CLK_TCK)

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

M1=$(free_port); M2=$(free_port)
taskset -c "$LOAD_CPUS" $BIN mock --ports "$M1,$M2" 2>/dev/null & PIDS+=($!)
wait_http "http://127.0.0.1:$M1/health"; wait_http "http://127.0.0.1:$M2/health"
W1=http://127.0.0.1:$M1; W2=http://127.0.0.1:$M2

declare -A URL PID
URL[direct]=$W1

P=$(free_port)
taskset -c "$ROUTER_CPU" $BIN router --port "$P" --endpoints "$W1,$W2" > "$OUT/strata.log" 2>&1 & PID[strata]=$!; PIDS+=(${PID[strata]})
URL[strata]=http://127.0.0.1:$P

P=$(free_port)
taskset -c "$ROUTER_CPU" "$VENV/bin/sglang-router" launch --host 127.0.0.1 --port "$P" --worker-urls "$W1" "$W2" \
  --policy cache_aware --log-level error --prometheus-port "$(free_port)" > "$OUT/sglang.log" 2>&1 & PID[sglang]=$!; PIDS+=(${PID[sglang]})
URL[sglang]=http://127.0.0.1:$P

P=$(free_port)
taskset -c "$ROUTER_CPU" "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$P" --worker-urls "$W1" "$W2" \
  --policy cache_aware --log-level error --prometheus-port "$(free_port)" > "$OUT/vllm.log" 2>&1 & PID[vllm]=$!; PIDS+=(${PID[vllm]})
URL[vllm]=http://127.0.0.1:$P

TARGETS=(direct)
for t in strata sglang vllm; do
  # A router that cannot serve a chat completion is reported and left out.
  ok=0
  for _ in $(seq 1 300); do
    if curl -sf -o /dev/null -H 'content-type: application/json' \
      -d '{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}' \
      "${URL[$t]}/v1/chat/completions"; then ok=1; break; fi
    sleep 0.1
  done
  if [ $ok = 1 ]; then TARGETS+=("$t"); else echo "warning: $t never served a request (see $OUT/$t.log)" >&2; fi
done

for r in $(seq 1 "$ROUNDS"); do
  for t in "${TARGETS[@]}"; do
    line=$(taskset -c "$LOAD_CPUS" $BIN load --url "${URL[$t]}" --rate "$RATE" --secs "$SECS" --label "$t")
    echo "{\"round\":$r,\"run\":\"rate\",${line#\{}" >> "$OUT/results.jsonl"
    before=0; [ "$t" != direct ] && before=$(cpu_ticks "${PID[$t]}")
    line=$(taskset -c "$LOAD_CPUS" $BIN load --url "${URL[$t]}" --conc "$CONC" --secs "$SECS" --label "$t")
    cpu=0; [ "$t" != direct ] && cpu=$(( $(cpu_ticks "${PID[$t]}") - before ))
    echo "{\"round\":$r,\"run\":\"max\",\"cpu_s\":$(printf '%.3f' "$(echo "$cpu / $TCK" | bc -l)"),${line#\{}" >> "$OUT/results.jsonl"
  done
done

python3 - "$OUT/results.jsonl" <<'PY'
# Summary: medians over rounds. Errors are summed; a target with errors is not comparable.
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(t, run, key):
    v = [r[key] for r in rows if r["label"] == t and r["run"] == run and r[key] is not None]
    return statistics.median(v) if v else float("nan")
targets = [t for t in ["direct", "strata", "sglang", "vllm"] if any(r["label"] == t for r in rows)]
d50, d99 = med("direct", "rate", "p50_ms"), med("direct", "rate", "p99_ms")
print(f"{'target':8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} {'max rps':>9} {'cpu us/req':>10} {'errors':>6}")
for t in targets:
    p50, p99 = med(t, "rate", "p50_ms"), med(t, "rate", "p99_ms")
    rps = med(t, "max", "rps")
    cpu = [r["cpu_s"] / max(r["ok"], 1) * 1e6 for r in rows if r["label"] == t and r["run"] == "max"]
    err = sum(r["errors"] for r in rows if r["label"] == t)
    print(f"{t:8} {p50:8.3f} {p99:8.3f} {p50-d50:8.3f} {p99-d99:8.3f} {rps:9.0f} {statistics.median(cpu) if t != 'direct' else 0:10.1f} {err:6d}")
s = med("strata", "max", "rps")
for peer in ["sglang", "vllm"]:
    p = med(peer, "max", "rps")
    if peer in targets and p > 0:
        print(f"strata/{peer} max req/s ratio: {s / p:.2f}")
    elif peer in targets:
        print(f"{peer}: no successful requests in the max run (see target/router-bench/{peer}.log)")
PY
