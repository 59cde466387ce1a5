#!/usr/bin/env bash
# Serving throughput, prefix-cache TTFT and memory: `strata engine` vs llama.cpp's
# `llama-server` on the same GGUF, same machine, same number of parallel slots, driven by
# `strata bench` (random token-id prompts, ignore_eos). Rounds are interleaved
# (strata, llama, strata, llama ...); medians with min-max are printed as a Markdown table.
#
#   bench/engine_vs_llamaserver.sh [ROUNDS] [CONCURRENCY ...]     (default: 1 round, 16 64)
#
# Needs: tools/llamacpp/build.sh (builds llama-server), python3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUNDS="${1:-1}"; shift || true
LEVELS=("${@:-16 64}"); read -r -a LEVELS <<<"${LEVELS[*]}"
IN=512; OUT_LEN=128; THREADS="$(nproc)"

tools/llamacpp/build.sh >/dev/null
[ -n "${SKIP_BUILD:-}" ] || cargo build --release --quiet -p strata-cli --bin strata
STRATA=target/release/strata
LLAMA=target/llama.cpp/bin/llama-server
MODEL="$("$STRATA" model pull 2>/dev/null)"
NAME=smollm2-135m-instruct
OUT="$(mktemp -d)"
# Servers start inside command substitutions, so they are not jobs of this shell: their pids
# are kept in a file for the exit trap.
trap 'kill $(cat "$OUT/pids" 2>/dev/null) 2>/dev/null || true; rm -rf "$OUT"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.2; done; return 1; }
hwm_mib() { awk '/VmHWM/ {printf "%.0f", $2/1024}' "/proc/$1/status"; }

start_strata() { # slots kv_bytes
    local port; port=$(free_port)
    "$STRATA" engine --port "$port" --model "$MODEL" --served-model-name "$NAME" \
        --max-num-seqs "$1" --kv-cache-memory "$2" --log-format json 2>"$OUT/strata.log" &
    echo "$!" >>"$OUT/pids"
    echo "$! $port"
}
start_llama() { # slots
    local port; port=$(free_port)
    "$LLAMA" -m "$MODEL" --host 127.0.0.1 --port "$port" -np "$1" -c $(( $1 * (IN + OUT_LEN + 64) )) \
        -t "$THREADS" --no-webui -a "$NAME" >"$OUT/llama.log" 2>&1 &
    echo "$!" >>"$OUT/pids"
    echo "$! $port"
}
load() { # port concurrency label extra...
    local port=$1 c=$2 label=$3; shift 3
    "$STRATA" bench --url "http://127.0.0.1:$port" --model "$NAME" --workload random \
        --input-len $IN --output-len $OUT_LEN --prompt-token-ids \
        --concurrency "$c" --requests "$c" --warmup 1 --seed 7 -q --label "$label" \
        --output "$OUT/$label.json" "$@" >/dev/null
}

for c in "${LEVELS[@]}"; do
    # KV for c sequences of IN+OUT tokens (30 layers, 3 KV heads of 64, keys and values,
    # f16 entries as both servers keep them by default), with 10% headroom.
    kv=$(( c * (IN + OUT_LEN) * 30 * 3 * 64 * 2 * 2 * 11 / 10 ))
    for r in $(seq "$ROUNDS"); do
        read -r pid port < <(start_strata "$c" "$kv"); wait_ready "$port"
        load "$port" "$c" "strata-c$c-r$r"
        echo "strata c=$c r=$r hwm_mib=$(hwm_mib "$pid")" >>"$OUT/rss.txt"
        { grep -o "\"kv_cache_bytes\":[0-9]*" "$OUT/strata.log" | head -1 | sed "s/^/strata c=$c kv_flag=$kv /" >>"$OUT/kv.txt"; } || true
        kill -INT "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
        read -r pid port < <(start_llama "$c"); wait_ready "$port"
        load "$port" "$c" "llama-c$c-r$r" --no-keepalive
        echo "llama c=$c r=$r hwm_mib=$(hwm_mib "$pid")" >>"$OUT/rss.txt"
        kill "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    done
done

# Cached-prefix TTFT: a 1,000-token prefix cold, then again (cached) with a new 16-token tail.
read -r pid port < <(start_strata 16 $((1 << 30))); wait_ready "$port"
python3 - "$port" "$NAME" "$OUT/ttft.txt" <<'PY'
import http.client, json, random, statistics, sys, time
port, name, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def ttft(ids):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": name, "prompt": ids, "max_tokens": 1, "ignore_eos": True})
    t = time.perf_counter(); c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse(); r.read(); assert r.status == 200, r.status
    return time.perf_counter() - t
rng = random.Random(3); cold, warm = [], []
ttft([rng.randrange(1000, 40000) for _ in range(64)])  # warm-up
for _ in range(5):
    prefix = [rng.randrange(1000, 40000) for _ in range(1000)]
    cold.append(ttft(prefix + [rng.randrange(1000, 40000) for _ in range(16)]))
    warm.append(ttft(prefix + [rng.randrange(1000, 40000) for _ in range(16)]))
c, w = statistics.median(cold), statistics.median(warm)
open(out, "w").write(f"uncached {c*1000:.0f} ms ({min(cold)*1000:.0f}-{max(cold)*1000:.0f}), "
                      f"cached {w*1000:.0f} ms ({min(warm)*1000:.0f}-{max(warm)*1000:.0f}), ratio {w/c:.3f}\n")
PY
kill -INT "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done

python3 - "$OUT" "$ROUNDS" "${LEVELS[@]}" <<'PY'
import json, pathlib, statistics, sys
out, rounds, levels = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def tps(label):
    r = json.loads((out / f"{label}.json").read_text())
    return r["throughput"]["output_tokens_per_s"]
fmt = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
print(f"| streams | strata output tok/s | llama-server output tok/s | ratio |\n|---|---|---|---|")
for c in levels:
    s = [tps(f"strata-c{c}-r{r}") for r in range(1, rounds + 1)]
    l = [tps(f"llama-c{c}-r{r}") for r in range(1, rounds + 1)]
    print(f"| {c} | {fmt(s)} | {fmt(l)} | {statistics.median(s)/statistics.median(l):.2f} |")
print(); print((out / "ttft.txt").read_text().strip())
print((out / "kv.txt").read_text().strip()); print((out / "rss.txt").read_text().strip())
PY
