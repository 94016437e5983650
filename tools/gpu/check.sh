#!/usr/bin/env bash
# The engine's tests on a CUDA machine that has no network (the workplace's device tool
# runs this over a copy of the working tree, with .gpu/ from tools/gpu/payload.sh carried),
# in two parts that each fit one command of a lease (docs/gpu.md, "The next run"):
#   bash tools/gpu/check.sh      part 1: llama-cpp-python with CUDA (built, or the build a
#                                run before left in $OUT, carried as .gpu/llama-cuda.tgz),
#                                the import-order check, the exact-restore tests (a failure
#                                there is a restore defect on this backend, never arithmetic),
#                                then tests/model
#   bash tools/gpu/check.sh 2    part 2 (optional, on the same warm machine): tests/http
# Every layer is offloaded (model.n_gpu_layers = -1, the default). What needs a model that
# cannot travel (Gemma 3, SmolLM2: each larger than a carried tree may be) errors, and so
# does what needs the ``statecache`` script; the synthetic GGUFs are generated there.
# Logs, JUnit files and summary.md (to paste into docs/gpu.md) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
PART=${1:-1}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( ${TOTAL_S:-540} - ($(date +%s) - t0) )); }
{ nvidia-smi -L; nproc; python3 --version; nvcc --version | tail -2; } > "$OUT/env.txt" 2>&1
# the image's python3 is a venv of its own: what it lacks goes to a folder on PYTHONPATH
SITE=${SITE:-/tmp/gpusite} PY=${PY:-python3}
export PYTHONPATH=$PWD:$SITE
if [[ ! -d $SITE/gguf ]]; then
    $PY -m pip install -q --no-index --no-deps --target $SITE .gpu/wheels/*.whl \
        > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
fi
if ! $PY -c "import llama_cpp" 2>/dev/null; then
    if [[ -f .gpu/llama-cuda.tgz ]]; then
        tar xzf .gpu/llama-cuda.tgz -C $SITE && echo "llama-cpp-python: the carried CUDA build"
    else
        rm -rf /tmp/src && tar xzf .gpu/llama-src.tgz -C /tmp
        # FlashAttention's kernels off: they double the build, and a build must fit a lease
        export CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} \
-DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_OPENMP=OFF"
        export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
        timeout "${BUILD_S:-360}" $PY -m pip install -v --no-index --no-build-isolation \
            --no-deps --target $SITE /tmp/src > "$OUT/build.txt" 2>&1 \
            || { echo "build failed"; tail -40 "$OUT/build.txt"; exit 1; }
        # the build, for the next lease to carry (.gpu/llama-cuda.tgz) instead of building
        (cd $SITE && tar czf "$OUT/llama-cuda.tgz" llama_cpp llama_cpp_python-*.dist-info)
    fi
fi
echo "llama-cpp-python ready in $(( $(date +%s) - t0 )) s" | tee "$OUT/built.txt"
$PY - <<'PY' 2>&1 | tee "$OUT/offload.txt"
import llama_cpp
print("gpu offload supported:", bool(llama_cpp.llama_supports_gpu_offload()))
PY
# the image's own pytest plugins (jax's, hypothesis') stay out: ours only
tests() {  # name, seconds, pytest arguments...
    local name=$1 secs=$2; shift 2
    local s0=$(date +%s)
    # an interrupt at the limit, so that pytest still writes what ran to the JUnit file
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -s INT -k 30 "$secs" \
        $PY -m pytest -p asyncio -p pytest_timeout --timeout 60 -v --tb=short -rfE \
        -p no:cacheprovider --junitxml "$OUT/$name.xml" "$@" ${PYTEST_ARGS:-} \
        > "$OUT/$name.txt" 2>&1
    echo "$name: rc=$? in $(( $(date +%s) - s0 )) s" | tee -a "$OUT/parts.txt"
    grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/$name.txt" | tail -30
}
if [[ $PART == 1 ]]; then
    s0=$(date +%s)
    timeout 150 $PY -m tools.gpu.import_order | tee "$OUT/import_order.txt"
    echo "import_order: in $(( $(date +%s) - s0 )) s" | tee -a "$OUT/parts.txt"
    # first: they tell a restore defect from arithmetic on this backend
    tests exact "$(left)" tests/model/test_exact_restore.py
    tests model "$(left)" tests/model --ignore tests/model/test_exact_restore.py
else
    tests http "$(left)" tests/http --ignore tests/http/test_remote_tier.py \
        --ignore tests/http/test_ui_browser.py --ignore tests/http/test_soak.py
fi
$PY -m tools.gpu.summary "$OUT" > "$OUT/summary.md"
cat "$OUT/summary.md"
echo "part $PART: total $(( $(date +%s) - t0 )) s"
