"""The interface every attention backend implements, and the registry of backends by name.

Contract: the runner calls ``plan(batch)`` once per engine step with the
step's layout, then ``forward(layer, q, k, v)`` once per layer. ``forward``
writes this step's ``k``/``v`` into the layer's paged cache at
``batch.slot_mapping`` and returns, for every query token, attention over its
sequence's whole context (cached tokens plus this step's, causal within the
step). Shapes: ``q [T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]``, output ``[T, Hq, D]``.

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


BackendFactory = Callable[[KVCache, float], AttentionBackend]
BACKENDS: dict[str, BackendFactory] = {}  # by name, filled by @register as the backend modules load


def register(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def deco(factory: BackendFactory) -> BackendFactory:
        BACKENDS[name] = factory
        return factory

    return deco
