"""``mtp``: DeepSeek-V3's multi-token-prediction layer (``engine.mtp``) drafts greedily from the
target's hidden states.

The target keeps its last layer's output for every token it computes (``aux_layers`` is
``(num_layers,)``); the final norm makes it the layer's hidden state (``fuse``), as vLLM hands the
target's normed states to it. K drafts run the one layer K times, each on its own output before
the last, as vLLM does. Rows, head KV (a latent pool of one layer, as many blocks as the
target's) and the states of tokens computed elsewhere are ``engine.state_drafter``'s.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from engine.config import ModelConfig
from engine.eagle3 import configured_backend
from engine.loader import load_mtp_layer
from engine.model import CausalLM, use_kernels
from engine.mtp import MtpHead, check_mtp
from engine.parallel.group import RankGroup
from engine.state_drafter import StateDrafter
from kvstore.cache import KVCache

log = logging.getLogger(__name__)


class MtpDrafter(StateDrafter):
    name = "mtp"

    def __init__(self, target: ModelConfig, device: torch.device, dtype: torch.dtype, num_blocks: int,
                 block_size: int, backend: str):
        check_mtp(target, self.name)
        super().__init__(device, num_blocks, block_size, backend)
        self.aux_layers = (target.num_layers,)
        self.layer = load_mtp_layer(target, device, dtype)
        if target.mtp_layers > 1:
            log.info("%s has %d MTP layers: drafting with the first", target.path, target.mtp_layers)
        kv = KVCache(replace(target.kv_cache_spec(num_blocks, block_size, dtype), num_layers=1), device)
        self.attention = configured_backend(backend, kv, target.attention_scale, target.num_heads, dtype,
                                            target.latent_value_dim)

    def load(self, target: CausalLM, target_kv: KVCache, scratch_block: int, lora=None,
             ranks: RankGroup | None = None) -> None:
        """The head on the target's embeddings, rope tables, head and kernels, then
        ``StateDrafter.load``."""
        use_kernels(self.layer, target.kernels)
        self.head = MtpHead(self.layer, target)
        super().load(target, target_kv, scratch_block, lora, ranks)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return self.target.norm(aux)


def mtp_drafter(method: str | None, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                num_blocks: int, block_size: int, backend: str) -> MtpDrafter | None:
    """The drafter of ``mtp``, else None. Refused in one line: an argument, a checkpoint without an
    MTP layer (``engine.mtp.check_mtp``) or without its weights."""
    if (method or "").partition(":")[0] != "mtp":
        return None
    check_mtp(target, method)
    return MtpDrafter(target, device, dtype, num_blocks, block_size, backend)
