"""Block-level cache changes, recorded where they happen and drained once per engine step.

The worker turns a drained batch into a KV event on the bus (the router's
index is built from them; ``mesh.kvevents.to_wire``); the pool only records.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: int
    parent: int | None
    tier: str


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: int
    tier: str


BlockEvent = BlockStored | BlockRemoved


class KvEventLog:
    """An append-only buffer of block events; ``drain()`` hands them over and starts anew.

    Disabled logs drop events, so a pool nobody listens to pays nothing.
    """

    def __init__(self, enabled: bool = True, limit: int = 1_000_000):
        self.enabled = enabled
        self.limit = limit
        self.overflowed = False
        self._events: list[BlockEvent] = []

    def append(self, event: BlockEvent) -> None:
        if not self.enabled:
            return
        if len(self._events) >= self.limit:
            # Nobody is draining: stop recording and let the consumer resync from a snapshot.
            self.overflowed = True
            return
        self._events.append(event)

    def drain(self) -> list[BlockEvent]:
        out, self._events = self._events, []
        return out

    def __len__(self) -> int:
        return len(self._events)

