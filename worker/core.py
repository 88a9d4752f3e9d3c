"""The lifecycle every worker role shares, with a KV engine or without one: ``WorkerCore``.

``WorkerBase`` (``worker.base``: an engine in its own thread, KV events, ordered step outputs)
and the embed worker (``decode.embed``: a forward without a KV cache) subclass it and fill in
the engine (``open_engine``, ``warm_up``, ``close_engine``), ``start()``, ``card()``,
``next_load()`` and ``in_flight()``.

Lifecycle (``run``): connect -> ``before_engine`` -> build the engine and warm it up (in a thread: the event loop
never waits for torch) -> metrics server -> the role's ``start`` (its parts, subscriptions) ->
register card -> load reports -> serve until stop -> drain (status "draining", finish in-flight
work) -> stop load reports -> deregister -> the role's cleanups, last pushed first -> close
the engine -> close bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mesh.bus import Bus
from mesh.cardset import CardSet, Member
from mesh.kvevents import KvBatcher
from mesh.loads import LoadBatcher
from mesh.natsauth import retry_unavailable
from mesh.procutil import StopEvent, cancel_and_wait, settle_heap, stop_event_on_signals, until_tick
from mesh.protocol import LoadReport, WorkerCard, subject_token
from mesh.registry import DEFAULT_TTL, CardPublisher, Membership
from mesh.telemetry import serve_metrics, setup_tracing
from mesh.tokenlink import LinkPool

if TYPE_CHECKING:
    from mesh.natsauth import NatsConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreSettings:
    """What the lifecycle needs, whatever the worker computes with: where the bus is, who this
    worker is, how often it reports, how long it drains, where its metrics are served.
    ``worker.settings.WorkerSettings`` adds a generate worker's engine and KV transports."""

    nats_url: str
    ns: str = "mesh"
    worker_id: str = ""
    load_interval: float = 1.0
    registry_ttl: float = DEFAULT_TTL
    drain_timeout: float = 30.0
    metrics_port: int = 0  # Prometheus /metrics on this port (0: any free port; -1: off)
    nats: NatsConfig | None = None  # servers, credentials, TLS (None: nats_url + environment)
    metrics_host: str = "127.0.0.1"  # where /metrics listens ("0.0.0.0" or the pod IP to be scraped)


def new_worker_id(role: str) -> str:
    return subject_token(f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}")


@dataclass
class Counters:
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    errors: int = 0
    by_key: dict[str, int] = field(default_factory=dict)

    def bump(self, key: str, n: int = 1) -> None:
        self.by_key[key] = self.by_key.get(key, 0) + n


@dataclass(frozen=True)
class SharedParts:
    """What the workers of one process share when it runs several (``worker.host``: the mocker's
    ``--num-workers``): one NATS connection, one view of the registry, one token link per gateway
    (``mesh.tokenlink.LinkPool``), one load message a tick (``mesh.loads.LoadBatcher``), their cards
    refreshed together (``mesh.cardset.CardSet``) and one KV-event message a step
    (``mesh.kvevents.KvBatcher``), all the host's to open and close. A worker
    without them opens its own."""

    bus: Bus
    membership: Membership
    links: LinkPool
    loads: LoadBatcher
    cards: CardSet
    kv_batches: KvBatcher


class WorkerCore:
    role = ""

    def __init__(self, settings: CoreSettings):
        self.settings = settings
        self.worker_id = settings.worker_id or new_worker_id(self.role)
        self.started = time.time()
        self.status = "ready"
        self.counters = Counters()
        self.ready = asyncio.Event()
        self.bus: Bus | None = None
        self.cards: CardPublisher | Member | None = None
        self.last_load: LoadReport | None = None
        self.metrics_port = 0
        self.exit_code = 0
        self.shared: SharedParts | None = None  # set by a host running several workers in its process

    # -- for roles ----------------------------------------------------------------
    async def before_engine(self, stack: AsyncExitStack) -> None:
        """Once connected, before the engine builds: what must be on the bus while it does (the
        joins of a worker's ranks on other hosts); cleanups onto ``stack``."""

    def open_engine(self) -> None:
        """In a thread, once connected: build what computes (and keep it)."""

    def warm_up(self) -> None:
        """In a thread, before the card goes up: the first forward faults in pages and picks
        kernels, and no user request should wait for that."""

    def close_engine(self) -> None:
        """After the role's cleanups: free what ``open_engine`` built."""

    def served_model(self) -> str:
        """The model this worker serves (names its subjects)."""
        raise NotImplementedError

    def register_collectors(self) -> None:
        """The role's collectors on the /metrics page, before it is served."""

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        """The role's parts and subscriptions, before the card goes up; cleanups onto ``stack``."""

    def card(self) -> WorkerCard:
        raise NotImplementedError

    async def next_load(self) -> LoadReport:
        raise NotImplementedError

    def in_flight(self) -> int:
        return 0

    def serving_note(self) -> str:
        """What the "serving" log line adds after the model's name."""
        return ""

    # -- lifecycle ----------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or stop_event_on_signals()
        s = self.settings
        setup_tracing(f"pdmesh-{self.role}")
        async with AsyncExitStack() as stack:
            if self.shared is None:
                self.bus = await Bus.connect(s.nats_url, name=self.worker_id, ns=s.ns, config=s.nats)
                stack.push_async_callback(self.bus.close)
            else:
                self.bus = self.shared.bus
            await self.before_engine(stack)
            await asyncio.to_thread(self.open_engine)
            stack.callback(self.close_engine)
            await asyncio.to_thread(self.warm_up)
            self._serve_metrics()
            await self.start(stack, stop)
            self.cards = (CardPublisher(self.bus, self.card, ttl=s.registry_ttl) if self.shared is None
                          else self.shared.cards.member(self.card))  # kept with the process's others
            await retry_unavailable(self.cards.start, "the worker registry")
            stack.push_async_callback(self.cards.stop)
            load = asyncio.create_task(self._report_load(), name="load")
            stack.push_async_callback(cancel_and_wait, [load])
            if self.shared is None:
                settle_heap()  # start-up state built: out of the collector's way (a host: once, for all)
            self.ready.set()
            log.info("%s worker %s serving %s%s", self.role, self.worker_id, self.served_model(),
                     self.serving_note())
            await stop.wait()
            await self.drain(stop)

    async def drain(self, stop: asyncio.Event | None = None) -> None:
        """Stop taking work, let in-flight work finish (bounded: ``drain_timeout`` after SIGTERM,
        a few seconds after SIGINT, none after a second signal), then return to deregister."""
        self.status = "draining"
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.cards.put(), 2.0)
        seconds = self.settings.drain_timeout
        if isinstance(stop, StopEvent):
            seconds = stop.drain_seconds(seconds)
        deadline = time.monotonic() + seconds
        while self.in_flight() and time.monotonic() < deadline and not (
                isinstance(stop, StopEvent) and stop.hurry.is_set()):
            await asyncio.sleep(0.05)
        if self.in_flight():
            log.warning("%d requests still in flight after the drain timeout", self.in_flight())

    def _serve_metrics(self) -> None:
        if self.settings.metrics_port < 0:
            return
        self.register_collectors()
        self.metrics_port = serve_metrics(self.settings.metrics_port, self.settings.metrics_host)

    async def _report_load(self) -> None:
        subject = self.bus.subjects.load(self.served_model(), self.worker_id)
        # a process's decode workers report together (mesh.loads); a prefill worker's own subject
        # is followed by the decode workers that take its jobs
        together = self.shared.loads if self.shared is not None and self.role == "decode" else None
        while True:
            try:
                report = await self.next_load()
                self.last_load = report
                if together is not None:
                    together.add(report)
                else:
                    await self.bus.publish(subject, report, traced=False)
            except Exception as e:
                log.warning("load report failed: %s", e)
            await asyncio.sleep(until_tick(self.settings.load_interval))  # with the process's other workers
