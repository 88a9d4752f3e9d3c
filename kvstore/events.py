"""Block-level cache changes, recorded where they happen and drained once per engine step.

The worker turns a drained batch into a KV event on the bus (the router's
index is built from them); the pool only records.
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


def to_wire(events: list[BlockEvent]):
    """Block events -> ``KvEvent``s, with chained stores and same-tier removals merged into runs."""
    from mesh.protocol import KvEvent

    out: list[KvEvent] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, BlockStored):
            if last and last.kind == "stored" and last.tier == ev.tier and last.hashes[-1] == ev.parent:
                last.hashes.append(ev.block_hash)
            else:
                out.append(KvEvent("stored", [ev.block_hash], ev.parent, ev.tier))
        elif last and last.kind == "removed" and last.tier == ev.tier:
            last.hashes.append(ev.block_hash)
        else:
            out.append(KvEvent("removed", [ev.block_hash], None, ev.tier))
    return out
