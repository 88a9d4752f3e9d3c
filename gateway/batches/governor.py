"""How many batch lines this gateway runs at once: only what interactive traffic leaves free.

Fed by the decode workers' load reports (the ones the router already reads, once a second):

    capacity = sum of the workers' max_num_seqs;  busy = running + waiting + waiting for KV
    room     = capacity x (1 - headroom) - busy;  interactive = busy - deferrable (batch sequences)
    anything queued on a worker, no room, or this gateway's event loop late by over LAG_LIMIT
                                             -> halve the limit (at least 1)
    interactive requests running             -> hold it (and shed a quarter)
    room left and the limit in use           -> grow it by a quarter (at least 1, at most half the
                                                room and --batch-max-inflight)

Slow in, fast out: a burst of interactive requests (they queue, run, or take the room) shrinks
batch work within a report or two, and idle workers fill up again over a few seconds. The lines themselves run at the lowest priority, so a worker pauses them while anything
else runs; the governor keeps them from occupying the slots and KV that interactive requests
would otherwise find taken, and from filling the steps (prefill above all) that interactive
requests share with them. The floor of one line keeps a batch moving on a busy mesh. The event
loop's lateness is the gateway's own CPU: batch lines share the loop with interactive streams,
and a late loop is a late first token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from mesh.protocol import LoadReport

TICK = 0.5  # seconds between looks at the load reports
LAG_LIMIT = 0.025  # seconds the event loop may run late before batch lines back off


@dataclass
class Governor:
    ceiling: int = 32  # --batch-max-inflight
    headroom: float = 0.25  # --batch-headroom: the share of worker capacity batch lines leave free
    limit: int = 1
    inflight: int = 0

    def __post_init__(self) -> None:
        if self.ceiling < 1 or not 0.0 <= self.headroom < 1.0:
            raise ValueError("need --batch-max-inflight >= 1 and 0 <= --batch-headroom < 1")
        self._changed = asyncio.Condition()

    def observe(self, loads: Iterable[LoadReport], lag: float = 0.0) -> int:
        """The new limit after a look at the decode workers' latest reports and at how late this
        gateway's event loop ran (``lag``, seconds)."""
        capacity = busy = queued = interactive = 0
        for r in loads:
            capacity += r.capacity
            busy += r.running + r.waiting + r.waiting_for_kv
            queued += r.waiting + r.waiting_for_kv
            interactive += max(0, r.running + r.waiting + r.waiting_for_kv - r.deferrable)
        room = int(capacity * (1.0 - self.headroom)) - busy
        if queued > 0 or room < 0 or capacity == 0 or lag > LAG_LIMIT:
            self.limit = max(1, self.limit // 2)
        elif interactive > 0:  # their steps are shared with every batch line on the worker
            self.limit = max(1, self.limit - self.limit // 4)
        elif room > 0 and self.inflight >= self.limit:
            self.limit = min(self.ceiling, self.limit + max(1, min(self.limit // 4, room // 2)))
        return self.limit

    async def tick(self, loads: Iterable[LoadReport], lag: float = 0.0) -> None:
        before = self.limit
        if self.observe(loads, lag) > before:
            async with self._changed:
                self._changed.notify_all()

    async def acquire(self) -> None:
        """Wait for a free slot under the limit and take it; ``release`` gives it back."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.inflight < self.limit)
            self.inflight += 1

    async def release(self) -> None:
        async with self._changed:
            self.inflight -= 1
            self._changed.notify_all()
