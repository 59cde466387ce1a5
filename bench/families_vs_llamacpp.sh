#!/usr/bin/env bash
# Strata's engine vs llama.cpp's llama-bench for each model family's tiny model
# (tools/families/make_tiny.py, written with a 1024-token context) and for the default
# model (SmolLM2-135M): prompt processing (pp512) and single-stream decode (tg128),
# threads = cores, one round each engine in turn per model, tokens/s.
#
# Usage: bench/families_vs_llamacpp.sh [ROUNDS]   (default 1)
# Needs: python3 with the `gguf` and `numpy` packages (PYTHON picks the interpreter),
# cmake (installed as a wheel when missing), a Rust toolchain.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUNDS="${1:-1}"
THREADS="$(nproc)"
PYTHON="${PYTHON:-python3}"

tools/llamacpp/build.sh >/dev/null
cargo build --release --quiet -p strata-cli --bin strata
cargo build --release --quiet -p strata-engine --example engine_bench
BENCH=target/release/examples/engine_bench
LLAMA=target/llama.cpp/bin/llama-bench
OUT="$(mktemp -d)"
MODELS="$OUT/models"
"$PYTHON" tools/families/make_tiny.py --out "$MODELS" --context 1024 >/dev/null
cp "$(target/release/strata model pull)" "$MODELS/smollm2.gguf"

for r in $(seq "$ROUNDS"); do
    for m in "$MODELS"/*.gguf; do
        name="$(basename "$m" .gguf)"
        "$LLAMA" -m "$m" -p 512 -n 128 -t "$THREADS" -r 1 -o json 2>/dev/null >"$OUT/llama_${name}_$r.json"
        RAYON_NUM_THREADS="$THREADS" "$BENCH" --model "$m" --weights gguf \
            --prompt 512 --gen 128 --reps 1 >"$OUT/strata_${name}_$r.json"
    done
done

"$PYTHON" - "$OUT" "$ROUNDS" "$THREADS" <<'PY'
import json, pathlib, statistics, sys
out, rounds, threads = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
names = sorted(p.stem for p in (out / "models").glob("*.gguf"))
def llama(name, kind):
    vals = []
    for r in range(1, rounds + 1):
        for row in json.loads((out / f"llama_{name}_{r}.json").read_text()):
            if kind == "pp" and row["n_prompt"] == 512 and row["n_gen"] == 0:
                vals.append(row["avg_ts"])
            if kind == "tg" and row["n_gen"] == 128 and row["n_prompt"] == 0:
                vals.append(row["avg_ts"])
    return statistics.median(vals)
def strata(name, key):
    return statistics.median(json.loads((out / f"strata_{name}_{r}.json").read_text())[key]
                             for r in range(1, rounds + 1))
print(f"threads={threads} rounds={rounds}; tokens/s (median), Strata --weights gguf")
print(f"{'model':<12}{'llama pp512':>12}{'strata pp512':>14}{'ratio':>7}"
      f"{'llama tg128':>13}{'strata tg128':>14}{'ratio':>7}")
for n in names:
    lp, lt = llama(n, "pp"), llama(n, "tg")
    sp, st = strata(n, "pp512_tok_s"), strata(n, "tg128_tok_s")
    print(f"{n:<12}{lp:>12.1f}{sp:>14.1f}{sp / lp:>7.2f}{lt:>13.1f}{st:>14.1f}{st / lt:>7.2f}")
PY
rm -rf "$OUT"
