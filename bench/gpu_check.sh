#!/usr/bin/env bash
# The GPU check, for a lent CUDA machine (H200 image: Python 3.12, torch 2.11 on
# CUDA 13, nvcc, ninja; no network). From the repository root, with wheels/
# carried along (scripts/fetch_gpu_wheels.sh fills it):
#
#     GPU_CHECK_PARTS="kernels tests bench" bash bench/gpu_check.sh
#                         # device tool: carry ["wheels"], timeout_s 540: issue 21's check
#     bash bench/gpu_check.sh                    # everything, the KV transports too
#
# It installs the carried wheels and the project (never torch), builds the
# FlashInfer kernels the tests and benchmarks need, runs the GPU tests and the
# GPU benchmarks. Output goes to $OUT (the device tool brings back at most 8
# files) or bench/out/gpu: gpu_check.log, gpu_tests.xml, bench_engine.json.
# Each step has a time limit, and all share one deadline (GPU_CHECK_SECONDS,
# default 480), so the whole check ends inside 8 minutes even when a step hangs.
#
# Parts (GPU_CHECK_PARTS, space-separated; default: all):
#   transfer   the KV transport tests and python -m bench transfer-gpu
#   kernels    JIT-build every FlashInfer module the tests and benchmarks use, in parallel
#              (attention FA2 per dtype/head size; fused norm, activation, rope, sampling, merge)
#   tests      tests/gpu except the transports (GPU_TESTS: other paths or a -k expression)
#   bench      python -m bench engine-gpu: issue 21's table (GPU_BENCH_ARGS: extra arguments)
#   (flashinfer and engine are the old names of tests and bench)
# Built kernels go to bench/out/flashinfer, which the device tool keeps between
# calls while the machine stays warm: a rerun of one part skips the builds, and
# the install is skipped when the packages are already there.
#
# Rerun of what failed, on the same warm machine, e.g.:
#   GPU_CHECK_PARTS=bench GPU_BENCH_ARGS="--gpu-modes eager,graphs+overlap" bash bench/gpu_check.sh
#   GPU_CHECK_PARTS=tests GPU_TESTS="tests/gpu/test_graphs_overlap.py" bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
logdir=${OUT:-bench/out/gpu}
mkdir -p "$logdir"
py=${PYTHON:-python3}
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-480}))
failed=()
parts=" ${GPU_CHECK_PARTS:-transfer kernels tests bench} "
parts=${parts// flashinfer / tests }
parts=${parts// engine / bench }

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
    # -v: each test named as it ends, so a step cut off by its time limit still says which failed
    "$py" -m pytest -v -rs -p no:cacheprovider "$@"
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
    # several kernel builds run side by side; nvcc takes GBs of memory per job
    export MAX_JOBS=${MAX_JOBS:-4}
    # kept between calls on a warm machine (bench/out is git-ignored: the device tool leaves it)
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/bench/out/flashinfer}
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
    if "$py" -c 'import flashinfer, nats, pytest_asyncio, mesh' 2>/dev/null; then
        echo "already installed (a warm machine): flashinfer $("$py" -c 'import flashinfer; print(flashinfer.__version__)')"
        return 0
    fi
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
# attention for (dtype, head_dim) of the GPU tests (small model: 64) and the benchmark (128),
# and the fused-kernel modules (--fused-kernels, flashinfer-ragged's merge).
warm_kernels() {
    local pids=() rc=0 spec
    for spec in "attention bfloat16 64" "attention float16 64" "attention bfloat16 128" "fused bfloat16 128"; do
        # shellcheck disable=SC2086
        "$py" - $spec <<'EOF' &
import sys, time, torch
what, dtype, head_dim, t0 = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), time.time()
cuda = torch.device("cuda")
if what == "attention":
    from kvstore.cache import KVCache, KVCacheSpec
    from engine.attention import AttentionBatch, create_backend
    kv = KVCache(KVCacheSpec(1, 4, 16, 1, head_dim, dtype), cuda)
    for name in ("flashinfer", "flashinfer-ragged"):  # one FA2 module serves paged, ragged and decode
        attn = create_backend(name, kv, head_dim**-0.5)
        for qlen, ctx in ((2, 2), (1, 2), (2, 3)):  # prefill, decode, a chunk after a prefix
            attn.plan(AttentionBatch([qlen], [ctx], [[0]], torch.arange(ctx - qlen, ctx, device=cuda)))
            x = torch.zeros(qlen, 1, head_dim, dtype=dtype, device=cuda)
            attn.forward(0, x, x, x)
else:
    from engine import kernels as k
    x = torch.randn(4, 1024, dtype=dtype, device=cuda)
    k.flashinfer_add_rmsnorm(x.clone(), x.clone(), torch.ones(1024, dtype=dtype, device=cuda), 1e-5)
    k.flashinfer_silu_and_mul(torch.randn(4, 2048, dtype=dtype, device=cuda))
    cache = torch.randn(64, head_dim, device=cuda)
    q, kk = torch.randn(4, 4, head_dim, dtype=dtype, device=cuda), torch.randn(4, 2, head_dim, dtype=dtype, device=cuda)
    k.FlashInferRope(cache, torch.arange(4, device=cuda)).rotate_qk(q, kk)
    gen = torch.Generator(device=cuda).manual_seed(0)
    k.flashinfer_top_k_top_p(torch.randn(4, 100, device=cuda), torch.full((4,), 5, dtype=torch.int32, device=cuda),
                             torch.full((4,), 0.9, device=cuda), gen)
torch.cuda.synchronize()
print(f"flashinfer {what} {sys.argv[2]} head_dim {head_dim}: ready in {time.time() - t0:.0f}s")
EOF
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    return "$rc"
}
export -f setup_env show_machine install warm_kernels

want() {
    [[ "$parts" == *" $1 "* ]]
}

main() {
    setup_env
    echo "== parts:$parts"
    step machine 60 bash -c show_machine
    step install 120 bash -c install || { echo "install failed: nothing to test"; return 1; }
    # nvcc builds the FlashInfer kernels on the CPUs while the transports (which need none of
    # them: the tiny model runs the torch backend) are tested and measured on the GPU
    local warm_pid=
    local warm_log=/tmp/warm_kernels.log
    if want kernels; then
        step warm-kernels 300 bash -c warm_kernels >"$warm_log" 2>&1 &
        warm_pid=$!
    fi
    if want transfer; then
        step gpu-transfer-tests 180 bash -c 'pytest_gpu tests/gpu/test_transfer_gpu.py -m gpu --junitxml "$0"' "$logdir/gpu_transfer_tests.xml"
        # GPU tests outside tests/gpu, by file: collecting all of tests/ needs the CPU suite's dev extras
        step gpu-marked-elsewhere 90 bash -c 'pytest_gpu -m gpu $(grep -rl --include="test_*.py" "mark.gpu" tests | grep -v "^tests/gpu/")'
        step bench-transfer-gpu 120 "$py" -m bench transfer-gpu --json "$logdir/bench_transfer_gpu.json"
    fi
    if [[ -n "$warm_pid" ]]; then
        wait "$warm_pid" || failed+=("warm-kernels")
        cat "$warm_log"
    fi
    if want tests; then
        # shellcheck disable=SC2086
        step gpu-tests 240 bash -c 'pytest_gpu ${GPU_TESTS:-tests/gpu --ignore=tests/gpu/test_transfer_gpu.py} -m gpu --junitxml "$0"' "$logdir/gpu_tests.xml"
    fi
    if want bench; then
        # shellcheck disable=SC2086
        step bench-engine 240 "$py" -m bench engine-gpu --gpu-new-tokens 64 --gpu-profile 8 ${GPU_BENCH_ARGS:-} --json "$logdir/bench_engine.json"
    fi
    echo "== done in ${SECONDS}s; failed: ${failed[*]:-none}"
    ((${#failed[@]} == 0))
}

main 2>&1 | tee "$logdir/gpu_check.log"
exit "${PIPESTATUS[0]}"
