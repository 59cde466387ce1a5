#!/usr/bin/env bash
# Strata's engine vs llama.cpp on the default model, side by side on this machine:
# prompt processing (pp, a 512-token prompt) and single-stream decode (tg, 128 tokens),
# threads = cores, interleaved rounds (llama.cpp, then each Strata weight format), medians.
#
# Usage: bench/engine_vs_llamacpp.sh [ROUNDS]   (default 3)
# Needs: cmake (installed as a wheel when missing), python3 with pip, a Rust toolchain.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUNDS="${1:-3}"
THREADS="$(nproc)"

tools/llamacpp/build.sh >/dev/null
cargo build --release --quiet -p strata-cli --bin strata
cargo build --release --quiet -p strata-engine --example engine_bench
MODEL="$(target/release/strata model pull)"
BENCH=target/release/examples/engine_bench
LLAMA=target/llama.cpp/bin/llama-bench
OUT="$(mktemp -d)"

for r in $(seq "$ROUNDS"); do
    "$LLAMA" -m "$MODEL" -p 512 -n 128 -t "$THREADS" -r 1 -o json 2>/dev/null >"$OUT/llama_$r.json"
    for w in gguf q8_0 f32; do
        RAYON_NUM_THREADS="$THREADS" "$BENCH" --model "$MODEL" --weights "$w" \
            --prompt 512 --gen 128 --reps 1 >"$OUT/strata_${w}_$r.json"
    done
done

python3 - "$OUT" "$ROUNDS" "$THREADS" <<'PY'
import json, statistics, sys, pathlib
out, rounds, threads = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def llama(kind):
    vals = []
    for r in range(1, rounds + 1):
        for row in json.loads((out / f"llama_{r}.json").read_text()):
            if kind == "pp" and row["n_prompt"] == 512 and row["n_gen"] == 0:
                vals.append(row["avg_ts"])
            if kind == "tg" and row["n_gen"] == 128 and row["n_prompt"] == 0:
                vals.append(row["avg_ts"])
    return vals
def strata(w, key):
    return [json.loads((out / f"strata_{w}_{r}.json").read_text())[key] for r in range(1, rounds + 1)]
def fmt(v):
    return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
lp, lt = llama("pp"), llama("tg")
print(f"threads={threads} rounds={rounds}; tokens/s, median (min-max)")
print(f"{'engine':<22}{'pp512':>24}{'tg128':>24}{'pp ratio':>10}{'tg ratio':>10}")
print(f"{'llama.cpp (Q4_1)':<22}{fmt(lp):>24}{fmt(lt):>24}")
for w in ("gguf", "q8_0", "f32"):
    sp, st = strata(w, "pp512_tok_s"), strata(w, "tg128_tok_s")
    print(f"{'strata --weights ' + w:<22}{fmt(sp):>24}{fmt(st):>24}"
          f"{statistics.median(sp) / statistics.median(lp):>10.2f}{statistics.median(st) / statistics.median(lt):>10.2f}")
PY
rm -rf "$OUT"
