#!/usr/bin/env bash
# The GPU check, for a lent CUDA machine (H200 image: Python 3.12, torch 2.11 on
# CUDA 13, nvcc, ninja; no network). From the repository root, with wheels/
# carried along (scripts/fetch_gpu_wheels.sh fills it):
#
#     bash bench/gpu_check.sh        # device tool: carry ["wheels"], timeout_s 480
#
# It installs the carried wheels and the project (never torch), builds the
# FlashInfer kernels the tests and benchmarks need, runs the GPU tests and the
# GPU benchmarks. Output goes to $OUT (the device tool brings back at most 8
# files) or bench/out/gpu: gpu_check.log, gpu_tests.xml, bench_engine.json.
# Each step has a time limit, and all share one deadline (GPU_CHECK_SECONDS,
# default 420), so the whole check ends inside 8 minutes even when a step hangs.
# The FlashInfer kernel build runs in the background while the transport checks run.
# GPU_CHECK_PARTS="flashinfer engine" skips the transports (a recheck after engine work).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
logdir=${OUT:-bench/out/gpu}
mkdir -p "$logdir"
py=${PYTHON:-python3}
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-420}))
failed=()

step() {  # step NAME LIMIT COMMAND...: run COMMAND within LIMIT and the time left
    local name=$1 limit=$2 left=$((deadline - SECONDS)) t0=$SECONDS rc
    shift 2
    ((left < limit)) && limit=$left
    if ((limit < 15)); then
        echo "== $name: skipped, out of time"
        failed+=("$name(no time)")
        return 1
    fi
    echo "== $name (limit ${limit}s)"
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "== $name: rc=$rc after $((SECONDS - t0))s"
    ((rc == 0)) || failed+=("$name(rc=$rc)")
    return "$rc"
}

pytest_gpu() {  # pytest exits 5 when nothing is collected: no GPU tests there yet is fine
    "$py" -m pytest -q -rs -p no:cacheprovider "$@"
    local rc=$?
    ((rc == 5)) && return 0
    return "$rc"
}
export -f pytest_gpu
export py

# FlashInfer compiles its kernels on first use: nvcc from CUDA_HOME or PATH, and
# `ninja` from the interpreter's bin folder (the image's venv).
setup_env() {
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    local bin
    bin=$("$py" -c 'import os, sys; print(os.path.dirname(sys.executable))')
    export PATH="$bin:$PATH"
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
        export CUDA_HOME=/usr/local/cuda PATH="/usr/local/cuda/bin:$PATH"
    fi
    # three kernel builds run side by side; nvcc takes GBs of memory per job
    export MAX_JOBS=${MAX_JOBS:-6}
    # the checkout is importable even if the editable install fails
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

show_machine() {
    nvidia-smi
    command -v nvcc && nvcc --version | tail -2
    "$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
        "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")'
}

install() {
    shopt -s nullglob
    local wheels=(wheels/*.whl)
    if ((${#wheels[@]})); then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${wheels[@]}" || return 1
    else
        echo "no wheels/: run scripts/fetch_gpu_wheels.sh and carry wheels/"
    fi
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . || echo "editable install failed (PYTHONPATH has the checkout)"
    "$py" -m pip check || true  # informational: the wheels were installed without resolving
    "$py" -c 'import flashinfer, mesh; print("flashinfer", flashinfer.__version__)'
}

# Build the FlashInfer modules in parallel before the tests need them one by one:
# (dtype, head_dim) of the GPU tests (small model: 64) and the benchmark (128).
warm_kernels() {
    local pids=() rc=0 spec
    for spec in "bfloat16 64" "float16 64" "bfloat16 128"; do
        # shellcheck disable=SC2086
        "$py" - $spec <<'EOF' &
import sys, time, torch
from kvstore.cache import KVCache, KVCacheSpec
from mesh.engine.attention import AttentionBatch, create_backend
dtype, head_dim, t0 = getattr(torch, sys.argv[1]), int(sys.argv[2]), time.time()
kv = KVCache(KVCacheSpec(1, 4, 16, 1, head_dim, dtype), torch.device("cuda"))
attn = create_backend("flashinfer", kv, head_dim**-0.5)
for qlen in (2, 1):  # a prefill step, then a decode step: the same FA2 module serves both
    attn.plan(AttentionBatch([qlen], [2], [[0]], torch.arange(2 - qlen, 2, device="cuda")))
    x = torch.zeros(qlen, 1, head_dim, dtype=dtype, device="cuda")
    attn.forward(0, x, x, x)
torch.cuda.synchronize()
print(f"flashinfer {sys.argv[1]} head_dim {head_dim}: ready in {time.time() - t0:.0f}s")
EOF
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    return "$rc"
}
export -f setup_env show_machine install warm_kernels

want() {  # GPU_CHECK_PARTS: which parts run (default: all of transfer, flashinfer, engine)
    [[ " ${GPU_CHECK_PARTS:-transfer flashinfer engine} " == *" $1 "* ]]
}

main() {
    setup_env
    step machine 60 bash -c show_machine
    step install 120 bash -c install || { echo "install failed: nothing to test"; return 1; }
    # nvcc builds the FlashInfer kernels on the CPUs while the transports (which need none of
    # them: the tiny model runs the torch backend) are tested and measured on the GPU
    local warm_log=/tmp/warm_kernels.log
    step warm-kernels 300 bash -c warm_kernels >"$warm_log" 2>&1 &
    local warm_pid=$!
    if want transfer; then
        step gpu-transfer-tests 180 bash -c 'pytest_gpu tests/gpu/test_transfer_gpu.py -m gpu --junitxml "$0"' "$logdir/gpu_transfer_tests.xml"
        # GPU tests outside tests/gpu, by file: collecting all of tests/ needs the CPU suite's dev extras
        step gpu-marked-elsewhere 90 bash -c 'pytest_gpu -m gpu $(grep -rl --include="test_*.py" "mark.gpu" tests | grep -v "^tests/gpu/")'
        step bench-transfer-gpu 120 "$py" bench/transfer_gpu.py --json "$logdir/bench_transfer_gpu.json"
    fi
    wait "$warm_pid" || failed+=("warm-kernels")
    cat "$warm_log"
    if want flashinfer; then
        step gpu-tests 240 bash -c 'pytest_gpu tests/gpu -m gpu --ignore=tests/gpu/test_transfer_gpu.py --junitxml "$0"' "$logdir/gpu_tests.xml"
    fi
    if want engine; then
        step bench-engine 200 "$py" bench/engine.py --gpu --gpu-attention "${GPU_ATTENTION:-flashinfer:graphs,flashinfer,torch}" --gpu-profile 8 --json "$logdir/bench_engine.json"
    fi
    echo "== done in ${SECONDS}s; failed: ${failed[*]:-none}"
    ((${#failed[@]} == 0))
}

main 2>&1 | tee "$logdir/gpu_check.log"
exit "${PIPESTATUS[0]}"
