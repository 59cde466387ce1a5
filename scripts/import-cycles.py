#!/usr/bin/env python3
"""Lists import circles between the files of each crate, and fails when there is one.

A file's module path follows Rust's layout (`lib.rs` is the crate root, `a/mod.rs` and `a.rs`
are `a`, `a/b.rs` is `a::b`). An edge A -> B is any `crate::`, `super::` or `self::` path in A
(in a `use` tree or inline) whose longest module prefix is B's module. Code after a
column-zero `#[cfg(test)]` is the file's unit tests and is not counted: a test may reach
anywhere. A file's edge up to its own folder's module (`a/b.rs` using `super::X` defined in
`a/mod.rs`, or `crate::X` from the root) is its folder's shape, not an edge. A circle is a
strongly connected set of two or more files.

Usage: scripts/import-cycles.py [--edges] [CRATE_DIR ...]   (default: every crates/*/)
"""
import os
import re
import sys

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
INLINE = re.compile(r"\b(crate|super|self)((?:::" + IDENT + r")+)")
USE = re.compile(r"\buse\s+([^;]*);", re.S)


def module_of(src, path):
    rel = os.path.relpath(path, src)[: -len(".rs")].split(os.sep)
    if rel[-1] in ("lib", "main") and len(rel) == 1:
        return ()
    if rel[-1] == "mod":
        rel = rel[:-1]
    return tuple(rel)


def expand_use_tree(text):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    # Drop renames (`x as y`) before the spaces go, then every space.
    text = re.sub(r"\s+as\s+" + IDENT, "", text)
    text = re.sub(r"\s+", "", text)
    out = []

    def walk(prefix, s):
        depth, start, parts = 0, 0, []
        for i, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(s[start:i])
                start = i + 1
        parts.append(s[start:])
        for part in parts:
            if not part:
                continue
            brace = part.find("{")
            if brace >= 0 and part.endswith("}"):
                head = part[:brace].rstrip(":")
                walk(prefix + ([head] if head else []), part[brace + 1 : -1])
            else:
                out.append("::".join(prefix + [part]))

    walk([], text)
    return out


def strip_comments(code):
    code = re.sub(r"/\*.*?\*/", "", code, flags=re.S)
    return re.sub(r"//[^\n]*", "", code)


def referenced_paths(code):
    code = strip_comments(code)
    paths = []
    for m in USE.finditer(code):
        for p in expand_use_tree(m.group(1)):
            paths.append(p)
    for m in INLINE.finditer(code):
        paths.append(m.group(1) + m.group(2))
    return paths


def resolve(path, here, modules):
    """The module (a tuple) a path names, or None when it leaves the crate."""
    segs = [s for s in path.split("::") if s]
    if not segs:
        return None
    # `self` and `super` are relative to the module the file *is*.
    if segs[0] == "crate":
        base, segs = (), segs[1:]
    elif segs[0] in ("self", "super"):
        base = here
        while segs and segs[0] in ("self", "super"):
            if segs[0] == "super":
                if not base:
                    return None
                base = base[:-1]
            segs = segs[1:]
    elif here + (segs[0],) in modules:
        # A bare path into a child module (`use child::X` in `lib.rs` or a `mod.rs`).
        base = here
    else:
        return None
    full = base + tuple(segs)
    for n in range(len(full), -1, -1):
        if full[:n] in modules:
            return full[:n]
    return None


def crate_edges(crate_dir):
    src = os.path.join(crate_dir, "src")
    files = {}
    for root, _dirs, names in os.walk(src):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.join(root, name)
                files[module_of(src, path)] = path
    edges = {m: set() for m in files}
    for mod, path in files.items():
        with open(path, encoding="utf-8") as f:
            code = f.read()
        cut = re.search(r"^#\[cfg\(test\)\]", code, re.M)
        if cut:
            code = code[: cut.start()]
        for p in referenced_paths(code):
            target = resolve(p, mod, files)
            # A file reaching up into its own folder's module (`super::Trait` from a plugin
            # in `scheduling/`) uses the definitions it is part of: that is the shape of a
            # folder module, not a circle. Every other edge counts.
            if target is not None and target != mod and mod[: len(target)] != target:
                edges[mod].add(target)
    return files, edges


def strongly_connected(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main(argv):
    show_edges = "--edges" in argv
    dirs = [a for a in argv if not a.startswith("--")]
    if not dirs:
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates")
        dirs = sorted(os.path.join(root, d) for d in os.listdir(root))
    circles = 0
    for crate_dir in dirs:
        if not os.path.isdir(os.path.join(crate_dir, "src")):
            continue
        files, edges = crate_edges(crate_dir)
        name = os.path.basename(os.path.normpath(crate_dir))
        if show_edges:
            for a in sorted(edges):
                for b in sorted(edges[a]):
                    print(f"{name}: {'::'.join(a) or 'crate'} -> {'::'.join(b) or 'crate'}")
        for comp in strongly_connected(edges):
            circles += 1
            mods = sorted("::".join(m) or "crate" for m in comp)
            print(f"{name}: import circle between {', '.join(mods)}")
    if circles:
        print(f"{circles} import circle(s) between files", file=sys.stderr)
        return 1
    print("no import circles between files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
