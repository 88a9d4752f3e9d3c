"""``eagle3:DIR``: an EAGLE-3 head (``engine.eagle3``) drafts greedily from the target's hidden states.

The target keeps the inputs of the head's auxiliary layers for every token it computes; the
head's ``fc`` fuses them into its hidden states. What rows keep, how the head runs over them,
and how states of tokens computed elsewhere are rebuilt is ``engine.state_drafter``'s (MTP's
too).
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.eagle3 import Eagle3Config, configured_backend, load_head
from engine.model import CausalLM
from engine.parallel.group import RankGroup
from engine.state_drafter import StateDrafter
from kvstore.cache import KVCache, KVCacheSpec


class Eagle3Drafter(StateDrafter):
    name = "eagle3"

    def __init__(self, ckpt_dir: str, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, backend: str):
        super().__init__(device, num_blocks, block_size, backend)
        self.config = cfg = Eagle3Config.from_dir(ckpt_dir, target)
        self.aux_layers = cfg.aux_layers
        self.target_config = target
        self.dtype = dtype
        spec = KVCacheSpec(1, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        self.attention = configured_backend(backend, KVCache(spec, device), cfg.head_dim**-0.5, cfg.num_heads, dtype)

    def load(self, target: CausalLM, target_kv: KVCache, scratch_block: int, lora=None,
             ranks: RankGroup | None = None) -> None:
        """The head (with the target's embeddings where the checkpoint has none), then
        ``StateDrafter.load``."""
        self.head = load_head(self.config, target.embed_tokens, self.device, self.dtype,
                              target.rotary.cos.shape[0])
        super().load(target, target_kv, scratch_block, lora, ranks)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return self.head.fc(aux)


def eagle3_drafter(method: str | None, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                   num_blocks: int, block_size: int, backend: str) -> Eagle3Drafter | None:
    """The drafter of ``eagle3:DIR``, else None. Refused in one line: no directory, a checkpoint
    for another target (hidden size, vocabulary)."""
    name, _, arg = (method or "").partition(":")
    if name != "eagle3":
        return None
    if not arg:
        raise ValueError("--speculative eagle3:DIR needs the EAGLE-3 checkpoint's directory")
    return Eagle3Drafter(arg, target, device, dtype, num_blocks, block_size, backend)
