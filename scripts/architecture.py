#!/usr/bin/env python3
"""Checks the architecture invariants that `docs/ARCHITECTURE.md` marks "checked by
scripts/architecture.py", and fails naming each one that is broken.

Each check reads the source as text (code after a column-zero `#[cfg(test)]` is a file's unit
tests and is not counted; `tests/`, `benches/` and `examples/` folders are not library code):

- `anyhow`: library code returns typed errors; `anyhow` appears only in the files that run a
  command (ANYHOW_AT, each with its reason).
- `unwrap`: every library crate's `lib.rs` denies `clippy::unwrap_used` and `clippy::expect_used`
  outside tests, so clippy refuses a new `unwrap` on input.
- `edge`: every HTTP server runs through `strata_api::edge::serve` (bounded connections, head
  and body timeouts); only the files in SERVES_ELSEWHERE start a server another way.
- `deps`: the crates' layers (LAYERS: which Strata crates each may depend on, pointing down)
  and what some must never link (FORBIDDEN: the router never tokenizes nor runs a model).
- `pure`: policy files (PURE) hold no async code, no clock reads, no I/O: state, input and
  `now` in, a decision out, so the simulator runs the same code.
- `long`: no function outside tests is over 100 lines, but those in LONG_FUNCTIONS (each with
  the reason it stays whole); an entry that is no longer long must be removed.
- `size`: no source file holds over 1,200 lines before its tests.

Usage: scripts/architecture.py [--list-long]
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CRATES = os.path.join(ROOT, "crates")

# Files that may use `anyhow`: they run a command for the binary and print what failed.
ANYHOW_AT = {
    "crates/bench/src/cli.rs": "`strata bench`",
    "crates/controller/src/cli.rs": "`strata controller`",
    "crates/controller/src/rollout_client.rs": "`strata rollout`, the command's client",
    "crates/engine/src/cli/engine.rs": "`strata engine`",
    "crates/engine/src/cli/kv_tier.rs": "`strata kv-tier`",
    "crates/engine/src/cli/model.rs": "`strata model`",
    "crates/gateway/src/cli.rs": "`strata gateway`",
    "crates/router/src/server.rs": "`strata router`'s run",
    "crates/stack/src/up/build.rs": "`strata up`: build step",
    "crates/stack/src/up/gateway.rs": "`strata up`: the gateway it starts",
    "crates/stack/src/up/mod.rs": "`strata up`'s run",
    "crates/stack/src/up/serve.rs": "`strata up`: serve step",
}

# Files that start an HTTP server without `strata_api::edge::serve`, and why.
SERVES_ELSEWHERE = {
    "crates/mock/src/lib.rs": "the mock engine is a test double with injectable faults, "
    "including a server that misbehaves on purpose",
    "crates/mock/src/thread_server.rs": "tests' servers on a thread of their own, unbounded "
    "like the test clients that drive them",
}

# The Strata crates each crate may depend on ([dependencies], not dev-dependencies): the
# layers of `docs/ARCHITECTURE.md`, pointing down and never up. `api` is the bottom; the
# engine links only the controller's pure signature check (`registry`, default features off);
# the gateway may embed the router; the simulator runs the router's, the controller's and the
# engine's own code; `cli` is the top and may use anything.
LAYERS = {
    "api": set(),
    "mock": {"strata-api"},
    "bench": {"strata-api"},
    "controller": {"strata-api"},
    "router": {"strata-api"},
    "engine": {"strata-api", "strata-controller", "strata-mock"},
    "gateway": {"strata-api", "strata-router"},
    "stack": {"strata-api", "strata-controller", "strata-gateway", "strata-router"},
    "sim": {"strata-api", "strata-bench", "strata-controller", "strata-engine", "strata-router"},
}
# (crate, a dependency it must not have, why)
FORBIDDEN = [
    ("router", "tokenizers", "the router never tokenizes: it routes on text and token ids"),
    ("router", "candle-core", "the router never runs a model"),
    ("gateway", "candle-core", "the gateway never runs a model"),
    ("controller", "candle-core", "the controller never runs a model"),
]

# Pure policies: no async, no clock, no I/O.
PURE = [
    "crates/controller/src/autoscale.rs",
    "crates/controller/src/rollout.rs",
    "crates/router/src/scheduling",
    "crates/router/src/prefix",
    "crates/gateway/src/routing.rs",
    "crates/gateway/src/retry.rs",
    "crates/gateway/src/budget.rs",
]
IMPURE = re.compile(r"\basync\b|\.await\b|\btokio::|\bInstant::now\b|\bSystemTime::now\b|\bstd::fs\b|\bstd::net\b")

# Functions over 100 lines that stay whole, and why.
LONG_FUNCTIONS = {
    "crates/engine/src/chat_template.rs::string_method": "one match over the Python string "
    "methods templates call, an arm each: read as a table",
    "crates/engine/src/lora/adapter.rs::load_gguf": "not yet split (issue 48): shares its "
    "steps with load_peft",
    "crates/engine/src/lora/adapter.rs::load_peft": "not yet split (issue 48): shares its "
    "steps with load_gguf",
    "crates/engine/src/metrics.rs::with_limits": "not yet split (issue 48): each metric is "
    "still declared, built and registered apart",
    "crates/engine/src/tokenizer/mod.rs::from_metadata": "not yet split (issue 48)",
    "crates/gateway/src/store/postgres/mod.rs::record_usage": "not yet split (issue 48): "
    "the store query layer it moves into",
    "crates/sim/src/calibrate.rs::measure": "not yet split (issue 48)",
    "crates/sim/src/sim.rs::simulate": "not yet split (issue 48)",
}
LONG = 100
FILE_LINES = 1200


def library_files():
    for crate in sorted(os.listdir(CRATES)):
        src = os.path.join(CRATES, crate, "src")
        for root, _dirs, files in os.walk(src):
            for name in sorted(files):
                if name.endswith(".rs"):
                    path = os.path.join(root, name)
                    yield crate, os.path.relpath(path, ROOT)


def before_tests(rel):
    """The file's lines before its unit tests (a column-zero `#[cfg(test)]` on a `mod`)."""
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if line.strip() == "#[cfg(test)]" and i + 1 < len(lines) and re.match(r"\s*(pub(\(\w+\))?\s+)?mod ", lines[i + 1]):
            return lines[:i]
    return lines


def code_only(line):
    """A line without its `//` comment and with string and char literals emptied."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return re.sub(r"//.*", "", line)


FN = re.compile(r"\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+\"C\"\s+)?fn\s+(\w+)")


def functions(lines):
    """(name, first line, length) of each function with a body: braces matched on code."""
    i = 0
    while i < len(lines):
        m = FN.match(lines[i])
        if not m:
            i += 1
            continue
        depth, started, j = 0, False, i
        while j < len(lines):
            s = code_only(lines[j])
            if not started and depth == 0 and ";" in s and "{" not in s:
                break
            for ch in s:
                if ch == "{":
                    depth += 1
                    started = True
                elif ch == "}":
                    depth -= 1
            if started and depth == 0:
                break
            j += 1
        if started:
            yield m.group(7), i + 1, j - i + 1
        i += 1


def check_anyhow(files, problems):
    for _crate, rel in files:
        if rel.startswith("crates/cli/"):
            continue
        if any(re.search(r"\banyhow\b", code_only(l)) for l in before_tests(rel)):
            if rel not in ANYHOW_AT:
                problems.append(f"anyhow: {rel} uses anyhow in library code (return a typed error)")
    for rel in ANYHOW_AT:
        path = os.path.join(ROOT, rel)
        if not os.path.exists(path):
            problems.append(f"anyhow: {rel} is listed in ANYHOW_AT but does not exist")
        elif not any(re.search(r"\banyhow\b", code_only(l)) for l in before_tests(rel)):
            problems.append(f"anyhow: {rel} is listed in ANYHOW_AT but no longer uses anyhow: remove it")


def check_unwrap(problems):
    for crate in sorted(os.listdir(CRATES)):
        lib = os.path.join(CRATES, crate, "src", "lib.rs")
        if not os.path.exists(lib):
            continue
        with open(lib, encoding="utf-8") as f:
            text = f.read()
        if "deny(clippy::unwrap_used, clippy::expect_used)" not in text:
            problems.append(f"unwrap: crates/{crate}/src/lib.rs does not deny clippy::unwrap_used and clippy::expect_used")


def check_edge(files, problems):
    server = re.compile(r"\baxum::serve\b|\.serve_connection\(|\bhyper::server::conn\b")
    for _crate, rel in files:
        if rel == "crates/api/src/edge.rs" or rel in SERVES_ELSEWHERE:
            continue
        for n, line in enumerate(before_tests(rel), 1):
            if server.search(code_only(line)):
                problems.append(f"edge: {rel}:{n} starts a server without strata_api::edge::serve")


def dependencies(crate):
    """The names in a crate's [dependencies] table (not dev- or build-dependencies)."""
    names, section = set(), None
    with open(os.path.join(CRATES, crate, "Cargo.toml"), encoding="utf-8") as f:
        for line in f:
            head = re.match(r"\s*\[([^\]]+)\]", line)
            if head:
                section = head.group(1).strip()
                continue
            if section == "dependencies":
                m = re.match(r"\s*([A-Za-z0-9_-]+)\s*(\.|=)", line)
                if m:
                    names.add(m.group(1))
    return names


def check_deps(problems):
    for crate in sorted(os.listdir(CRATES)):
        if crate == "cli" or not os.path.exists(os.path.join(CRATES, crate, "Cargo.toml")):
            continue
        if crate not in LAYERS:
            problems.append(f"deps: crates/{crate} has no row in LAYERS (say where it sits)")
            continue
        own = f"strata-{crate}"
        for d in sorted(dependencies(crate)):
            if d.startswith("strata-") and d != own and d not in LAYERS[crate]:
                problems.append(f"deps: crates/{crate} depends on {d}, against the layers")
    for crate, forbidden, why in FORBIDDEN:
        if forbidden in dependencies(crate):
            problems.append(f"deps: crates/{crate} depends on {forbidden} ({why})")


def check_pure(files, problems):
    for _crate, rel in files:
        if not any(rel == p or rel.startswith(p + "/") for p in PURE):
            continue
        for n, line in enumerate(before_tests(rel), 1):
            if IMPURE.search(code_only(line)):
                problems.append(f"pure: {rel}:{n} is a policy file but reads a clock, does I/O or is async")


def long_functions(files):
    found = {}
    for _crate, rel in files:
        for name, line, length in functions(before_tests(rel)):
            if length > LONG:
                found[f"{rel}::{name}"] = (line, length)
    return found


def check_long(files, problems):
    found = long_functions(files)
    for key, (line, length) in sorted(found.items()):
        if key not in LONG_FUNCTIONS:
            problems.append(f"long: {key} (line {line}) is {length} lines; split it into named steps")
    for key in LONG_FUNCTIONS:
        if key not in found:
            problems.append(f"long: {key} is listed in LONG_FUNCTIONS but is no longer over {LONG} lines")


def check_size(files, problems):
    for _crate, rel in files:
        n = len(before_tests(rel))
        if n > FILE_LINES:
            problems.append(f"size: {rel} holds {n} lines before its tests (over {FILE_LINES}: one idea per file)")


def main():
    files = list(library_files())
    if "--list-long" in sys.argv:
        for key, (line, length) in sorted(long_functions(files).items(), key=lambda kv: -kv[1][1]):
            print(f"{length:4} {key} (line {line})")
        return 0
    problems = []
    check_anyhow(files, problems)
    check_unwrap(problems)
    check_edge(files, problems)
    check_deps(problems)
    check_pure(files, problems)
    check_long(files, problems)
    check_size(files, problems)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} architecture invariant(s) broken (docs/ARCHITECTURE.md, Invariants)", file=sys.stderr)
        return 1
    print("architecture invariants hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
