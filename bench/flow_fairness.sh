#!/usr/bin/env bash
# Flow control's fairness benchmark (issue 31), in `strata sim`: a noisy tenant at 10x a
# quiet tenant's rate on a saturated pool. Four runs on the same seed:
#
#   alone       the quiet tenant alone, at its own rate (RATE / 11)
#   fcfs        both tenants, no flow control: every request in the replica's FCFS queue
#               (what the router amounted to before: a saturated pool's waiting requests were
#               let through unordered, and the engine's queue is first come, first served)
#   flow        both tenants, flow control with the default saturation thresholds
#               (queue_threshold 5: up to 5 requests may wait in an engine's own queue)
#   flow-q1     both tenants, flow control with queue_threshold 1 (the router keeps the
#               queue; at most one request waits inside the engine)
#
# Prints the quiet tenant's TTFT p50/p90 (and its p90 over `alone`), the noisy tenant's
# TTFT p90 and the throughput of each run, as a Markdown table. Times are virtual (the
# simulator's roofline model of the named hardware), so the build profile and the machine
# running it do not change the figures; reports land in target/flow-fairness/.
#
#   bench/flow_fairness.sh [RATE=30] [REQUESTS=1000]
#
# Environment: HARDWARE (h100), MODEL (llama-3.1-8b), SEQS (32: --max-num-seqs), SEED (11).
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-30}
REQUESTS=${2:-1000}
HARDWARE=${HARDWARE:-h100}
MODEL=${MODEL:-llama-3.1-8b}
SEQS=${SEQS:-32}
SEED=${SEED:-11}
OUT=target/flow-fairness
mkdir -p "$OUT"
# Requests wait as long as it takes: the figures are about order, not eviction.
printf 'flow_control: {default_ttl_ms: 3600000}\n' > "$OUT/flow.yaml"
printf 'flow_control: {default_ttl_ms: 3600000}\nsaturation: {queue_threshold: 1}\n' > "$OUT/flow-q1.yaml"
cargo build -q -p strata-sim --example sim
SIM=target/debug/examples/sim
COMMON=(--hardware "$HARDWARE" --model-profile "$MODEL" --workload random --input-len 512
  --output-len 128 --max-num-seqs "$SEQS" --seed "$SEED")
QUIET_RATE=$(python3 -c "print($RATE / 11)")
QUIET_REQUESTS=$(( (REQUESTS + 10) / 11 ))
run() {
  local name=$1
  shift
  "$SIM" sim "${COMMON[@]}" "$@" --label "$name" --output "$OUT/$name.json" > "$OUT/$name.txt"
}
run alone --rate "$QUIET_RATE" --requests "$QUIET_REQUESTS" --tenants quiet=1 \
  --flow-control --routing-config "$OUT/flow.yaml"
run fcfs --rate "$RATE" --requests "$REQUESTS" --tenants noisy=10,quiet=1 \
  --routing-config "$OUT/flow.yaml"
run flow --rate "$RATE" --requests "$REQUESTS" --tenants noisy=10,quiet=1 \
  --flow-control --routing-config "$OUT/flow.yaml"
run flow-q1 --rate "$RATE" --requests "$REQUESTS" --tenants noisy=10,quiet=1 \
  --flow-control --routing-config "$OUT/flow-q1.yaml"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def load(name):
    r = json.load(open(f"{out}/{name}.json"))
    t = {x["tenant"]: x for x in r["config"]["sim"]["tenants"]}
    return r, t
_, alone = load("alone")
base = alone["quiet"]["ttft_p90_s"]
print("| run | quiet TTFT p50 | quiet TTFT p90 | quiet p90 / alone | noisy TTFT p90 | completed | output tok/s |")
print("|---|---|---|---|---|---|---|")
for name in ["alone", "fcfs", "flow", "flow-q1"]:
    r, t = load(name)
    q, n = t["quiet"], t.get("noisy")
    ms = lambda s: "-" if s is None else f"{s * 1e3:.0f} ms"
    print(f"| {name} | {ms(q['ttft_p50_s'])} | {ms(q['ttft_p90_s'])} | "
          f"{q['ttft_p90_s'] / base:.1f}x | {ms(n['ttft_p90_s']) if n else '-'} | "
          f"{r['requests']['completed']} | {r['throughput']['output_tokens_per_s']:.0f} |")
PY
