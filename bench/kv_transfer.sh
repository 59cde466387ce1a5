#!/usr/bin/env bash
# KV blocks that move between engines (issue 21): what a transfer costs against recomputing.
#
#   (p) the protocol alone: a 1,000-token prefix of the default model (62 blocks of 368,640
#       bytes) put to a `strata kv-tier` process and pulled back over loopback, per block and
#       per prefix, on a warm and on a fresh connection (examples/kv_transfer_bench.rs);
#   (a) through engines: a prefill engine computes a 1,000-token prompt (phase 1, as vLLM's
#       proxy drives it: `kv_transfer_params.do_remote_decode`), a decode engine pulls its
#       blocks and answers (phase 2); against the decode engine computing a prompt of the
#       same length itself. Reported: the decode engine's TTFT both ways, its pull time
#       (`strata:kv_transfer_seconds`) per prefix and per block, and phase 1's time;
#   (b) through the tier: replica A computes a 1,000-token prefix, two filler prompts push it
#       out of A's small KV cache into the tier, then replica B answers the prefix with a new
#       question: TTFT on B against B computing a prompt of the same length (target <= 0.3x);
#   (c) disaggregated (1 prefill + 1 decode engine behind `strata router --pd-threshold`)
#       against colocated (2 engines behind `strata router`), ITL p99 and TTFT under the
#       shared-prefix load of bench/engine_vs_vllm.sh (4 groups x 6 questions, 1,000-token
#       system prompts), output 32 tokens.
#
# Every pair is interleaved (A, B, A, B ...; the order flips each round) and the load average
# is recorded with each section: all processes share this machine's cores, so figures taken
# while others compile are noisy.
#
#   bench/kv_transfer.sh [ROUNDS]     (default 5 for p/a/b; (c) runs ROUNDS_C, default 2)
#
# Environment: SKIP_BUILD=1 (use target/release/strata and the example as built),
# SECTIONS="p a b c" (a subset).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUNDS="${1:-5}"
ROUNDS_C="${ROUNDS_C:-2}"
read -r -a SECTIONS <<<"${SECTIONS:-p a b c}"
NAME=smollm2-135m-instruct

if [ -z "${SKIP_BUILD:-}" ]; then
    cargo build --release --quiet -p strata-cli --bin strata
    cargo build --release --quiet -p strata-engine --example kv_transfer_bench
fi
STRATA="$ROOT/target/release/strata"
PROTO="$ROOT/target/release/examples/kv_transfer_bench"
MODEL="$("$STRATA" model pull 2>/dev/null | tail -n 1)"

OUT="$(mktemp -d)"
trap 'for p in $(cat "$OUT/pids" 2>/dev/null); do kill "$p" 2>/dev/null || true; done; rm -rf "$OUT"' EXIT
touch "$OUT/pids"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { # port pid
    for _ in $(seq 1800); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}
wait_port() { # port pid: a plain TCP listener (the tier)
    for _ in $(seq 300); do
        python3 -c "import socket,sys; socket.create_connection(('127.0.0.1',$1),1)" 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}
load_avg() { cut -d' ' -f1-3 /proc/loadavg; }
stop() { # pid
    kill -INT "$1" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.2; done
    kill -KILL "$1" 2>/dev/null || true
}
# engine LOGNAME PORT extra-args... -> pid (started, ready)
engine() {
    local log=$1 port=$2; shift 2
    "$STRATA" engine --port "$port" --model "$MODEL" --served-model-name "$NAME" \
        --log-format json "$@" >"$OUT/$log.out" 2>"$OUT/$log.log" &
    local pid=$!
    echo "$pid" >>"$OUT/pids"
    if ! wait_ready "$port" "$pid"; then
        echo "engine $log did not start; its log:" >&2; tail -20 "$OUT/$log.log" >&2; exit 1
    fi
    echo "$pid"
}
tier() { # port -> pid
    "$STRATA" kv-tier --listen "127.0.0.1:$1" --memory-bytes 1GiB >"$OUT/tier.out" 2>"$OUT/tier.log" &
    local pid=$!
    echo "$pid" >>"$OUT/pids"
    wait_port "$1" "$pid" || { echo "kv-tier did not start" >&2; cat "$OUT/tier.log" >&2; exit 1; }
    echo "$pid"
}
has() { local s; for s in "${SECTIONS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

# The HTTP driver for (a) and (b): streamed completions on token-id prompts, TTFT as the
# time to the first SSE data line, and the engines' /metrics.
cat >"$OUT/drive.py" <<'PY'
import http.client, json, random, statistics, sys, time

def call(port, body, headers=None, stream=False):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    h = {"content-type": "application/json", **(headers or {})}
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), h)
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"port {port}: HTTP {r.status}: {r.read()[:400]!r}")
    if not stream:
        out = json.loads(r.read())
        c.close()
        return out, (time.perf_counter() - t0) * 1e3
    first = None
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            if line.strip() == b"data: [DONE]":
                break
            if first is None:
                first = time.perf_counter()
    c.close()
    return None, (first - t0) * 1e3

def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out

def metric(m, name, has=""):
    return sum(v for k, v in m.items() if k.split("{")[0] == name and has in k)

rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 7)
def tokens(n):
    return [rng.randrange(100, 40000) for _ in range(n)]

def body(prompt, max_tokens=1):
    return {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0}

def med(v):
    return statistics.median(v)

mode = sys.argv[1]
rounds = int(sys.argv[2])
if mode == "remote":
    p_port, d_port = int(sys.argv[4]), int(sys.argv[5])
    call(d_port, body(tokens(64)))  # warm-up, outside the measurements
    call(p_port, body(tokens(64)))
    remote, local, phase1, pull = [], [], [], []
    blocks = 0
    for r in range(rounds):
        def remote_once():
            prompt = tokens(1000)
            params = {"do_remote_decode": True, "do_remote_prefill": False,
                      "remote_engine_id": None, "remote_block_ids": None,
                      "remote_host": None, "remote_port": None}
            ans, t1 = call(p_port, {**body(prompt), "kv_transfer_params": params},
                           {"x-request-id": f"kvx-bench-{sys.argv[3]}-{r}"})
            kv = ans.get("kv_transfer_params")
            if not kv or not kv.get("remote_port"):
                raise SystemExit(f"phase 1 answered without kv_transfer_params: {ans}")
            before = metrics(d_port)
            _, t = call(d_port, {**body(prompt), "kv_transfer_params": kv, "stream": True},
                        stream=True)
            after = metrics(d_port)
            n = metric(after, "strata:kv_transfer_seconds_count") - metric(before, "strata:kv_transfer_seconds_count")
            s = metric(after, "strata:kv_transfer_seconds_sum") - metric(before, "strata:kv_transfer_seconds_sum")
            b = metric(after, "strata:kv_transfer_blocks_total", 'direction="received"') - \
                metric(before, "strata:kv_transfer_blocks_total", 'direction="received"')
            if n < 1 or b < 1:
                raise SystemExit(f"the decode engine pulled nothing (transfers {n}, blocks {b})")
            phase1.append(t1); remote.append(t); pull.append(s * 1e3 / n)
            return b
        def local_once():
            _, t = call(d_port, {**body(tokens(1000)), "stream": True}, stream=True)
            local.append(t)
        if r % 2 == 0:
            blocks = remote_once(); local_once()
        else:
            local_once(); blocks = remote_once()
    print(json.dumps({"rounds": rounds, "blocks_per_prefix": blocks,
        "decode_ttft_remote_ms": med(remote), "decode_ttft_recompute_ms": med(local),
        "ratio": med(remote) / med(local), "pull_ms_per_prefix": med(pull),
        "pull_ms_per_block": med(pull) / max(blocks, 1), "phase1_ms": med(phase1),
        "remote_all": remote, "recompute_all": local}))
elif mode == "tier":
    a_port, b_port = int(sys.argv[4]), int(sys.argv[5])
    call(a_port, body(tokens(64)))
    call(b_port, body(tokens(64)))
    via_tier, local, hits = [], [], 0
    for r in range(rounds):
        prefix = tokens(1000)
        def tier_once():
            global hits
            call(a_port, body(prefix + tokens(16)))
            for _ in range(2):  # push the prefix out of A's cache, into the tier
                call(a_port, body(tokens(1016)))
            time.sleep(0.5)
            before = metric(metrics(b_port), "strata:kv_transfer_requests_total", 'path="tier"')
            _, t = call(b_port, {**body(prefix + tokens(16)), "stream": True}, stream=True)
            after = metric(metrics(b_port), "strata:kv_transfer_requests_total", 'path="tier"')
            hits += int(after - before)
            via_tier.append(t)
        def local_once():
            _, t = call(b_port, {**body(tokens(1016)), "stream": True}, stream=True)
            local.append(t)
        if r % 2 == 0:
            tier_once(); local_once()
        else:
            local_once(); tier_once()
    print(json.dumps({"rounds": rounds, "served_from_tier": hits,
        "ttft_tier_ms": med(via_tier), "ttft_recompute_ms": med(local),
        "ratio": med(via_tier) / med(local), "tier_all": via_tier, "recompute_all": local}))
PY

if has p; then
    echo "== (p) protocol: load $(load_avg)" | tee -a "$OUT/results.txt"
    tport=$(free_port); tpid=$(tier "$tport")
    "$PROTO" --addr "127.0.0.1:$tport" --tokens 1000 --rounds $(( ROUNDS * 6 )) | tee -a "$OUT/results.txt"
    stop "$tpid"
fi

if has a; then
    echo "== (a) remote prefill vs recompute on the decode engine: load $(load_avg)" | tee -a "$OUT/results.txt"
    pp=$(free_port); pt=$(free_port); dp=$(free_port)
    ppid=$(engine prefill "$pp" --kv-role prefill --kv-transfer-port "$pt")
    dpid=$(engine decode "$dp" --kv-role decode)
    python3 "$OUT/drive.py" remote "$ROUNDS" 11 "$pp" "$dp" | tee -a "$OUT/results.txt"
    echo "   load after $(load_avg)" | tee -a "$OUT/results.txt"
    stop "$ppid"; stop "$dpid"
fi

if has b; then
    echo "== (b) through the tier vs recompute on replica B: load $(load_avg)" | tee -a "$OUT/results.txt"
    tport=$(free_port); tpid=$(tier "$tport")
    ap=$(free_port); bp=$(free_port)
    # A's cache holds one 1,016-token prompt and a little: each filler evicts what came before.
    apid=$(engine tier-a "$ap" --kv-tier "127.0.0.1:$tport" --num-blocks 72)
    bpid=$(engine tier-b "$bp" --kv-tier "127.0.0.1:$tport")
    python3 "$OUT/drive.py" tier "$ROUNDS" 13 "$ap" "$bp" | tee -a "$OUT/results.txt"
    echo "   load after $(load_avg)" | tee -a "$OUT/results.txt"
    stop "$apid"; stop "$bpid"; stop "$tpid"
fi

if has c; then
    # setup LABEL: colocated (2 engines, role both) or disagg (prefill + decode, PD router).
    run_c() {
        local label=$1 r=$2 e1 e2 p1 p2 t1 rp rpid
        e1=$(free_port); e2=$(free_port); t1=$(free_port); rp=$(free_port)
        if [ "$label" = disagg ]; then
            p1=$(engine "c-prefill-$r" "$e1" --kv-role prefill --kv-transfer-port "$t1")
            p2=$(engine "c-decode-$r" "$e2" --kv-role decode)
            printf 'endpoints:\n  - {url: "http://127.0.0.1:%s", kind: strata, role: prefill}\n  - {url: "http://127.0.0.1:%s", kind: strata, role: decode}\n' "$e1" "$e2" >"$OUT/ep-$label.yaml"
            "$STRATA" router --port "$rp" --endpoints-file "$OUT/ep-$label.yaml" --pd-threshold 256 \
                >/dev/null 2>"$OUT/router-$label-$r.log" &
        else
            p1=$(engine "c-a-$r" "$e1")
            p2=$(engine "c-b-$r" "$e2")
            printf 'endpoints:\n  - {url: "http://127.0.0.1:%s", kind: strata}\n  - {url: "http://127.0.0.1:%s", kind: strata}\n' "$e1" "$e2" >"$OUT/ep-$label.yaml"
            "$STRATA" router --port "$rp" --endpoints-file "$OUT/ep-$label.yaml" \
                >/dev/null 2>"$OUT/router-$label-$r.log" &
        fi
        rpid=$!; echo "$rpid" >>"$OUT/pids"
        wait_ready "$rp" "$rpid" || { echo "router did not start" >&2; tail -20 "$OUT/router-$label-$r.log" >&2; exit 1; }
        sleep 1  # the router's first scrape marks the endpoints ready
        "$STRATA" bench --url "http://127.0.0.1:$rp" --model "$NAME" --seed 7 -q \
            --label "warm-$label-$r" --output "$OUT/warm-$label-$r.json" \
            --workload random --input-len 64 --output-len 4 --concurrency 1 --requests 2 >/dev/null
        echo "$label r=$r load=$(load_avg)" >>"$OUT/loadavg.txt"
        "$STRATA" bench --url "http://127.0.0.1:$rp" --model "$NAME" --seed $(( 7 + r )) -q \
            --label "$label-r$r" --output "$OUT/$label-r$r.json" \
            --workload shared-prefix --groups 4 --prompts-per-group 6 --system-len 1000 \
            --question-len 16 --output-len 32 --concurrency 4 --requests 24 >/dev/null
        if [ "$label" = disagg ]; then
            curl -s "http://127.0.0.1:$e2/metrics" | grep -E '^strata:kv_transfer_requests_total' \
                | sed "s/^/   $label r=$r decode engine: /" >>"$OUT/loadavg.txt" || true
        fi
        stop "$rpid"; stop "$p1"; stop "$p2"
    }
    for r in $(seq "$ROUNDS_C"); do
        if [ $(( r % 2 )) -eq 1 ]; then run_c colocated "$r"; run_c disagg "$r"
        else run_c disagg "$r"; run_c colocated "$r"; fi
    done
    echo "== (c) disaggregated vs colocated, shared-prefix load through the router" | tee -a "$OUT/results.txt"
    python3 - "$OUT" "$ROUNDS_C" <<'PY' | tee -a "$OUT/results.txt"
import json, pathlib, statistics, sys
out, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def lat(r, metric, q):
    v = (r.get("latency_ms") or r.get("latency") or {}).get(metric) or {}
    return v.get(q, float("nan"))
rows = {}
for label in ("colocated", "disagg"):
    reps = [json.loads((out / f"{label}-r{i}.json").read_text()) for i in range(1, rounds + 1)]
    rows[label] = {
        "itl_p99": statistics.median(lat(r, "itl", "p99") for r in reps),
        "ttft_p50": statistics.median(lat(r, "ttft", "p50") for r in reps),
        "ttft_p90": statistics.median(lat(r, "ttft", "p90") for r in reps),
        "tpot_p50": statistics.median(lat(r, "tpot", "p50") for r in reps),
        "tok_s": statistics.median(r["throughput"]["output_tokens_per_s"] for r in reps),
    }
print("| setup | output tok/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | ITL p99 ms |")
print("|---|---|---|---|---|---|")
for k, v in rows.items():
    print(f"| {k} | {v['tok_s']:.1f} | {v['ttft_p50']:.1f} | {v['ttft_p90']:.1f} | {v['tpot_p50']:.1f} | {v['itl_p99']:.1f} |")
print(f"\ndisagg / colocated ITL p99: {rows['disagg']['itl_p99'] / rows['colocated']['itl_p99']:.2f}, "
      f"TTFT p50: {rows['disagg']['ttft_p50'] / rows['colocated']['ttft_p50']:.2f}")
PY
    cat "$OUT/loadavg.txt" | tee -a "$OUT/results.txt"
fi

echo
echo "== all results"
cat "$OUT/results.txt"
