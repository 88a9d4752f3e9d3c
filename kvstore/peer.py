"""The requester's side of a peer fetch: blocks a peer sent, waiting for the admission they were fetched for.

``TieredCache`` walks them after its own tiers (``holds``/``load``), so the admission
onboards them like any hit below the device and counts them as ``peer`` hits. The
holder's side (pinning what it sends) is ``kvstore.pins``.

Unlike the pool and the tiers, the stage is filled from outside the engine thread (the
worker's event loop, when a fetch completes), so every operation takes its lock: a
fetch does not wait for the engine's next step boundary to hand its blocks over.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvstore.disk import EMPTY


class PeerStage:
    """Blocks fetched from a peer for admissions about to happen: hash -> payload.

    Not a cache tier (no events, no snapshot, no LRU): an entry is taken once, by the
    admission that onboards it, or dropped ``ttl`` seconds after it was put (its request
    was cancelled, or found the blocks elsewhere). Payloads are bytes-like, or ``EMPTY``
    where there are no bytes (the mocker).
    """

    tier = "peer"

    def __init__(self, ttl: float = 30.0, clock=time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._entries: OrderedDict[int, tuple[Any, float]] = OrderedDict()  # hash -> (payload, expiry)
        self._lock = threading.Lock()
        self.staged = 0
        self.expired = 0

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, hashes: Sequence[int], payloads: Sequence[Any] | None = None) -> None:
        with self._lock:
            self._expire()
            expiry = self.clock() + self.ttl
            for i, h in enumerate(hashes):
                self._entries.pop(h, None)
                self._entries[h] = (EMPTY if payloads is None else payloads[i], expiry)
            self.staged += len(hashes)

    def take(self, block_hash: int) -> Any | None:
        with self._lock:
            entry = self._entries.pop(block_hash, None)
        return None if entry is None else entry[0]

    def expire(self) -> int:
        with self._lock:
            return self._expire()

    def _expire(self) -> int:
        now = self.clock()
        gone = 0
        while self._entries:
            h, (_, expiry) = next(iter(self._entries.items()))
            if expiry > now:
                break
            del self._entries[h]
            gone += 1
        self.expired += gone
        return gone
