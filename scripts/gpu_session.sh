#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/benchmarks.md ("## GPU: method and commands"),
# in stages that each end inside a time limit, for a machine with an NVIDIA GPU, JAX
# with CUDA, flax and torch already installed (nothing is installed here: such a
# machine may have no network). Logs and JSON go to $JD_GPU_RESULTS (default
# results/gpu); where $OUT is set (the device tool's folder of files to bring back),
# the last stage packs them into $OUT/gpu_results.tgz and copies the log beside it.
#
#   bash scripts/gpu_session.sh env small t64 slide causal large huge   # one after another
#   bash scripts/gpu_session.sh suite variants                           # on the same machine
#
# Stages: env (versions, nvidia-smi, jd.backend_report()); suite (the whole test suite,
# JAX's default backend the GPU); small (16K: dilated, dense, torch); t64 (64K: dilated,
# segment kernels, dense, torch, and a profile of the dilated calls); variants (64K:
# head_groups with a window branch, soft-cap, sinks, packed rows and non-dividing
# segments against the plain call; its slow cells timed alone); causal (64K causal);
# large (256K, profiled); huge (1M); slide (Prov-GigaPath's slide encoder in bfloat16
# and float32 against the CPU's float32 at 2,000 tiles, then timed at 10K and 100K
# tiles); chunks (longnet at 1M with 512 MiB, 2 GiB and 4 GiB streamed chunks); quick
# (toy sizes). With JD_GPU_ALLOW_CPU=1 every stage but suite rehearses on a CPU at toy
# sizes.
# Every stage ends by its own limit and by JD_GPU_DEADLINE (seconds from the start,
# default 560), so the results are packed before the caller's own limit; a stage
# with under 20 s left is skipped. A stage that fails or runs out of time is logged
# and the next one runs.
set -u
cd "$(dirname "$0")/.."
RESULTS="${JD_GPU_RESULTS:-results/gpu}"
DEADLINE="${JD_GPU_DEADLINE:-560}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# several pytest workers share the GPU: none may take most of its memory up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${JD_PYTHON:-python3}"
LOG="$RESULTS/log.txt"
CPU_FLAG=()  # a rehearsal on a CPU: toy sizes, whatever the stage asks for
[ "${JD_GPU_ALLOW_CPU:-0}" = 1 ] && CPU_FLAG=(--allow-cpu --quick --sizes 512 --repeats 2)

stage() {  # stage NAME SECONDS COMMAND...: runs it under min(SECONDS, time left)
    local name=$1 limit=$2; shift 2
    local left=$((DEADLINE - SECONDS - 10))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        echo "=== $name: skipped ($((DEADLINE - SECONDS)) s left of JD_GPU_DEADLINE)" | tee -a "$LOG"
        return
    fi
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    # SIGINT first: pytest and the benchmarks then print what they have
    timeout -s INT -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n 40
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0))s" | tee -a "$LOG"
}

bench() {  # bench NAME SECONDS ARGS...
    local name=$1 limit=$2; shift 2
    stage "bench $name" "$limit" "$PY" -m benchmarks gpu --threads 16 --no-plot \
        --json "$RESULTS/gpu_$name.json" "$@" "${CPU_FLAG[@]}"
}

pack() {  # the results back through the device tool's $OUT (8 files at most there)
    [ -n "${OUT:-}" ] || return 0
    tar -czf "$OUT/gpu_results.tgz" -C "$RESULTS" . 2>/dev/null
    cp "$LOG" "$OUT/log.txt"
    ls -la "$OUT"
}

for s in "$@"; do
    case $s in
    env)
        stage env 60 bash -c "nvidia-smi; uptime; $PY -c 'import sys, jax, jaxlib, flax, torch; \
print(sys.version); print(jax.__version__, jaxlib.__version__, flax.__version__, \
torch.__version__, torch.version.cuda); print(jax.devices())'; \
$PY -c 'import jax_dilated as jd; jd.backend_report()'" ;;
    suite)  # -v: every result is in the log even if the time runs out; -rfE: failures at the end.
        # JD_GPU_SUITE_FIRST: test files to run first (those that failed on the last GPU),
        # so a suite cut short by the deadline still re-checks them; the rest follows
        # (pytest would merge the files into tests/ and keep its own order).
        rest=()
        if [ -n "${JD_GPU_SUITE_FIRST:-}" ]; then
            # shellcheck disable=SC2086
            stage suite-first 9999 "$PY" -m pytest -v -n "${JD_GPU_WORKERS:-14}" --dist loadfile \
                -p no:cacheprovider -rfE --junitxml="$RESULTS/suite_first.xml" $JD_GPU_SUITE_FIRST
            for f in $JD_GPU_SUITE_FIRST; do rest+=("--ignore=$f"); done
        fi
        stage suite 9999 "$PY" -m pytest -v -n "${JD_GPU_WORKERS:-14}" --dist loadfile -p no:cacheprovider -rfE \
            --durations=25 --junitxml="$RESULTS/suite.xml" "${rest[@]}" tests ;;
    quick) bench quick 120 --quick --ops dilated,segments,dense,torch,variants --profile ;;
    small) bench small 60 --sizes 16384 --ops dilated,dense,torch ;;
    t64) bench t64 100 --sizes 65536 --ops dilated,segments,dense,torch --profile ;;
    variants) bench variants 100 --sizes 65536 --ops variants --cell-seconds 8 ;;
    causal) bench causal 60 --sizes 65536 --causal --ops dilated,dense,torch ;;
    large) bench large 70 --sizes 262144 --ops dilated,segments,torch --profile ;;
    huge) bench huge 80 --sizes 1048576 --ops dilated,torch --repeats 3 ;;
    slide)
        stage slide 90 "$PY" -m benchmarks slide gpu --threads 16 --repeats 3 --no-plot \
            --json "$RESULTS/slide_gpu.json" \
            ${JD_GPU_ALLOW_CPU:+--allow-cpu --quick} ;;
    chunks)  # longnet at 1M against the streamed chunk size (CudnnKernel.STREAM_CHUNK_BYTES)
        for mib in 512 2048 4096; do
            bench "chunks_$mib" 100 --sizes 1048576 --ops dilated --modes longnet \
                --repeats 3 --stream-chunk-mib "$mib"
        done ;;
    *) echo "unknown stage $s" | tee -a "$LOG" ;;
    esac
done
pack
