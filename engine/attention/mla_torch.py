"""Latent attention (MLA) in plain PyTorch: the CPU backend and the numerical reference.

In the absorbed form every head attends over the same cached vector per token, so MLA is
multi-query attention with one KV head: keys are the whole cached vector (latent, then rope
key: ``C + R`` values), values its first ``C`` (a view of the same pages, no copy). The paged
batching is ``TorchPagedAttention``'s (decode rows in one SDPA, prefill chunks one each,
short verification rows with the decode rows); only the cache write and the views differ.
"""

from __future__ import annotations

import torch

from engine.attention.base import register_latent
from engine.attention.torch_paged import TorchPagedAttention
from kvstore.cache import KVCache


class TorchLatentAttention(TorchPagedAttention):
    name = "torch"

    def __init__(self, kv: KVCache, scale: float, value_dim: int):
        super().__init__(kv, scale)
        if not 0 < value_dim < kv.spec.head_dim:
            raise ValueError(f"a latent of {value_dim} values does not fit cache vectors of {kv.spec.head_dim}")
        self.value_dim = value_dim

    def forward(self, layer: int, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        pages = self.kv.latent(layer)  # [blocks, block_size, 1, C + R]
        pages.view(-1, pages.shape[-1]).index_copy_(0, self._slots, latent)
        return self.attend(q, pages, pages[..., : self.value_dim])


@register_latent("torch")
def _make(kv: KVCache, scale: float, value_dim: int) -> TorchLatentAttention:
    return TorchLatentAttention(kv, scale, value_dim)
