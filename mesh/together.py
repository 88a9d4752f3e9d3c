"""What a process's workers hand in during one turn of its loop, published as one message once the
turn is over (``TurnBatcher``): the form of ``mesh.loads.LoadBatcher`` (a tick's load reports) and
``mesh.kvevents.KvBatcher`` (a step's KV event batches). The workers of one process (``worker.host``)
tick and step on one clock, so what they publish of one tick or step comes in one turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mesh.bus import Bus

log = logging.getLogger(__name__)


class TurnBatcher:
    """Items handed in during one turn, published once it is over: per model (the item's ``model``),
    as ``wrap(items)`` on ``subject(model)``, at most ``max_items`` a message and, with ``weight``
    (an item's bytes, about), under half the server's max_payload. ``add`` hands one in; ``send``
    also waits until the message carrying it is published (raising what publishing raised)."""

    def __init__(self, bus: Bus, subject: Callable[[str], str], wrap: Callable[[list], object], max_items: int,
                 what: str, weight: Callable[[object], int] | None = None):
        self.bus = bus
        self.subject = subject
        self.wrap = wrap
        self.max_items = max_items
        self.what = what  # for the log: "load reports of host-1"
        self.weight = weight
        self._pending: list[tuple[object, asyncio.Future | None]] = []
        self._tasks: set[asyncio.Task] = set()
        self.sent = 0  # messages published

    def add(self, item, done: asyncio.Future | None = None) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._send_soon)
        self._pending.append((item, done))

    async def send(self, item) -> None:
        done = asyncio.get_running_loop().create_future()
        self.add(item, done)
        await done

    def _send_soon(self) -> None:
        pending, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._send(pending))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, pending: list[tuple[object, asyncio.Future | None]]) -> None:
        budget = max(1 << 16, self.bus.nc.max_payload // 2) if self.weight is not None else 0
        by_model: dict[str, list[tuple[object, asyncio.Future | None]]] = {}
        for entry in pending:
            by_model.setdefault(entry[0].model, []).append(entry)
        for model, items in by_model.items():
            subject = self.subject(model)
            while items:
                n, size = 0, 0
                while n < len(items) and n < self.max_items and (not budget or n == 0 or size < budget):
                    size += self.weight(items[n][0]) if budget else 0
                    n += 1
                part, items = items[:n], items[n:]
                error = None
                try:
                    await self.bus.publish(subject, self.wrap([item for item, _ in part]), traced=False)
                    self.sent += 1
                except Exception as e:
                    error = e
                    if any(done is None for _, done in part):  # those who wait hear it themselves
                        log.warning("%s not sent: %s", self.what, e)
                for _, done in part:
                    if done is not None and not done.done():
                        done.set_result(None) if error is None else done.set_exception(error)
