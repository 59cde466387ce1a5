#!/usr/bin/env bash
# Runs every check and test: formatting, import circles, lints, the default model (pulled when missing),
# then the whole workspace's tests. Usage: scripts/test.sh [extra test-runner args]
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== import circles between files"
python3 scripts/import-cycles.py
echo "== cargo clippy (every feature, then the binary's default one-machine build)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
cargo clippy -p strata-cli --locked -- -D warnings
echo "== default model"
cargo run --quiet --locked --all-features -p strata-cli -- model pull
echo "== embedding model"
cargo run --quiet --locked --all-features -p strata-cli -- model pull all-minilm-l6-v2
echo "== tests"
# The binary's default build leaves the Kubernetes parts out: their flags must be refused
# there, saying which feature they need (these tests exist only without the features).
lean_tests() {
    local out
    out=$(cargo test --locked -q "$@" 2>&1) || { echo "$out"; return 1; }
    echo "$out" | grep -q "test result: ok. [1-9]" || { echo "$out"; echo "no test ran: $*" >&2; return 1; }
}
lean_tests -p strata-router --no-default-features --lib server::tests::without_
lean_tests -p strata-controller --no-default-features --features runtime --lib cli::tests::without_
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --all-features --locked --no-fail-fast "$@"
else
    cargo test --workspace --all-features --locked --no-fail-fast "$@"
fi
