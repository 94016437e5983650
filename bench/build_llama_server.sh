#!/usr/bin/env bash
# Build llama.cpp's llama-server from the exact llama.cpp source that
# llama-cpp-python 0.3.36 vendors, with the same portable flags as the
# project's own llama-cpp-python build (the native build crashes on AMX hosts),
# except OpenMP, which llama-server keeps on as llama.cpp builds it by default.
#
#   bash bench/build_llama_server.sh        # prints the binary's path on success
#
# Skips the build when the binary already exists. Output under build/.
set -euo pipefail

VERSION=0.3.36
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="$ROOT/build/llama-server"
PY="${PY:-$ROOT/.venv/bin/python}"
BIN="$BUILD/cmake/bin/llama-server"
JOBS="${JOBS:-2}"

if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$BUILD"
SRC="$BUILD/llama_cpp_python-$VERSION"
if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    # PyPI has only the sdist of this version; --no-binary keeps it that way.
    "$PY" -m pip download --no-deps --no-binary :all: --dest "$BUILD" \
        "llama-cpp-python==$VERSION" >&2
    tar -xzf "$BUILD/llama_cpp_python-$VERSION.tar.gz" -C "$BUILD"
fi

case "$(uname -s)-$(uname -m)" in
    Linux-x86_64)
        FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
               -DGGML_F16C=ON -DGGML_BMI2=ON) ;;
    *) FLAGS=() ;;   # macOS arm64: default flags (Metal), as for llama-cpp-python
esac

cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD/cmake" -DCMAKE_BUILD_TYPE=Release \
    "${FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$BUILD/cmake" --target llama-server -j"$JOBS" >&2
test -x "$BIN"
echo "$BIN"
