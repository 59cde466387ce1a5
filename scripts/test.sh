#!/usr/bin/env bash
# Runs every check and test: formatting, import circles, lints, the default model (pulled when missing),
# then the whole workspace's tests. Usage: scripts/test.sh [extra test-runner args]
#
# Lints and the default build's tests build into their own folder (target/checks): their
# artifacts share nothing with the test build. STRATA_TEST_PRUNE=1 (CI) removes that folder
# once they pass, so the disk holds one build at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
target_dir="${CARGO_TARGET_DIR:-target}"
checks_dir="$target_dir/checks"

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== import circles between files"
python3 scripts/import-cycles.py
echo "== architecture invariants (docs/ARCHITECTURE.md)"
python3 scripts/architecture.py
echo "== cargo clippy (every feature, then the binary's default one-machine build)"
CARGO_TARGET_DIR="$checks_dir" cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
CARGO_TARGET_DIR="$checks_dir" cargo clippy -p strata-cli --locked -- -D warnings
echo "== the default build's refusals"
# The binary's default build leaves the Kubernetes parts out: their flags must be refused
# there, saying which feature they need (these tests exist only without the features).
lean_tests() {
    local out
    out=$(CARGO_TARGET_DIR="$checks_dir" cargo test --locked -q "$@" 2>&1) || { echo "$out"; return 1; }
    echo "$out" | grep -q "test result: ok. [1-9]" || { echo "$out"; echo "no test ran: $*" >&2; return 1; }
}
lean_tests -p strata-router --no-default-features --lib server::tests::without_
lean_tests -p strata-controller --no-default-features --features runtime --lib cli::tests::without_
if [ "${STRATA_TEST_PRUNE:-0}" = 1 ]; then
    echo "== pruning $checks_dir ($(du -sh "$checks_dir" | cut -f1))"
    rm -rf "$checks_dir"
fi

# One build serves the model pulls and the tests: the binary the tests run is the one that
# pulls (a separate `cargo run` would unify features differently and build the tree twice).
if cargo nextest --version >/dev/null 2>&1; then
    runner=(nextest run)
else
    runner=(test)
fi
echo "== building the tests"
cargo "${runner[@]}" --workspace --all-features --locked --no-run
echo "== default model"
"$target_dir/debug/strata" model pull
echo "== embedding model"
"$target_dir/debug/strata" model pull all-minilm-l6-v2
echo "== tests"
cargo "${runner[@]}" --workspace --all-features --locked --no-fail-fast "$@"
