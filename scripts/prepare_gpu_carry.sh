#!/usr/bin/env bash
# Everything a GPU check's device call carries, made here, in the checkout that makes the call:
#
#   wheels/       what the device's image lacks (scripts/fetch_gpu_wheels.sh)
#   gpu_kernels/  the FlashInfer modules the check uses, built for sm_90a with this machine's
#                 nvcc (scripts/build_gpu_kernels.py, FlashInfer in build/flashinfer-site), then checked
#                 (scripts/check_gpu_kernels_load.py): FlashInfer called as the engine calls it
#                 finds each one prebuilt, and each loads under Python 3.12 with the device's
#                 apache-tvm-ffi wheel
#
# then the sizes against the 64 MiB a call carries (the checkout's files included). Both folders
# are git-ignored; the call names them: carry=["wheels", "gpu_kernels"] (bench/gpu_check.sh's
# header has the whole call). The kernel builds are heavy: nice'd, MAX_JOBS (default 2) at a
# time. On 2026-12-06 (2 cores at a load of 10-17): 8 modules, 10.4 MiB (6.0 MiB gzipped), the
# attention ones 14-26 min each, sampling 29 min, ~75 min in all; the whole call then carries
# 49.7 of its 64 MiB. Already built modules are kept (the manifest names the toolchain), so a
# rerun only checks (1.5 min); copying gpu_kernels/ from a checkout that built it does as well.
#
# Usage: scripts/prepare_gpu_carry.sh [--modules carried|first|KEY,...]   (default: carried)
set -euo pipefail
cd "$(dirname "$0")/.."
modules=carried
case ${1:-} in
    --modules) modules=${2:?--modules needs a value}; shift 2 ;;
    "") ;;
    *) echo "scripts/prepare_gpu_carry.sh: unknown argument $1 (--modules carried|first|KEY,...)" >&2; exit 2 ;;
esac
limit=$((64 * 1024 * 1024))
margin=$((2 * 1024 * 1024))  # files a session adds before the call (logs, notes)

bash scripts/fetch_gpu_wheels.sh wheels

# FlashInfer for the build: the wheel's, beside tvm-ffi of the same version for this Python, in
# build/flashinfer-site on top of the project's venv (its CPU torch: FlashInfer imports torch;
# the modules link only the CUDA runtime and tvm-ffi)
py=${PYTHON:-.venv/bin/python}
site=$PWD/build/flashinfer-site
fi_whl=$(ls wheels/flashinfer_python-*.whl)
tvm_version=$(basename wheels/apache_tvm_ffi-*.whl | cut -d- -f2)
if ! PYTHONPATH=$site "$py" -c 'import torch, flashinfer, tvm_ffi' 2>/dev/null; then
    "$py" -m pip install -q --target "$site" --no-deps "$fi_whl" "apache-tvm-ffi==$tvm_version" ninja einops \
        tabulate click nvidia-ml-py
fi
export PATH="$site/bin:$PATH"  # FlashInfer runs `ninja`
with_flashinfer() { PYTHONPATH=$site "$py" "$@"; }

tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
wheels=$(du -cb wheels/*.whl | tail -1 | cut -f1)
# what is left for the kernels; a module past it is left out (the device builds it, in the background)
room=$((limit - margin - tracked - wheels))
MAX_JOBS=${MAX_JOBS:-2} nice -n 10 env PYTHONPATH="$site" "$py" scripts/build_gpu_kernels.py --modules "$modules" \
    --max-bytes "$room"

# FlashInfer, called as the engine calls it, finds every module prebuilt in gpu_kernels/
with_flashinfer scripts/check_gpu_kernels_load.py lookup
# The device runs Python 3.12: load the modules under it, with the exact tvm-ffi wheel it installs,
# the driver's link stub (the toolkit's, or the one build_gpu_kernels.py made) standing in for libcuda.so.1
py312=
for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        py312=$candidate
        break
    fi
done
if [[ -n $py312 ]]; then
    loader=build/tvm-ffi-py312
    [[ -x $loader/bin/python ]] || { "$py312" -m venv "$loader" && "$loader/bin/pip" install -q --no-deps \
        wheels/apache_tvm_ffi-*.whl typing-extensions; }
    cuda=${CUDA_HOME:-/usr/local/cuda}
    driver=$cuda/lib64/stubs/libcuda.so
    [[ -e $driver ]] || driver=$PWD/build/cuda-driver-stub/libcuda.so
    stub=$(mktemp -d)
    ln -s "$driver" "$stub/libcuda.so.1"
    LD_LIBRARY_PATH="$stub:$cuda/lib64" "$loader/bin/python" scripts/check_gpu_kernels_load.py load
    rm -rf "$stub"
else
    echo "no python3.12 here: the modules' load under the device's Python is checked on the device only"
fi

kernels=$(du -cb gpu_kernels | tail -1 | cut -f1)
zipped=$(tar -cf - gpu_kernels | gzip -6 | wc -c)
total=$((tracked + wheels + kernels))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "carried: checkout $(mib "$tracked") + wheels $(mib "$wheels") + gpu_kernels $(mib "$kernels")" \
     "(gzip: $(mib "$zipped")) = $(mib "$total") of 64 MiB"
((total <= limit)) || { echo "over the 64 MiB a device call carries" >&2; exit 1; }
