"""Tensor parallelism: how a rank's share of a layer is cut, and how the shares' partial sums meet.

Megatron-style sharding (``Shard``): each rank of a stage's TP group holds ``1/tp`` of the
attention heads (query and KV alike: its slice of ``qkv_proj``, its share of the KV cache) and
of the MLP columns; ``o_proj`` and ``down_proj`` are row-parallel, so their partial sums meet
in one all-reduce each per layer. Embeddings, norms and ``lm_head`` are replicated (small next
to the layers, and it keeps sampling on rank 0 with no gather).

The ranks themselves (who starts them, how they meet, what each step sends them) are
``engine.parallel``: a worker's layout is TP x PP, and a TP group is one stage's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Shard:
    """Which slice of the model this process holds, and how partial sums meet."""

    rank: int = 0  # within its TP group (its stage's ranks)
    size: int = 1
    group: object | None = None  # the TP group's process group; joined once every rank has its weights

    def part(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's share of ``n`` heads or columns."""
        per = n // self.size
        return self.rank * per, per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x
