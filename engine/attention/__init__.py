"""Attention backends behind one interface, chosen by name.

Contract: the runner calls ``plan(batch)`` once per engine step with the
step's layout, then ``forward(layer, q, k, v)`` once per layer. ``forward``
writes this step's ``k``/``v`` into the layer's paged cache at
``batch.slot_mapping`` and returns, for every query token, attention over its
sequence's whole context (cached tokens plus this step's, causal within the
step). Shapes: ``q [T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]``, output ``[T, Hq, D]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.cache import KVCache


@dataclass
class AttentionBatch:
    """One step's layout, in scheduling order: sequence i owns ``query_lens[i]`` consecutive rows."""

    query_lens: list[int]
    context_lens: list[int]  # tokens of the sequence in the cache once this step's are written
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) per query token

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())

    @property
    def is_pure_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class AttentionBackend(Protocol):
    name: str

    def plan(self, batch: AttentionBatch) -> None: ...

    # Optional: ``configure(num_qo_heads, q_dtype)``, called once by the runner, lets a backend do
    # all of a step's host work in ``plan`` (so none is left for the first layer's ``forward``).

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


BackendFactory = Callable[[KVCache, float], AttentionBackend]
_REGISTRY: dict[str, BackendFactory] = {}


def register(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def deco(factory: BackendFactory) -> BackendFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def backend_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def create_backend(name: str, kv: KVCache, scale: float) -> AttentionBackend:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name](kv, scale)


def default_backend(device: torch.device, head_dim: int, dtype: torch.dtype) -> str:
    """FlashInfer on CUDA when it is installed and serves this head size and dtype; else torch."""
    if device.type != "cuda":
        return "torch"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "torch"
    from engine.attention.flashinfer_backend import supports

    return "flashinfer" if supports(head_dim, dtype) else "torch"


def _load_builtin() -> None:
    # Importing registers them; flashinfer itself is imported lazily on first use.
    from engine.attention import flashinfer_backend, flashinfer_ragged, torch_paged  # noqa: F401
