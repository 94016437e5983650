#!/usr/bin/env bash
# Prepares .gpu/ (ignored; carried to a CUDA machine that has no network): the
# llama-cpp-python sdist stripped to what a library build compiles (its llama.cpp without
# models, docs, tests, examples and tools but mtmd: 7 MB, where the sdist is 77 MB and a
# carried tree holds at most 64 MiB), and Python 3.12 wheels of what the tests import
# beyond that machine's image. tools/gpu/check.sh runs there.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=0.3.36
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
.venv/bin/pip download -q -d $OUT/wheels --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any \
    gguf==0.19.0 zstandard==0.25.0 redis==8.1.0 pytest-asyncio==1.5.0 openai==3.57.0 \
    anthropic==2.14.0 jsonschema==4.26.0 diskcache==5.6.3 pytest==9.2.0
rm -f $OUT/wheels/numpy-*  # the image's own
du -sh $OUT
