"""Attention backends behind one interface (``engine.attention.base``), chosen by name.

Importing this package registers the built-in backends (``torch``, ``flashinfer``,
``flashinfer-ragged``); flashinfer itself is imported only when one of its backends is made.
"""

from __future__ import annotations

import torch

from engine.attention import flashinfer_ragged, torch_paged  # noqa: F401  (importing registers them)
from engine.attention.base import (
    BACKENDS,
    AttentionBackend,
    AttentionBatch,
    BackendFactory,
    register,
)
from engine.attention.flashinfer_backend import supports
from kvstore.cache import KVCache

__all__ = ["AttentionBackend", "AttentionBatch", "BackendFactory", "backend_names", "create_backend",
           "default_backend", "register"]


def backend_names() -> list[str]:
    return sorted(BACKENDS)


def create_backend(name: str, kv: KVCache, scale: float) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(sorted(BACKENDS))})")
    return BACKENDS[name](kv, scale)


def default_backend(device: torch.device, head_dim: int, dtype: torch.dtype) -> str:
    """FlashInfer on CUDA when it is installed and serves this head size and dtype; else torch."""
    if device.type != "cuda":
        return "torch"
    try:
        import flashinfer  # noqa: F401  (a probe: is it installed here)
    except ImportError:
        return "torch"
    return "flashinfer" if supports(head_dim, dtype) else "torch"
