#!/usr/bin/env bash
# Cross-check `strata bench` against guidellm: both tools, the same server and the same
# workload shape (random prompts, fixed lengths, closed loop), interleaved S G S G ...
#
# usage: crates/bench/xcheck/run.sh URL MODEL TAG REQUESTS CONCURRENCY INPUT OUTPUT ROUNDS
# env:   STRATA_BENCH  command that runs `strata bench` (default: target/release/strata bench)
#        VENV          virtualenv with guidellm, gguf (default: target/bench-venv)
#        TOKENIZER     tokenizer dir for guidellm's prompt sizing (default: target/bench-xcheck/tokenizer)
# Writes target/bench-xcheck/out/{strata,guidellm}-TAG-ROUND.json; then
#   (cd target/bench-xcheck && python3 ../../crates/bench/xcheck/table.py TAG)
set -euo pipefail
URL=$1 MODEL=$2 TAG=$3 N=$4 C=$5 IN=$6 OUT=$7 ROUNDS=$8
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
STRATA_BENCH=${STRATA_BENCH:-$ROOT/target/release/strata bench}
VENV=${VENV:-$ROOT/target/bench-venv}
TOKENIZER=${TOKENIZER:-$ROOT/target/bench-xcheck/tokenizer}
OUTDIR=$ROOT/target/bench-xcheck/out
mkdir -p "$OUTDIR"
for r in $(seq 1 "$ROUNDS"); do
  # shellcheck disable=SC2086
  $STRATA_BENCH --url "$URL" --model "$MODEL" --input-len "$IN" --output-len "$OUT" \
    --concurrency "$C" --requests "$N" --seed $((1000 * r + 7)) --quiet \
    --label "strata-$TAG-$r" --output "$OUTDIR/strata-$TAG-$r.json" > "$OUTDIR/strata-$TAG-$r.log" 2>&1
  cat > "$OUTDIR/scenario-$TAG-$r.json" <<JSON
{"spec": {
  "backend": {"kind": "openai_http", "target": "$URL", "model": "$MODEL", "request_format": "/v1/completions"},
  "profile": {"kind": "concurrent", "streams": [$C]},
  "data": [{"kind": "synthetic_text", "prompt_tokens": $IN, "output_tokens": $OUT}],
  "tokenizer": {"kind": "hf_auto", "model": "$TOKENIZER"},
  "seed": {"kind": "static", "value": $((1000 * r + 99))},
  "constraints": [{"kind": "max_requests", "count": $N}],
  "outputs": [{"kind": "json", "path": "$OUTDIR/guidellm-$TAG-$r.json"}]
}}
JSON
  HF_HUB_OFFLINE=1 "$VENV/bin/guidellm" run --scenario "$OUTDIR/scenario-$TAG-$r.json" \
    --disable-progress > "$OUTDIR/guidellm-$TAG-$r.log" 2>&1
  echo "round $r done $(date -u +%T)"
done
