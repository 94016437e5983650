#!/usr/bin/env bash
# The engine's tests on a CUDA machine that has no network (the workplace's device tool
# runs this over a copy of the working tree, with .gpu/ from tools/gpu/payload.sh carried):
# builds llama-cpp-python with CUDA for the GPU there, then runs the model and HTTP tests
# with every layer offloaded (model.n_gpu_layers = -1, the default). What needs a model
# that cannot travel (Gemma 3, SmolLM2: each larger than a carried tree may be) errors,
# and so does what needs a valkey-server or the ``statecache`` script; the synthetic GGUFs
# are generated there. Logs go to $OUT. docs/gpu.md says what a run there showed.
#   run: bash tools/gpu/check.sh   (carry: .gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
{ nvidia-smi -L; nproc; python3 --version; nvcc --version | tail -2; } > "$OUT/env.txt" 2>&1
# the image's python3 is a venv of its own: what it lacks goes to a folder on PYTHONPATH
SITE=/tmp/gpusite PY=python3
export PYTHONPATH=$PWD:$SITE
if [[ ! -d $SITE/gguf ]]; then
    $PY -m pip install -q --no-index --no-deps --target $SITE .gpu/wheels/*.whl \
        > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
fi
if ! $PY -c "import llama_cpp" 2>/dev/null; then
    rm -rf /tmp/src && tar xzf .gpu/llama-src.tgz -C /tmp
    # FlashAttention's kernels off: they double the build, and a build must fit a lease
    export CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} \
-DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_OPENMP=OFF"
    export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
    timeout "${BUILD_S:-360}" $PY -m pip install -v --no-index --no-build-isolation --no-deps \
        --target $SITE /tmp/src > "$OUT/build.txt" 2>&1 || { echo "build failed"; tail -40 "$OUT/build.txt"; exit 1; }
fi
echo "built in $(( $(date +%s) - t0 )) s"
$PY - <<'PY' 2>&1 | tee "$OUT/offload.txt"
import llama_cpp
print("gpu offload supported:", bool(llama_cpp.llama_supports_gpu_offload()))
PY
$PY -m tools.gpu.import_order | tee "$OUT/import_order.txt"
left=$(( ${TOTAL_S:-560} - ($(date +%s) - t0) ))
echo "tests: $left s left"
# the image's own pytest plugins (jax's, hypothesis') stay out: ours only
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "$left" $PY -m pytest -p asyncio -p pytest_timeout \
    --timeout 60 -v --tb=short -rfE -p no:cacheprovider \
    tests/model tests/http --ignore tests/http/test_remote_tier.py \
    --ignore tests/http/test_ui_browser.py --ignore tests/http/test_soak.py \
    --junitxml "$OUT/junit.xml" ${PYTEST_ARGS:-} > "$OUT/tests.txt" 2>&1
rc=$?
grep -E "^(FAILED|ERROR) |passed|failed|Fatal" "$OUT/tests.txt" | tail -60
echo "rc=$rc total $(( $(date +%s) - t0 )) s"
