"""What the parts of a decode worker share of it: ``WorkerContext``.

The parts (``decode.admission``, ``decode.remote``, ``decode.emission``, ``decode.peerfetch``)
take this instead of the worker, so none of them imports ``decode.worker``: the worker imports
them and wires them together in its ``setup``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass

from engine.core import EngineCore
from engine.loop import EngineLoop
from mesh import metrics
from mesh.bus import Bus
from mesh.registry import Membership
from mesh.tokenlink import LinkPool
from worker.core import Counters
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class WorkerContext:
    """One decode worker's identity, connections and counters, as its parts see them."""

    worker_id: str
    role: str
    settings: WorkerSettings
    bus: Bus
    engine: EngineCore
    loop: EngineLoop  # runs engine operations between steps (``loop.call``)
    counters: Counters
    transports: list[str]  # the KV transports this worker offers, best first
    tasks: list[asyncio.Task]  # the worker's background tasks (cancelled when it stops)
    membership: Membership | None = None  # the process's registry view, when its workers share one
    links: LinkPool | None = None  # the process's token links, when its workers share them

    @property
    def model(self) -> str:
        return self.engine.model_name

    def spawn(self, coro: Coroutine) -> None:
        """Run ``coro`` as one of the worker's tasks (cancelled with them when it stops)."""
        task = asyncio.create_task(coro)
        self.tasks.append(task)
        task.add_done_callback(self.tasks.remove)

    async def subscribe(self, stack: AsyncExitStack, subject: str,
                        handler: Callable[..., Awaitable[None]], expect: type) -> None:
        """Handle ``expect`` messages on ``subject`` until ``stack`` closes."""
        sub = await self.bus.subscribe(subject, handler, expect)
        stack.push_async_callback(unsubscribe, sub)

    def refuse(self, reason: str, rid: str, what: str) -> None:
        """A request-scoped message from a peer the request is not bound to: logged, counted, dropped."""
        log.warning("refused a message for %s: %s", rid, what)
        metrics.REFUSED_MESSAGES.labels(self.role, reason).inc()
        self.counters.bump("refused_messages")


async def unsubscribe(sub) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
