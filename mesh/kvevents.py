"""A worker's KV events on the bus: numbered batches of cache changes, and snapshots.

The engine thread drains the block pool's event log after every step and
every command (``flush``). It numbers a batch and hands it to the event loop,
which publishes batches in order; until the loop has sent the last batch, new
events wait and go out with the next one (a busy loop sends one batch for
several steps, not one each). At most one batch is numbered per
``interval`` (100 ms by default, ``--kv-event-interval-ms``): a router hears of a
block at most that much later, and a worker publishes a few batches per
request instead of one per step that touched the cache. The interval is kept
by the flush itself (events that come sooner wait, with a timer for an engine
that goes idle), not by a pause after each send: steps slower than the interval
(a real-pace worker's) cost no wake-up beyond the send. A snapshot is taken in
the engine thread right after a flush that numbers whatever waits, so it is
exactly the state after batch ``seq``: a router that applies the snapshot, then
every batch with a higher number, has the worker's cache.

"Engine thread" is the event loop's own thread under ``InlineEngineLoop`` (the
mocker): the batch is then handed over without the loop's self-pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid

from kvstore.events import BlockEvent, BlockStored
from mesh.bus import Bus
from mesh.procutil import cancel_and_wait
from mesh.protocol import (
    KvEvent,
    KvEventBatch,
    KvEventBatches,
    KvSnapshot,
    KvSnapshotRequest,
    encode,
)
from mesh.together import TurnBatcher

log = logging.getLogger(__name__)

SNAPSHOT_PAGE = 50_000  # hashes per reply page (~450 KB of msgpack)
SNAPSHOT_TTL = 30.0  # seconds a snapshot's later pages stay available
INTERVAL = 0.1  # seconds: at most one batch per interval (why 100 ms: docs/operations.md, --kv-event-interval-ms)


def to_wire(events: list[BlockEvent]) -> list[KvEvent]:
    """Block events -> ``KvEvent``s, with chained stores and same-tier removals merged into runs."""
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


class KvBatcher(TurnBatcher):
    """The batches a process's decode workers hand in during one turn of the loop (``worker.host``,
    whose workers step on one clock: their batches of a step come together), sent as one
    ``KvEventBatches`` per model on ``kv.batches.{process}`` once the turn is over, instead of a
    message each: at 1,000 workers in 8 processes, ~8 messages a step into every router, not ~170 a
    second. Each batch keeps its worker and number; a router takes each as if it came alone; a worker
    sends its next batch once the message carrying the last is out (``send``), so its order holds."""

    MAX_BATCHES = 256  # batches a message

    def __init__(self, bus: Bus, process: str):
        super().__init__(bus, lambda model: bus.subjects.kv_batches(model, process), KvEventBatches,
                         self.MAX_BATCHES, f"KV events of {process}", _batch_bytes)


def _batch_bytes(batch: KvEventBatch) -> int:
    """A batch's most msgpack bytes, about: 10 a hash (a uint64 is 9), 40 an event, 80 the batch."""
    return 80 + sum(40 + 10 * len(ev.hashes) for ev in batch.events)


class KvEventPublisher:
    def __init__(self, bus: Bus, worker_id: str, model: str, interval: float = INTERVAL,
                 together: KvBatcher | None = None):
        self.bus = bus
        self.together = together  # the process's KvBatcher (worker.host): batches sent with its other workers
        self.interval = interval
        self.worker_id = worker_id
        self.model = model
        self.seq = 0  # engine thread only
        self._waiting: list = []  # engine thread: events not numbered yet
        self._handing = False  # a numbered batch is on its way to the event loop
        self._next_at = 0.0  # engine thread: (monotonic) when the next batch may be numbered
        self._armed = False  # a timer will flush the events that wait for the interval
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._queue: asyncio.Queue[KvEventBatch] = asyncio.Queue()
        self._snapshots: dict[str, tuple[float, int, dict[str, list[int]]]] = {}
        self._task: asyncio.Task | None = None
        self._engine_loop = None  # start()
        self._sub = None
        self.published = 0

    # -- engine thread ------------------------------------------------------------------
    def flush(self, engine, force: bool = False) -> None:
        log_ = engine.pool.events
        events = log_.drain()
        if log_.overflowed:
            # Events were lost: skip a number so that routers see a gap and resync.
            log_.overflowed = False
            self.seq += 1
        if events:
            self._waiting.extend(to_wire(events))
        if not self._waiting:
            return
        on_loop = threading.get_ident() == self._loop_thread  # an engine stepping on the loop itself
        now = time.monotonic()
        if not force and (self._handing or now < self._next_at):
            # the last batch is still being sent (its send flushes again), or went out less than
            # an interval ago: a timer flushes these if no step or command comes first
            if not self._handing and not self._armed:
                self._armed = True
                if on_loop:
                    self._arm(self._next_at)
                else:
                    self._loop.call_soon_threadsafe(self._arm, self._next_at)
            return
        self.seq += 1
        batch = KvEventBatch(self.worker_id, self.model, self.seq, self._waiting)
        self._waiting = []
        self._handing = True
        self._next_at = now + self.interval
        if on_loop:
            self._take(batch)
        else:
            self._loop.call_soon_threadsafe(self._take, batch)

    def _take(self, batch: KvEventBatch) -> None:
        self._queue.put_nowait(batch)

    # -- event loop: the timer for events that wait -------------------------------------
    def _arm(self, at: float) -> None:
        # a millisecond late: the loop's clock is millisecond grained, and a timer that fired
        # early would find the interval not up and arm another
        self._loop.call_later(max(0.0, at - time.monotonic()) + 0.001, self._flush_held)

    def _flush_held(self) -> None:
        self._armed = False
        if self._engine_loop is not None:
            self._engine_loop.call(self.flush)  # between steps; a step's own flush may come first

    def take_snapshot(self, engine) -> tuple[int, dict[str, list[int]]]:
        self.flush(engine, force=True)
        return self.seq, engine.kv_snapshot()

    # -- event loop ---------------------------------------------------------------------
    async def start(self, engine_loop) -> None:
        self._engine_loop = engine_loop
        self._task = asyncio.create_task(self._publish(), name="kv-events")
        self._sub = await self.bus.subscribe(
            self.bus.subjects.kv_snapshot(self.model, self.worker_id), self._on_snapshot, KvSnapshotRequest
        )

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _publish(self) -> None:
        subject = self.bus.subjects.kv_events(self.model, self.worker_id)
        while True:
            batch = await self._queue.get()
            try:
                if self.together is not None:
                    await self.together.send(batch)
                else:
                    await self.bus.publish(subject, batch, traced=False)
                self.published += 1
            except Exception as e:  # the gap in numbers makes routers resync
                log.warning("could not publish KV events: %s", e)
            if self._queue.empty():
                # Sent: the engine thread may number the next batch. Events that waited for this
                # one go with its next flush (after its next step), or when the interval is up
                # if it is idle.
                self._handing = False
                if self._waiting and not self._armed:
                    self._armed = True
                    self._arm(self._next_at)

    async def _on_snapshot(self, req: KvSnapshotRequest, raw) -> None:
        if not raw.reply:
            return
        now = time.monotonic()
        for sid in [s for s, (t, _, _) in self._snapshots.items() if now - t > SNAPSHOT_TTL]:
            del self._snapshots[sid]
        snap = self._snapshots.get(req.snapshot_id)
        if req.page == 0 or snap is None:
            seq, blocks = await asyncio.wait_for(self._engine_loop.call(self.take_snapshot), 10.0)
            sid = uuid.uuid4().hex
            snap = (now, seq, blocks)
            self._snapshots[sid] = snap
        else:
            sid = req.snapshot_id
        _, seq, blocks = snap
        flat = [(tier, h) for tier, hashes in blocks.items() for h in hashes]
        pages = max(1, -(-len(flat) // SNAPSHOT_PAGE))
        page = min(req.page if req.snapshot_id == sid else 0, pages - 1)
        part: dict[str, list[int]] = {}
        for tier, h in flat[page * SNAPSHOT_PAGE : (page + 1) * SNAPSHOT_PAGE]:
            part.setdefault(tier, []).append(h)
        await raw.respond(encode(KvSnapshot(self.worker_id, seq, sid, page, pages, part)))
