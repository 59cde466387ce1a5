#!/usr/bin/env bash
# Build the llama.cpp reference tools (llama-tokenize, llama-bench, llama-server)
# from the llama.cpp source vendored in the llama-cpp-python sdist on PyPI.
#
# Output: target/llama.cpp/bin/{llama-tokenize,llama-bench,llama-server}
# Idempotent: does nothing when all three binaries already exist.
#
# Env knobs:
#   LLAMA_CPP_PYTHON_VERSION  sdist version to take llama.cpp from (default pinned below)
#   LLAMA_CPP_DIR             output directory (default <repo>/target/llama.cpp)
#   JOBS                      parallel build jobs (default 2)
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.16}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${LLAMA_CPP_DIR:-$ROOT/target/llama.cpp}"
JOBS="${JOBS:-2}"
TARGETS=(llama-tokenize llama-bench llama-server)

all_built() {
    for t in "${TARGETS[@]}"; do
        [ -x "$OUT/bin/$t" ] || return 1
    done
    return 0
}

if all_built; then
    echo "llama.cpp tools already built in $OUT/bin"
    exit 0
fi

# cmake comes as a binary wheel when missing.
if ! command -v cmake >/dev/null 2>&1; then
    python3 -m pip install --only-binary :all: cmake
    hash -r
fi

mkdir -p "$OUT"
SRC="$OUT/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    DL="$OUT/download"
    mkdir -p "$DL"
    if ! ls "$DL"/llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
        # `pip download` prepares the sdist's metadata with its build backend
        # (scikit-build-core). In an isolated build env with --no-binary :all: that
        # backend asks for cmake/ninja and pip compiles them from source (tens of
        # minutes), so install the backend as a wheel into a throwaway venv and
        # download without build isolation.
        VENV="$OUT/pip-venv"
        if [ ! -x "$VENV/bin/python" ]; then
            python3 -m venv "$VENV"
            "$VENV/bin/python" -m pip install --quiet --only-binary :all: scikit-build-core
        fi
        "$VENV/bin/python" -m pip download --no-deps --no-binary :all: --no-build-isolation \
            "llama-cpp-python==$VERSION" -d "$DL"
    fi
    SDIST="$(ls "$DL"/llama_cpp_python-"$VERSION".tar.gz | head -n1)"
    rm -rf "$OUT/unpack"
    mkdir -p "$OUT/unpack"
    tar -xzf "$SDIST" -C "$OUT/unpack"
    VENDOR="$(ls -d "$OUT"/unpack/*/vendor/llama.cpp | head -n1)"
    if [ ! -f "$VENDOR/CMakeLists.txt" ]; then
        echo "error: no vendored llama.cpp in $SDIST" >&2
        exit 1
    fi
    rm -rf "$SRC"
    mv "$VENDOR" "$SRC"
    rm -rf "$OUT/unpack"
fi

cmake -S "$SRC" -B "$OUT/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$OUT/build" --config Release -j "$JOBS" --target "${TARGETS[@]}"

mkdir -p "$OUT/bin"
for t in "${TARGETS[@]}"; do
    bin="$(find "$OUT/build" -type f -name "$t" -perm -u+x | head -n1)"
    if [ -z "$bin" ]; then
        echo "error: $t was not built" >&2
        exit 1
    fi
    cp "$bin" "$OUT/bin/$t"
done
echo "$VERSION" > "$OUT/VERSION"
echo "llama.cpp tools built in $OUT/bin (llama.cpp from llama-cpp-python $VERSION)"
