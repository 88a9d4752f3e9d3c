"""One LoRA adapter as the engine holds it: read and checked (``engine.lora.read_adapter``), in
host memory, its weights per fused projection with the scale folded in.

A value type of its own because both sides of multi-LoRA hold adapters: ``engine.lora`` reads
and registers them, ``engine.lora_layers`` copies them into its device slots, and a
``Sequence`` keeps the one it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class SliceWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], the scale folded in


@dataclass(eq=False)
class LoraAdapter:
    """One adapter, read and checked, in host memory. Compared by identity (a name may be
    loaded again later as a new object)."""

    name: str
    path: Path
    fingerprint: str  # of the weights and config bytes
    rank: int  # the largest rank of any module
    # (layer, group) -> one entry per slice of the fused projection (None: slice not targeted)
    weights: dict[tuple[int, str], tuple[SliceWeights | None, ...]] = field(repr=False, default_factory=dict)

    @property
    def groups(self) -> set[str]:
        return {group for _, group in self.weights}
