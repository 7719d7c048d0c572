#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/benchmarks.md ("## GPU: method and commands"),
# in stages that each end inside a time limit, for a machine with an NVIDIA GPU, JAX
# with CUDA, flax and torch already installed (nothing is installed here: such a
# machine may have no network). Logs and JSON go to $OUT (default results/gpu).
#
#   bash scripts/gpu_session.sh env tests quick small     # one stage after another
#
# Stages: env (versions, nvidia-smi, jd.backend_report()), tests (cuDNN parity and
# lowering), suite (kernel, parity, window and layer tests on the GPU), full (the
# whole suite, in the time left of JD_GPU_BUDGET seconds), quick (the
# benchmark at toy sizes), small (16K, 64K), causal (64K causal), large (256K),
# huge (1M), chunks (longnet at 1M with 512 MiB, 2 GiB and 4 GiB streamed chunks).
# A stage that fails or runs out of time is logged and the next one runs. Each
# benchmark stage writes two files (JSON and Markdown) beside log.txt.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# several pytest workers share the GPU: none may take most of its memory up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${JD_PYTHON:-python3}"
LOG="$OUT/log.txt"

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n 60
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0))s" | tee -a "$LOG"
}

bench() {  # bench NAME SECONDS ARGS...
    local name=$1 limit=$2; shift 2
    stage "bench $name" "$limit" "$PY" -m benchmarks gpu --threads 16 --no-plot \
        --json "$OUT/gpu_$name.json" "$@"
}

for s in "$@"; do
    case $s in
    env)
        stage env 60 bash -c "nvidia-smi; $PY -c 'import sys, jax, jaxlib, flax, torch; \
print(sys.version); print(jax.__version__, jaxlib.__version__, flax.__version__, \
torch.__version__, torch.version.cuda); print(jax.devices())'; \
$PY -c 'import jax_dilated as jd; jd.backend_report()'" ;;
    tests)
        stage tests 300 "$PY" -m pytest -q -n 4 --dist loadfile -p no:cacheprovider \
            tests/test_backends.py tests/test_cudnn_lowering.py -rs ;;
    suite)
        stage suite 420 "$PY" -m pytest -q -n 6 --dist loadfile -p no:cacheprovider \
            tests/test_kernel.py tests/test_parity.py tests/test_window.py \
            tests/test_dilated_window.py tests/test_layers.py tests/test_decode.py \
            tests/test_softmax.py tests/test_block_sparse.py ;;
    full)  # the whole suite, in what is left of JD_GPU_BUDGET seconds (default 580)
        stage full $(( ${JD_GPU_BUDGET:-580} - SECONDS )) "$PY" -m pytest -q -n 8 \
            --dist loadfile -p no:cacheprovider -rfE tests ;;
    quick) bench quick 120 --quick ;;
    small) bench small 300 --sizes 16384,65536 ;;
    causal) bench causal 240 --sizes 65536 --causal ;;
    large) bench large 300 --sizes 262144 --ops dilated,segments,ring_device,torch ;;
    huge) bench huge 400 --sizes 1048576 --ops dilated,segments,torch --repeats 3 ;;
    chunks)  # longnet at 1M against the streamed chunk size (CudnnKernel.STREAM_CHUNK_BYTES)
        for mib in 512 2048 4096; do
            bench "chunks_$mib" 200 --sizes 1048576 --ops dilated --modes longnet \
                --repeats 3 --stream-chunk-mib "$mib"
        done ;;
    *) echo "unknown stage $s" | tee -a "$LOG" ;;
    esac
done
