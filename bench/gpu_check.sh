#!/usr/bin/env bash
# The GPU check: every answer a lent GPU machine can give pdmesh, in one call, ordered by value,
# inside 9 minutes on an H200, every part reported in one JSON.
#
# The device call (the device tool's `run`). Prepare first, in the checkout that makes the call
# (the device gets that checkout): `bash scripts/prepare_gpu_carry.sh` fills wheels/ (35.7 MiB)
# and gpu_kernels/ (8 FlashInfer modules for sm_90a, 10.4 MiB; ~75 min of nvcc here, or copy the
# folder from a checkout that built it: the script then only checks it), both git-ignored:
#
#     run(command="bash bench/gpu_check.sh", carry=["wheels", "gpu_kernels"], timeout_s=570,
#         kind="nvidia-h200")
#
# It ends by its own deadline (GPU_CHECK_SECONDS, default 525 s) before the tool's 570 s, and
# leaves ~4 of the session's 15 device minutes (after a ~1-2 min start) for one rerun of a part
# on the still-warm machine (it goes back after 30 s idle), e.g.
#     run(command="GPU_CHECK_SECONDS=200 GPU_CHECK_PARTS=tests GPU_TESTS=tests/gpu/test_graphs_overlap.py
#         bash bench/gpu_check.sh", carry=["wheels", "gpu_kernels"], timeout_s=230)
#
# Parts (GPU_CHECK_PARTS, space-separated; default engine tests transfer, always in this order):
#   engine    python -m bench engine-gpu: the roofline table for eager, graphs, graphs+overlap,
#             graphs+overlap+fused, and a torch.profiler breakdown of a decode step per mode
#             (GPU_BENCH_ARGS: extra arguments)
#   tests     tests/gpu but the transports and MoE, pytest -v (each test named as it ends),
#             a 120 s limit per test, junit XML (GPU_TESTS: other paths or a -k expression)
#   transfer  python -m bench transfer-gpu, the KV transport tests, the GPU tests outside tests/gpu
#   moe       (opt-in) tests/gpu/test_moe_gpu.py, once FlashInfer's fused MoE module has been built
#             in the background since the setup: 182 CUTLASS sources, more nvcc than a lease
#             holds, and too large to carry, so it is in no default run
# Setup before the parts: the machine, the carried wheels installed (never torch), the carried
# FlashInfer modules checked and loaded (gpu_kernels/manifest.json; a module that does not load
# is removed and built on the device instead), and the background build of what is not carried.
#
# Each step runs under a time limit that keeps time for the parts after it (their minimum), so a
# part that hangs costs its own limit and the next still runs. Back under $OUT (else
# bench/out/gpu), at most 8 files: gpu_check.json (per part: status, seconds, commands, figures
# or the failures named; rewritten after every part), gpu_check.log, gpu_tests.xml,
# gpu_transfer_tests.xml, gpu_tests_moe.xml, bench_engine_gpu.json, bench_transfer_gpu.json.
#
#   bash bench/gpu_check.sh --dry-run     on a CPU (CI): imports, arguments, every part's command
#                                         and its dry mode, the manifest read, the JSON's real shape
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

dry=0
for arg in "$@"; do
    case $arg in
        --dry-run) dry=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench/gpu_check.sh: unknown argument $arg (--dry-run, --help)" >&2; exit 2 ;;
    esac
done
out=${OUT:-bench/out/gpu}
mkdir -p "$out" || exit 1
py=${PYTHON:-python3}
budget=${GPU_CHECK_SECONDS:-525}
deadline=$((SECONDS + budget))
parts=" ${GPU_CHECK_PARTS:-engine tests transfer} "
for p in $parts; do
    case $p in engine|tests|transfer|moe) ;; *)
        echo "bench/gpu_check.sh: unknown part $p in GPU_CHECK_PARTS (engine tests transfer moe)" >&2; exit 2 ;;
    esac
done
kernels_dir=${GPU_KERNELS_DIR:-$PWD/gpu_kernels}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
mkdir -p "$work/steps"
# the minimum each part needs: a step before it (the setup's too) keeps this much of the deadline for it
declare -A keep=([engine]=120 [tests]=100 [transfer]=80 [moe]=0)

want() { [[ "$parts" == *" $1 "* ]]; }

reserve_after() {  # seconds the wanted parts after $1 (a part, or setup: before them all) keep for themselves
    local later=0 seen=0 p
    [[ $1 == setup ]] && seen=1
    for p in engine tests transfer moe; do
        ((seen)) && want "$p" && later=$((later + keep[$p]))
        [[ $p == "$1" ]] && seen=1
    done
    echo "$later"
}

step() {  # step NAME PART LIMIT COMMAND...: COMMAND within LIMIT, the time left and the later parts' share
    local name=$1 part=$2 limit=$3 t0=$SECONDS rc left
    shift 3
    left=$((deadline - SECONDS - $(reserve_after "$part")))
    ((left < limit)) && limit=$left
    if ((limit < 15)); then
        echo "== $name: not run, out of time"
        printf '%s\t-\t0\t0\t%s\n' "$name" "$*" >>"$work/steps.tsv"
        return 1
    fi
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$work/steps/$name.out"
    rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc after $((SECONDS - t0))s"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" "$*" >>"$work/steps.tsv"
    return "$rc"
}

report() {
    local flag=()
    ((dry)) && flag=(--dry-run)
    "$py" -m bench.gpu.check_report "$work" "$out/gpu_check.json" "${flag[@]}"
}

gpu_tests_elsewhere() {  # GPU tests outside tests/gpu, by file: collecting all of tests/ needs the dev extras
    local files
    files=$(grep -rl --include="test_*.py" "mark.gpu" tests | grep -v "^tests/gpu/" | sort)
    [[ -z $files ]] && { echo "no GPU tests outside tests/gpu"; return 0; }
    # shellcheck disable=SC2086
    pytest_gpu -m gpu $files
}

wait_for_build() {  # wait_for_build PID LOG: until the background build ends, its progress every 30 s
    local n=0
    while kill -0 "$1" 2>/dev/null; do
        sleep 2
        ((++n % 15 == 0)) && echo "still building: $(tail -1 "$2")"
    done
    cat "$2"
}

pytest_gpu() {  # pytest exits 5 when it collects nothing: no GPU tests there is not a failure
    # only the plugins the GPU tests use: the image's others (hypothesis, cov, xdist...) cost
    # seconds a run; -v names each test as it ends, --timeout fails a hung one and goes on; not
    # the project's addopts (the suite's xdist flags: xdist is not loaded here, and one GPU runs serially)
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$py" -m pytest -p pytest_asyncio.plugin -p pytest_timeout -o addopts= \
        -v -rs -p no:cacheprovider --timeout 120 --durations 15 "$@"
    local rc=$?
    ((rc == 5)) && return 0
    return "$rc"
}

setup_env() {
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    local bin
    bin=$("$py" -c 'import os, sys; print(os.path.dirname(sys.executable))')
    export PATH="$bin:$PATH"  # FlashInfer's builds run `ninja` from the interpreter's bin folder
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
        export CUDA_HOME=/usr/local/cuda PATH="/usr/local/cuda/bin:$PATH"
    fi
    # modules built on the device stay there while the machine is warm (bench/out is git-ignored)
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/bench/out/flashinfer}
    # the checkout importable even if the editable install fails; the carried modules' finder
    export PYTHONPATH="$PWD:$kernels_dir${PYTHONPATH:+:$PYTHONPATH}"
    export GPU_KERNELS_DIR=$kernels_dir
}

show_machine() {
    if ((dry)); then
        echo "dry run: no nvidia-smi; $("$py" -c 'import sys, importlib.metadata as m; print("python", sys.version.split()[0], "torch", m.version("torch"))')"
        return 0
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    command -v nvcc >/dev/null && nvcc --version | tail -2
    "$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
        torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")'
}

install() {
    shopt -s nullglob
    local wheels=(wheels/*.whl)
    if ((dry)); then
        echo "dry run: would install ${#wheels[@]} wheels ($(du -cm "${wheels[@]}" /dev/null | tail -1 | cut -f1) MiB) and the project, --no-deps"
        "$py" -c 'import mesh, engine, kvstore, bench.gpu.check_report; print("the project imports")'
        return
    fi
    if "$py" -c 'import flashinfer, nats, pytest_asyncio, mesh' 2>/dev/null; then
        echo "already installed (a warm machine)"
        return 0
    fi
    if ((${#wheels[@]})); then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${wheels[@]}" || return 1
    else
        echo "no wheels/: run scripts/prepare_gpu_carry.sh and carry wheels"
    fi
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . || echo "editable install failed (PYTHONPATH has the checkout)"
    "$py" -c 'import flashinfer, mesh; print("flashinfer", flashinfer.__version__)'
}

hbm_tbps() {  # the roofline's bandwidth: the card's datasheet figure
    ((dry)) && { echo 4.8; return; }
    case $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) in
        *H100*) echo 3.35 ;;
        *) echo 4.8 ;;
    esac
}

write_meta() {
    local device="CPU (dry run)"
    ((dry)) || device=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)
    "$py" - "$work/meta.json" "$budget" "$parts" "$(git rev-parse HEAD 2>/dev/null || echo unknown)" "$device" \
        "$(hbm_tbps)" "$FLASHINFER_WORKSPACE_BASE" <<'EOF'
import json, sys, time
path, budget, parts, commit, device, hbm, workspace = sys.argv[1:]
json.dump({"device": device, "hbm_tb_s": float(hbm), "deadline_s": int(budget), "parts_asked": parts.split(),
           "commit": commit, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "flashinfer_workspace": workspace},
          open(path, "w"))
EOF
}

export -f pytest_gpu gpu_tests_elsewhere wait_for_build show_machine install
export py dry

main() {
    setup_env
    write_meta
    echo "== parts:$parts; deadline ${budget}s; results $out/gpu_check.json; work $work"
    step machine setup 60 bash -c show_machine
    if ! step install setup 150 bash -c install; then
        echo "install failed: the parts cannot run"
        report
        return 1
    fi

    # the carried FlashInfer modules: checked against the manifest and loaded (dry run: files only)
    local load=() bg_pid= bg_keys
    ((dry)) && load=(--no-load)
    step kernels setup 60 "$py" -m bench.gpu.flashinfer_modules verify "${load[@]}" --json "$work/kernels_verify.json"
    # what is not carried (or did not load) builds in the background, niced, while the parts run;
    # FlashInfer's file lock makes a part that needs a module still building wait for it
    bg_keys=$("$py" - "$work/kernels_verify.json" "$(want moe && echo 1 || echo 0)" <<'EOF'
import json, sys
from bench.gpu.flashinfer_modules import MODULES
try:
    loaded = set(json.load(open(sys.argv[1]))["loaded"])
except (OSError, ValueError, KeyError):
    loaded = set()
print(",".join(m.key for m in MODULES if m.key not in loaded and (m.carried or sys.argv[2] == "1")))
EOF
)
    local bg=(nice -n 19 env "MAX_JOBS=${GPU_CHECK_BUILD_JOBS:-8}" "$py" -m bench.gpu.flashinfer_modules build
              --modules "$bg_keys" --json "$work/kernels_build.json")
    if [[ -z $bg_keys ]]; then
        echo "== kernels-build: nothing to build, every module the parts use loaded from gpu_kernels/"
    elif ((dry)); then
        echo "== kernels-build (background; not in a dry run): ${bg[*]}"
    else
        "${bg[@]}" >"$work/steps/kernels-build.out" 2>&1 &
        bg_pid=$!
        echo "== kernels-build: background pid $bg_pid: ${bg[*]}"
    fi
    report

    local dry_flag=()
    ((dry)) && dry_flag=(--dry-run)
    if want engine; then
        # batch 64 first: the issue's figure, and the batch each mode's profile runs
        # shellcheck disable=SC2086
        step bench-engine engine 260 "$py" -m bench engine-gpu "${dry_flag[@]}" --gpu-batches 64,1,256 \
            --gpu-new-tokens 64 --gpu-profile 8 --hbm-tbps "$(hbm_tbps)" ${GPU_BENCH_ARGS:-} \
            --json "$out/bench_engine_gpu.json"
        report
    fi
    if want tests; then
        # shellcheck disable=SC2086
        step gpu-tests tests 200 bash -c 'pytest_gpu "$@"' _ ${GPU_TESTS:-tests/gpu --ignore=tests/gpu/test_transfer_gpu.py \
            --ignore=tests/gpu/test_moe_gpu.py} -m gpu --junitxml "$out/gpu_tests.xml"
        report
    fi
    if want transfer; then
        # the figures first: the transports' tests passed on 2026-12-04
        step bench-transfer-gpu transfer 120 "$py" -m bench transfer-gpu "${dry_flag[@]}" --json "$out/bench_transfer_gpu.json"
        step transfer-tests transfer 120 bash -c 'pytest_gpu "$@"' _ tests/gpu/test_transfer_gpu.py -m gpu \
            --junitxml "$out/gpu_transfer_tests.xml"
        step gpu-marked-elsewhere transfer 60 bash -c gpu_tests_elsewhere
        report
    fi
    if want moe; then
        # the tests only once the module is built: waiting on FlashInfer's lock would lose their report
        if [[ -z $bg_pid ]] || step moe-build-wait moe 400 bash -c 'wait_for_build "$@"' _ "$bg_pid" \
                "$work/steps/kernels-build.out"; then
            step moe-tests moe 120 bash -c 'pytest_gpu "$@"' _ tests/gpu/test_moe_gpu.py -m gpu \
                --junitxml "$out/gpu_tests_moe.xml"
        fi
    fi
    [[ -n $bg_pid ]] && kill -- "$bg_pid" 2>/dev/null
    report
    echo "== done in ${SECONDS}s"
    "$py" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$out/gpu_check.json"
}

main 2>&1 | tee "$out/gpu_check.log"
rc=${PIPESTATUS[0]}
rm -rf "$work"
exit "$rc"
