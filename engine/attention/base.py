"""The interface every attention backend implements, and the registry of backends by name.

Contract: the runner calls ``plan(batch)`` once per engine step with the
step's layout, then ``forward(layer, q, k, v)`` once per layer. ``forward``
writes this step's ``k``/``v`` into the layer's paged cache at
``batch.slot_mapping`` and returns, for every query token, attention over its
sequence's whole context (cached tokens plus this step's, causal within the
step). Shapes: ``q [T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]``, output ``[T, Hq, D]``.

Latent attention (MLA, ``engine.mla``) has a contract of its own, the absorbed form
FlashInfer's MLA kernels take: ``forward(layer, q, latent)`` with ``q [T, Hq, C + R]``
(each head's query with ``kv_b_proj``'s key part folded in, then its rotated rope part)
and ``latent [T, C + R]`` (the token's normalised latent, then its rotated rope key: one
vector for every head, what the cache's single plane holds per token). It writes
``latent`` at the slots and returns ``[T, Hq, C]``: attention over the context with the
latent as every head's value (``kv_b_proj``'s value part is applied after). ``C`` is
the factory's ``value_dim``. Latent backends register with ``@register_latent(name)``;
a latent cache (``spec.num_planes == 1``) gets the latent backend of the asked name.

A backend module registers its factory with ``@register(name)`` when it is
imported; ``engine.attention`` imports the built-in ones and looks them up.
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


class LatentAttentionBackend(Protocol):
    """Multi-head latent attention over a latent cache, in the absorbed form (see above)."""

    name: str

    def plan(self, batch: AttentionBatch) -> None: ...

    def forward(self, layer: int, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor: ...


BackendFactory = Callable[[KVCache, float], AttentionBackend]
LatentBackendFactory = Callable[[KVCache, float, int], LatentAttentionBackend]  # (kv, scale, value_dim)
BACKENDS: dict[str, BackendFactory] = {}  # by name, filled by @register as the backend modules load
LATENT_BACKENDS: dict[str, LatentBackendFactory] = {}  # likewise, by @register_latent


def register(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def deco(factory: BackendFactory) -> BackendFactory:
        BACKENDS[name] = factory
        return factory

    return deco


def register_latent(name: str) -> Callable[[LatentBackendFactory], LatentBackendFactory]:
    def deco(factory: LatentBackendFactory) -> LatentBackendFactory:
        LATENT_BACKENDS[name] = factory
        return factory

    return deco
