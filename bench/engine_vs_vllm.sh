#!/usr/bin/env bash
# Serving side by side: `strata engine` vs vLLM CPU vs llama.cpp's `llama-server`, on the same
# GGUF (vLLM serves the same weights dequantized, in bf16), under the same `strata bench` loads:
#
#   - random: 256-token token-id prompts, 128 output tokens, ignore_eos, at 1, 4, 16 and 64
#     streams (closed loop; as many requests as streams, at least 4);
#   - shared prefix: 4 groups × 6 questions, 1,000-token system prompts, 16-token questions,
#     16 output tokens, 4 streams.
#
# Each round starts each server once and runs every load against it, servers in turn
# (strata, vllm, llama, strata, vllm, llama ...). Reported per server and load: output tok/s,
# TTFT p50/p90, TPOT p50, ITL p99, and the server's peak RSS; then Strata's ratios. Medians
# over rounds with min-max. The load average is recorded with every run (shared machines).
#
#   bench/engine_vs_vllm.sh [ROUNDS]          (default 1)
#
# Environment: SKIP_BUILD=1 (use target/release/strata as built), SERVERS="strata vllm llama"
# (a subset), LEVELS="1 4 16 64", PEERS_DIR (where vLLM CPU is installed, see
# ../shared/peers/vllm-cpu/install.sh, which this script runs when vLLM is missing).
# STRATA_B=PATH adds a server `strata-b`: another strata binary (an earlier build, say) run
# with the same flags, for before/after comparisons in one run (SERVERS="strata strata-b").
# SUMMARY=FILE also writes the summary tables there. KV_CACHE_DTYPE=int8|fp8|f16 (default auto)
# sets Strata's `--kv-cache-dtype` (the KV memory budget stays the f16 one); vLLM's own
# is set through serve.sh's EXTRA_ARGS (EXTRA_ARGS="--kv-cache-dtype fp8").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUNDS="${1:-1}"
read -r -a SERVERS <<<"${SERVERS:-strata vllm llama}"
read -r -a LEVELS <<<"${LEVELS:-1 4 16 64}"
IN=256; OUT_LEN=128; NAME=smollm2-135m-instruct
PEERS="${PEERS_DIR:-$HOME/.cache/strata-peers}"
VLLM_PEER="$ROOT/../shared/peers/vllm-cpu"

[ -n "${SKIP_BUILD:-}" ] || cargo build --release --quiet -p strata-cli --bin strata
# STRATA_BIN: a copy of the binary to run (others' builds may replace target/release mid-run).
STRATA="${STRATA_BIN:-$ROOT/target/release/strata}"
MODEL="$("$STRATA" model pull 2>/dev/null | tail -n 1)"
for s in "${SERVERS[@]}"; do
    case "$s" in
        llama) tools/llamacpp/build.sh >/dev/null ;;
        vllm) [ -x "$PEERS/vllm-cpu/venv/bin/vllm" ] || bash "$VLLM_PEER/install.sh" "$STRATA" ;;
    esac
done
LLAMA="$ROOT/target/llama.cpp/bin/llama-server"

OUT="$(mktemp -d)"
trap 'kill $(cat "$OUT/pids" 2>/dev/null) 2>/dev/null || true; rm -rf "$OUT"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { # port pid
    for _ in $(seq 1800); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}
hwm_mib() { # the largest VmHWM of the process and its children (vLLM runs its model in one)
    local m=0 v p
    for p in $1 $(pgrep -P "$1" 2>/dev/null); do
        v=$(awk '/VmHWM/ {printf "%.0f", $2/1024}' "/proc/$p/status" 2>/dev/null || echo 0)
        [ "${v:-0}" -gt "$m" ] && m=$v
    done
    echo "$m"
}
load_avg() { cut -d' ' -f1-3 /proc/loadavg; }

# KV for 64 streams of IN+OUT tokens, or 4 of the shared-prefix load, with headroom.
KV_TOKENS=$(( 64 * (IN + OUT_LEN + 64) ))
start() { # server -> "pid port"
    local port; port=$(free_port)
    case "$1" in
        strata|strata-b)
            local bin="$STRATA"; [ "$1" = strata-b ] && bin="${STRATA_B:?STRATA_B is not set}"
            "$bin" engine --port "$port" --model "$MODEL" --served-model-name "$NAME" \
                --max-num-seqs 64 --kv-cache-memory $(( KV_TOKENS * 30 * 3 * 64 * 2 * 2 )) \
                --kv-cache-dtype "${KV_CACHE_DTYPE:-auto}" --log-format json 2>"$OUT/$1.log" & ;;
        vllm)
            bash "$VLLM_PEER/serve.sh" "$port" >"$OUT/vllm.log" 2>&1 & ;;
        llama)
            "$LLAMA" -m "$MODEL" --host 127.0.0.1 --port "$port" -np 64 -c $(( 64 * 1100 )) \
                -t "$(nproc)" --no-webui -a "$NAME" >"$OUT/llama.log" 2>&1 & ;;
    esac
    echo "$!" >>"$OUT/pids"
    echo "$! $port"
}
stop() { # pid
    kill -INT "$1" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.2; done
    pkill -KILL -P "$1" 2>/dev/null || true; kill -KILL "$1" 2>/dev/null || true
}
bench() { # server port label args...
    local server=$1 port=$2 label=$3; shift 3
    local extra=()
    [ "$server" = llama ] && extra=(--no-keepalive)  # see ../shared/design/BENCHMARKS.md
    echo "$label load=$(load_avg)" >>"$OUT/loadavg.txt"
    "$STRATA" bench --url "http://127.0.0.1:$port" --model "$NAME" --prompt-token-ids \
        --seed 7 -q --label "$label" --output "$OUT/$label.json" "${extra[@]}" "$@" >/dev/null
}

for r in $(seq "$ROUNDS"); do
    for s in "${SERVERS[@]}"; do
        read -r pid port < <(start "$s")
        if ! wait_ready "$port" "$pid"; then
            echo "$s did not start; its log:" >&2; tail -20 "$OUT/$s.log" >&2; exit 1
        fi
        # One warm-up request outside the measurements.
        bench "$s" "$port" "warm-$s-r$r" --workload random --input-len $IN --output-len 8 \
            --concurrency 1 --requests 2
        for c in "${LEVELS[@]}"; do
            n=$(( c < 4 ? 4 : c ))
            bench "$s" "$port" "$s-c$c-r$r" --workload random --input-len $IN \
                --output-len $OUT_LEN --concurrency "$c" --requests "$n"
        done
        bench "$s" "$port" "$s-prefix-r$r" --workload shared-prefix --groups 4 \
            --prompts-per-group 6 --system-len 1000 --question-len 16 --output-len 16 \
            --concurrency 4 --requests 24
        echo "$s r=$r hwm_mib=$(hwm_mib "$pid")" >>"$OUT/rss.txt"
        stop "$pid"
    done
done

python3 - "$OUT" "$ROUNDS" "${SERVERS[*]}" "${LEVELS[*]}" <<'PY' | tee "${SUMMARY:-/dev/null}"
import json, pathlib, statistics, sys
out, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
servers, levels = sys.argv[3].split(), sys.argv[4].split()
loads = [f"c{c}" for c in levels] + ["prefix"]
def rep(label):
    return json.loads((out / f"{label}.json").read_text())
def lat(r, metric, q):
    v = (r.get("latency_ms") or r.get("latency") or {}).get(metric) or {}
    return v.get(q, float("nan"))
def vals(s, load, f):
    return [f(rep(f"{s}-{load}-r{i}")) for i in range(1, rounds + 1)]
med = lambda v: statistics.median(v)
fmt = lambda v: f"{med(v):.1f}" + (f" ({min(v):.1f}-{max(v):.1f})" if len(v) > 1 else "")
tps = lambda r: r["throughput"]["output_tokens_per_s"]
print("| load | server | output tok/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | ITL p99 ms |")
print("|---|---|---|---|---|---|---|")
for load in loads:
    for s in servers:
        print(f"| {load} | {s} | {fmt(vals(s, load, tps))} | {fmt(vals(s, load, lambda r: lat(r, 'ttft', 'p50')))} "
              f"| {fmt(vals(s, load, lambda r: lat(r, 'ttft', 'p90')))} | {fmt(vals(s, load, lambda r: lat(r, 'tpot', 'p50')))} "
              f"| {fmt(vals(s, load, lambda r: lat(r, 'itl', 'p99')))} |")
if "strata" in servers:
    print()
    print("| load | " + " | ".join(f"strata ÷ {p} tok/s" for p in servers if p != "strata")
          + " | " + " | ".join(f"strata ÷ {p} ITL p99" for p in servers if p != "strata") + " |")
    print("|---|" + "---|" * (2 * (len(servers) - 1)))
    for load in loads:
        cells = [f"{med(vals('strata', load, tps)) / med(vals(p, load, tps)):.2f}" for p in servers if p != "strata"]
        cells += [f"{med(vals('strata', load, lambda r: lat(r, 'itl', 'p99'))) / med(vals(p, load, lambda r: lat(r, 'itl', 'p99'))):.2f}"
                  for p in servers if p != "strata"]
        print(f"| {load} | " + " | ".join(cells) + " |")
    one = med(vals("strata", "c1", tps)) if "1" in levels else None
    if one and "16" in levels:
        print(f"\nstrata 16-stream ÷ 1-stream output tok/s: {med(vals('strata', 'c16', tps)) / one:.2f}")
print()
print((out / "rss.txt").read_text().strip())
print((out / "loadavg.txt").read_text().strip())
PY
