#!/usr/bin/env bash
# Router CPU per request on the way in: the lean intake against the validating intake the
# router had before it, on 1 KB, 100 KB and 1 MB chat bodies, over HTTP and ext_proc, in one
# interleaved run (crates/router/benches/intake.rs says what one request covers). Prints a
# Markdown table of medians over rounds and the CPU it ran on; raw lines go to
# target/router-bench/intake.jsonl.
#
#   bench/router_intake.sh [ROUNDS=5] [MS_PER_CELL=300]
#
# Pinned to one core (BENCH_CPU, default 1) when taskset is there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
MS=${2:-300}
CPU=${BENCH_CPU:-1}
cargo bench -q -p strata-router --bench intake --no-run
BIN=$(ls -t target/release/deps/intake-* | grep -v '\.d$' | head -n 1)
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'); avx512f: $(grep -qw avx512f /proc/cpuinfo && echo yes || echo no); load: $(cut -d' ' -f1-3 /proc/loadavg)"
if command -v taskset >/dev/null; then
  taskset -c "$CPU" "$BIN" "$ROUNDS" "$MS"
else
  "$BIN" "$ROUNDS" "$MS"
fi
