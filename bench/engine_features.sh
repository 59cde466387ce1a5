#!/usr/bin/env bash
# Speculative decoding and structured outputs on the default model: engines started side by
# side on loopback ports, each workload run against each engine in turn (A, B, A, B ...)
# for several rounds, so that a machine shared with other work slows every side alike.
#
# Usage:
#   bench/engine_features.sh spec  [ROUNDS] [STREAMS...]   # without vs with --speculative-config
#   bench/engine_features.sh schema [ROUNDS] [STREAMS...]  # noschema vs schema on one engine
#
# Environment: STRATA (the binary, default target/release/strata), STRATA_B (a second
# binary whose engine with --speculative-config runs as a third side, e.g. an older build),
# SPEC (the --speculative-config JSON), PER_STREAM (requests per stream, default 2),
# WORKLOADS (spec mode; default "repetitive random novel").
# Prints one JSON line per run (bench/engine_features.py) with "side", "round", the engine's
# CPU seconds ("cpu_s") and output tokens per CPU second ("tok_per_cpu_s") added, and the
# load average before each round.
set -euo pipefail

mode=${1:?spec or schema}
rounds=${2:-3}
shift $(( $# >= 2 ? 2 : $# ))
streams=("$@")
[ ${#streams[@]} -gt 0 ] || streams=(1 16)
strata=${STRATA:-target/release/strata}
spec=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'}
per_stream=${PER_STREAM:-2}
here=$(cd "$(dirname "$0")" && pwd)

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

pids=()
out=$(mktemp)
cleanup() {
  rm -f "$out"
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

# start NAME BINARY ARGS... : starts an engine, sets URL_<NAME>.
start() {
  local name=$1 bin=$2
  shift 2
  local port
  port=$(free_port)
  "$bin" engine --host 127.0.0.1 --port "$port" --num-blocks 1024 \
    "$@" >"/tmp/engine_features_$name.log" 2>&1 &
  pids+=($!)
  printf -v "PID_$name" '%s' "$!"
  for _ in $(seq 1 240); do
    if python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; then
      printf -v "URL_$name" 'http://127.0.0.1:%s' "$port"
      return 0
    fi
    sleep 0.5
  done
  echo "engine $name did not start; see /tmp/engine_features_$name.log" >&2
  exit 1
}

# CPU seconds an engine process has used (user + system).
cpu_secs() {
  awk -v hz="$(getconf CLK_TCK)" '{printf "%.3f", ($14 + $15) / hz}' "/proc/$1/stat"
}

# Besides wall-clock tok/s, each run reports output tokens per CPU second of the engine
# process: on a machine shared with other work, waiting for a core inflates wall time but
# not CPU time, so this ratio is the steadier of the two (both sides do the same work).
run() { # SIDE ROUND URL WORKLOAD STREAMS PID
  local before after
  before=$(cpu_secs "$6")
  python3 "$here/engine_features.py" "$3" "$4" "$5" "$per_stream" >"$out"
  after=$(cpu_secs "$6")
  python3 -c "import json,sys; d=json.load(open('$out')); d['side']='$1'; d['round']=$2; d['cpu_s']=round($after-$before,2); d['tok_per_cpu_s']=round(d['output_tokens']/max($after-$before,1e-9),1); print(json.dumps(d))"
}

case $mode in
  spec)
    start plain "$strata"
    start spec "$strata" --speculative-config "$spec"
    sides=(plain spec)
    if [ -n "${STRATA_B:-}" ]; then
      start specb "$STRATA_B" --speculative-config "$spec"
      sides+=(specb)
    fi
    for r in $(seq 1 "$rounds"); do
      echo "# round $r, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
      for n in "${streams[@]}"; do
        for w in ${WORKLOADS:-repetitive random novel}; do
          for side in "${sides[@]}"; do
            url_var="URL_$side"
            pid_var="PID_$side"
            run "$side" "$r" "${!url_var}" "$w" "$n" "${!pid_var}"
          done
        done
      done
    done
    ;;
  schema)
    start plain "$strata"
    for r in $(seq 1 "$rounds"); do
      echo "# round $r, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
      for n in "${streams[@]}"; do
        for w in noschema schema; do
          run "$w" "$r" "$URL_plain" "$w" "$n" "$PID_plain"
        done
      done
    done
    ;;
  *)
    echo "unknown mode $mode (spec or schema)" >&2
    exit 2
    ;;
esac
