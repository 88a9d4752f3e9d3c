"""Attention backends behind one interface (``engine.attention.base``), chosen by name.

Importing this package registers the built-in backends (``torch``, ``flashinfer``,
``flashinfer-ragged``, and the latent ones for MLA: ``torch``, ``flashinfer``); flashinfer
itself is imported only when one of its backends is made. A backend name names an
implementation; whether it runs K/V or latent attention follows the cache it is given.
"""

from __future__ import annotations

import torch

from engine.attention import flashinfer_ragged, mla_flashinfer, mla_torch, torch_paged  # noqa: F401  (registers them)
from engine.attention.base import (
    BACKENDS,
    LATENT_BACKENDS,
    AttentionBackend,
    AttentionBatch,
    BackendFactory,
    LatentAttentionBackend,
    register,
    register_latent,
)
from engine.attention.flashinfer_backend import supports
from kvstore.cache import LATENT_PLANES, KVCache

__all__ = ["AttentionBackend", "AttentionBatch", "BackendFactory", "LatentAttentionBackend", "backend_names",
           "create_backend", "default_backend", "register", "register_latent"]


def backend_names() -> list[str]:
    return sorted(BACKENDS.keys() | LATENT_BACKENDS.keys())


def create_backend(name: str, kv: KVCache, scale: float,
                   value_dim: int = 0) -> AttentionBackend | LatentAttentionBackend:
    """The backend ``name`` over ``kv``: K/V attention, or latent attention over a latent cache
    (``value_dim``: the latent's share of each cached vector, MLA's ``kv_lora_rank``)."""
    if kv.spec.num_planes == LATENT_PLANES:
        if name not in LATENT_BACKENDS:
            raise ValueError(f"attention backend {name!r} does not serve latent (MLA) caches "
                             f"(choose from {', '.join(sorted(LATENT_BACKENDS))})")
        return LATENT_BACKENDS[name](kv, scale, value_dim)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(sorted(BACKENDS))})")
    return BACKENDS[name](kv, scale)


def default_backend(device: torch.device, head_dim: int, dtype: torch.dtype,
                    latent: tuple[int, int] | None = None) -> str:
    """FlashInfer on CUDA when it is installed and serves this head size and dtype (``latent``:
    an MLA model's (latent, rope) dims); else torch."""
    if device.type != "cuda":
        return "torch"
    try:
        import flashinfer  # noqa: F401  (a probe: is it installed here)
    except ImportError:
        return "torch"
    if latent is not None:
        return "flashinfer" if mla_flashinfer.supports(*latent, dtype) else "torch"
    return "flashinfer" if supports(head_dim, dtype) else "torch"
