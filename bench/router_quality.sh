#!/usr/bin/env bash
# Routing quality on real Strata engines: 4 replicas of smollm2-135m-instruct with small KV
# caches (so that placement matters), the shared-prefix workload (BENCHMARKS.md) through the
# Strata router with its default cache-aware profile vs a round-robin profile, then the
# low-reuse control (short system prompts, long questions). Each run writes its own prompt
# prefixes, so engine caches warmed by one run never help another.
#
#   cargo build --release -p strata-cli && bench/router_quality.sh
#
# Knobs: BLOCKS (KV blocks per engine, default 96), NGROUPS (8), PER_GROUP (6), SYSTEM (400
# words), QUESTION (8 words), CONC (4), MAXTOK (8).
set -euo pipefail
cd "$(dirname "$0")/.."
BLOCKS=${BLOCKS:-96}; NGROUPS=${NGROUPS:-8}; PER_GROUP=${PER_GROUP:-6}
SYSTEM=${SYSTEM:-400}; QUESTION=${QUESTION:-8}; CONC=${CONC:-4}; MAXTOK=${MAXTOK:-8}
OUT=target/router-quality
mkdir -p "$OUT"; : > "$OUT/results.jsonl"
# The engine binary: `cargo build --release -p strata-cli` first (or set STRATA).
STRATA=${STRATA:-target/release/strata}
cargo build -q --release -p strata-router --example router_bench
BIN=target/release/examples/router_bench

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

run() { # policy workload system question
  local P; P=$(free_port)
  $BIN router --port "$P" --endpoints "$LIST" --config "$OUT/$1.yaml" > "$OUT/router-$1.log" 2>&1 & local RP=$!
  wait_http "http://127.0.0.1:$P/health"
  $BIN shared-prefix --url "http://127.0.0.1:$P" --groups "$NGROUPS" --per-group "$PER_GROUP" \
    --system-words "$3" --question-words "$4" --max-tokens "$MAXTOK" --conc "$CONC" --label "$2-$1" \
    | tee -a "$OUT/results.jsonl"
  kill "$RP"; wait "$RP" 2>/dev/null || true
}
run rr shared "$SYSTEM" "$QUESTION"
run default shared "$SYSTEM" "$QUESTION"
run rr control 8 "$SYSTEM"
run default control 8 "$SYSTEM"
