#!/usr/bin/env bash
# Routing quality on real Strata engines: 4 replicas of smollm2-135m-instruct with small KV
# caches (so that placement matters), the shared-prefix workload (BENCHMARKS.md: groups of
# questions behind one long system prompt, sent in shuffled order) through
#   - the Strata router, round-robin profile,
#   - the Strata router, default profile (queue 2, KV 2, prefix 3),
#   - sglang-router's `cache_aware` policy (PyPI `sglang-router`, installed into
#     target/router-bench-venv on first run),
# then the low-reuse control (short system prompts, long questions) through the same three.
# The load is `strata bench` (closed loop, CONC users). Each run uses its own seed, so its
# prompts share no prefix with another run's and warm caches never help.
#
#   cargo build --release -p strata-cli && bench/router_quality.sh
#
# Knobs: BLOCKS (KV blocks per engine, default 96), NGROUPS (8), PER_GROUP (12), SYSTEM (400
# tokens), QUESTION (16 tokens), CONC (4), MAXTOK (8), SGLANG (1; 0 skips sglang-router),
# SKIP_BUILD=1 reuses target/release/examples/router_bench.
set -euo pipefail
cd "$(dirname "$0")/.."
BLOCKS=${BLOCKS:-96}; NGROUPS=${NGROUPS:-8}; PER_GROUP=${PER_GROUP:-12}
SYSTEM=${SYSTEM:-400}; QUESTION=${QUESTION:-16}; CONC=${CONC:-4}; MAXTOK=${MAXTOK:-8}
SGLANG=${SGLANG:-1}
OUT=target/router-quality
mkdir -p "$OUT"; : > "$OUT/results.jsonl"
STRATA=${STRATA:-target/release/strata}
[ "${SKIP_BUILD:-0}" = 1 ] || cargo build -q --release -p strata-router --example router_bench
BIN=target/release/examples/router_bench
VENV=target/router-bench-venv
if [ "$SGLANG" = 1 ] && [ ! -x "$VENV/bin/sglang-router" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q sglang-router
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 1200); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "no answer from $1" >&2; return 1; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

EPS=()
for i in 1 2 3 4; do
  P=$(free_port)
  $STRATA engine --model smollm2-135m-instruct --served-model-name m --port "$P" --num-blocks "$BLOCKS" \
    > "$OUT/engine$i.log" 2>&1 & PIDS+=($!)
  EPS+=("http://127.0.0.1:$P")
done
for e in "${EPS[@]}"; do wait_http "$e/health"; done
LIST=$(IFS=,; echo "${EPS[*]}")

cat > "$OUT/rr.yaml" <<YAML
scheduling:
  plugins: [{type: round-robin-scorer}]
  schedulingProfiles: [{name: rr, plugins: [{pluginRef: round-robin-scorer}]}]
YAML
: > "$OUT/default.yaml"

SEED=1000
run() { # policy workload system-tokens question-tokens
  local P RP; P=$(free_port)
  if [ "$1" = sglang ]; then
    "$VENV/bin/sglang-router" launch --host 127.0.0.1 --port "$P" --worker-urls "${EPS[@]}" \
      --policy cache_aware --log-level error --prometheus-port "$(free_port)" > "$OUT/router-$1.log" 2>&1 & RP=$!
    wait_http "http://127.0.0.1:$P/v1/models"
  else
    $BIN router --port "$P" --endpoints "$LIST" --config "$OUT/$1.yaml" > "$OUT/router-$1.log" 2>&1 & RP=$!
    wait_http "http://127.0.0.1:$P/health"
  fi
  SEED=$((SEED + 1))
  echo "== $2 $1 (load: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  $STRATA bench --url "http://127.0.0.1:$P" --model m --workload shared-prefix \
    --groups "$NGROUPS" --prompts-per-group "$PER_GROUP" --system-len "$3" --question-len "$4" \
    --output-len "$MAXTOK" --concurrency "$CONC" --requests $((NGROUPS * PER_GROUP)) \
    --seed "$SEED" --label "$2-$1" --quiet --output "$OUT/$2-$1.json" > /dev/null
  python3 - "$OUT/$2-$1.json" <<'PY' | tee -a "$OUT/results.jsonl"
import json, sys
r = json.load(open(sys.argv[1]))
t = r["latency_ms"]["ttft"] or {}
print(json.dumps({"label": r["label"], "requests": r["requests"]["sent"],
                  "failed": r["requests"]["failed"],
                  "ttft_p50_s": round(t.get("p50", float("nan")) / 1000, 3),
                  "ttft_p90_s": round(t.get("p90", float("nan")) / 1000, 3),
                  "output_tok_s": round(r["throughput"]["output_tokens_per_s"], 3),
                  "prefix_hit_rate": r["tokens"].get("prefix_cache_hit_rate"),
                  "wall_s": round(r["duration_s"], 1)}))
PY
  kill "$RP"; wait "$RP" 2>/dev/null || true
}
POLICIES="rr default"
[ "$SGLANG" = 1 ] && POLICIES="$POLICIES sglang"
for p in $POLICIES; do run "$p" shared "$SYSTEM" "$QUESTION"; done
for p in $POLICIES; do run "$p" control 8 "$SYSTEM"; done
