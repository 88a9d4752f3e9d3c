"""Several workers in one process, as on one host: ``WorkerHost`` (``mesh worker mock --num-workers N``).

Each worker is whole on the bus: its own id, card, subjects, KV events, load reports, token
links and engine (the mocker's: its own timing model and KV tiers). What the process owns once,
for all of them:

    WorkerHost                      shared                      per worker
    ----------                      ------                      ----------
    one event loop              --> every worker's engine steps on it (the mocker's InlineEngineLoop:
                                    a step is a pause the loop awaits, so no thread per worker)
    one NATS connection         --> SharedParts.bus: each worker's own subscriptions and subjects on it
    one registry view           --> SharedParts.membership: one KV watch, not one per worker
    one load message a tick     --> SharedParts.loads: the decode workers' reports of one tick as one
                                    LoadReports (mesh.loads)
    one KV-event message a step --> SharedParts.kv_batches: the decode workers' KV event batches of one
                                    turn as one KvEventBatches (mesh.kvevents), each still numbered by its worker
    its cards, a few keys       --> SharedParts.cards: the workers' cards under the process's set keys,
                                    refreshed together (mesh.cardset), not a put per worker
    one token link per gateway  --> SharedParts.links: the workers' batches to a gateway on one
                                    socket, a turn's frames in one write (mesh.tokenlink)
    one /metrics page           --> the process's registry (step metrics by model and role)
    signals                     --> one stop for all; each worker its own StopEvent under it, so
                                    an engine that dies stops its worker only

Why one connection and not one each: a nats.py client is a socket, a reader task, a flusher task
and a ping timer, and nats-server holds a client (two goroutines) per connection; on one
connection the messages every worker publishes in one turn of the loop leave in one write. A
process that dies takes its connection with it, so its workers leave the bus together, as a
dead host's do.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from mesh.bus import Bus
from mesh.cardset import CardSet
from mesh.kvevents import KvBatcher
from mesh.loads import LoadBatcher
from mesh.procutil import StopEvent, cancel_and_wait, settle_heap, stop_event_on_signals
from mesh.registry import Membership
from mesh.telemetry import serve_metrics, setup_tracing
from mesh.tokenlink import LinkPool
from worker.core import SharedParts, WorkerCore
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

START_TIMEOUT = 120.0  # seconds for every worker of the process to be serving


def worker_ids(prefix: str, n: int) -> list[str]:
    """``prefix-0000``, ``prefix-0001``, ...: sorted as they were started."""
    width = max(4, len(str(n - 1)))
    return [f"{prefix}-{i:0{width}d}" for i in range(n)]


def child_stop(parent: StopEvent) -> StopEvent:
    """A worker's own stop: set with the host's (sharing its signals, so a worker drains as the
    signal says), or alone (its engine died)."""
    child = StopEvent()
    child.signals = parent.signals
    child.hurry = parent.hurry
    return child


class WorkerHost:
    def __init__(self, workers: list[WorkerCore], settings: WorkerSettings, name: str = "host",
                 registry_role: str | None = "prefill"):
        if not workers:
            raise ValueError("a host runs at least one worker")
        self.workers = workers
        self.settings = settings  # the bus and metrics of the process (the workers' own settings: theirs)
        self.name = name
        self.registry_role = registry_role  # the cards its workers follow (decode workers: the prefill pool's)
        self.exit_code = 0
        self.metrics_port = 0
        self.ready = asyncio.Event()

    async def run(self, stop: StopEvent | None = None) -> int:
        stop = stop or stop_event_on_signals()
        s = self.settings
        setup_tracing("pdmesh-worker")
        async with AsyncExitStack() as stack:
            bus = await Bus.connect(s.nats_url, name=self.name, ns=s.ns, config=s.nats)
            stack.push_async_callback(bus.close)
            membership = Membership(bus, ttl=s.registry_ttl, role=self.registry_role)
            await membership.start(wait=1.0)
            stack.push_async_callback(membership.stop)
            if s.metrics_port >= 0:
                self.metrics_port = serve_metrics(s.metrics_port, s.metrics_host)
            cards = CardSet(bus, self.name, ttl=s.registry_ttl)
            await cards.start()
            stack.push_async_callback(cards.stop)  # after every worker's own leave
            shared = SharedParts(bus, membership, LinkPool(), LoadBatcher(bus, self.name), cards,
                                 KvBatcher(bus, self.name))
            stack.callback(shared.links.close)  # after every worker's drain: their last chunks go out first
            stops = [child_stop(stop) for _ in self.workers]
            for w in self.workers:
                w.shared = shared
            runs = [asyncio.create_task(w.run(st), name=f"worker-{w.worker_id}") for w, st in zip(self.workers, stops, strict=True)]
            for w, run in zip(self.workers, runs, strict=True):
                run.add_done_callback(lambda t, w=w: _log_failure(w, t))
            relay = asyncio.create_task(_relay(stop, stops), name="stop-relay")
            stack.push_async_callback(cancel_and_wait, [relay])
            await self._wait_started(runs, stop)
            results = await asyncio.gather(*runs, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        codes = [w.exit_code for w in self.workers]
        self.exit_code = 1 if failed or any(codes) else 0
        return self.exit_code

    async def _wait_started(self, runs: list[asyncio.Task], stop: StopEvent) -> None:
        """Until every worker serves (then the start-up heap is frozen, once for all of them), one
        ends before it does (``gather`` reports why), or the host is told to stop."""
        serving = asyncio.ensure_future(asyncio.gather(*(w.ready.wait() for w in self.workers)))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait({serving, stopped, *runs}, timeout=START_TIMEOUT,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            serving.cancel()
            stopped.cancel()
        if serving in done:
            settle_heap()
            self.ready.set()
            log.info("%d %s workers serving in this process (%s .. %s)", len(self.workers), self.workers[0].role,
                     self.workers[0].worker_id, self.workers[-1].worker_id)
        elif not done:
            log.warning("%d of %d workers not serving after %.0f s", sum(not w.ready.is_set() for w in self.workers),
                        len(self.workers), START_TIMEOUT)


def _log_failure(worker: WorkerCore, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("worker %s failed: %s", worker.worker_id, task.exception())


async def _relay(stop: StopEvent, stops: list[StopEvent]) -> None:
    await stop.wait()
    for st in stops:
        st.set()
