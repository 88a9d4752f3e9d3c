"""A worker card's ``layout``: how its model is cut over its ranks. A part of ``WorkerCard``
(``mesh.protocol`` re-exports it; ``docs/protocol.md`` documents it with the card), in a module
of its own to keep ``mesh/protocol.py`` on one screen's budget; like every ``Part``, a plain map
with its fields at their default left out."""

from __future__ import annotations

import msgspec
from msgspec import field


class WorkerLayout(msgspec.Struct, omit_defaults=True):
    """How a worker's model is cut over its ranks (``engine/parallel/layout.py``): ``tp`` x ``pp``
    ranks, one worker however many; ``stage_layers``: the decoder layers of each pipeline stage
    (empty at PP 1). A card without it: one rank."""

    tp: int = 1
    pp: int = 1
    stage_layers: list[int] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp

    def describe(self) -> str:
        """``tp2xpp2``; ``tp1`` for one rank."""
        return f"tp{self.tp}" + (f"xpp{self.pp}" if self.pp > 1 else "")
