"""The KV-aware router on the bus: keeps the index and the load view current, decides.

Feeds: every decode worker's KV event batches (resynced from a snapshot after
a gap, for a new worker, or when the router starts), load reports, the
registry (a worker that leaves is dropped at once), and the decisions of other
router replicas (their requests count as load here too). ``route()`` is
synchronous and cheap: hash the prompt, walk the index, call ``pick_worker``.
A router decides; the gateway sends. With ``peer_fetch`` a decision may name a
peer the chosen worker should fetch prefix blocks from; the decision goes out on
``router.decisions`` (phase A: mocker workers read it there; the gateway does not
forward it in the request yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from dataclasses import dataclass

import numpy as np

from kvstore.hashing import block_hashes, hash_seed
from mesh import metrics
from mesh.bus import Bus
from mesh.loads import subscribe_loads
from mesh.protocol import (
    KvEventBatch,
    KvEventBatches,
    KvSnapshot,
    KvSnapshotRequest,
    RouterDecision,
    WorkerCard,
)
from mesh.registry import Membership
from mesh.router.costs import KvCosts
from mesh.router.index import KvIndex
from mesh.router.inflight import _Inflight, _InflightQueue
from mesh.router.policy import Decision, RouterConfig, RouteRequest, WorkerLoad, pick_worker
from mesh.router.slots import Slots
from mesh.router.table import KvRequest, LoadSummaries, LoadSummary, LoadTable, pick_kv

log = logging.getLogger(__name__)

INFLIGHT_TTL = 30.0  # seconds a decision counts as load if no load report shows it
REPORT_MARGIN = 0.25  # a load report this much newer than a decision already shows it
SILENT_AFTER = 3.5  # seconds without a load report (workers send one a second) before a worker gets no new work
SNAPSHOT_TIMEOUT = 5.0


_NO_INFLIGHT = _InflightQueue()  # read-only: the load of a worker nothing was routed to


@dataclass
class _View:
    """A model's ready decode workers as of one membership version: what each decision starts from."""

    key: tuple
    cards: dict[str, WorkerCard]
    ready: np.ndarray  # bool by slot
    order: list[tuple[int, WorkerCard]]  # (slot, card) in the registry's order
    order_slots: np.ndarray  # their slots, in that order (the first candidate found at once, not by a loop)


class KvRouter:
    def __init__(self, bus: Bus, membership: Membership, config: RouterConfig, router_id: str | None = None):
        self.bus = bus
        self.membership = membership
        self.config = config
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.rng = random.Random()
        self.slots = Slots()  # one small integer per worker: its bit in every index, its row in ``table``
        self.table = LoadTable(self.slots)
        self._views: dict[str, _View] = {}
        self.indexes: dict[str, KvIndex] = {}
        self.loads: dict[str, LoadSummary] = {}
        self._heard: dict[str, float] = {}  # worker -> when its last load report arrived (monotonic)
        self.inflight: dict[str, _InflightQueue] = {}  # worker -> its routed requests (request id -> load)
        self.open: dict[str, set[str]] = {}  # worker -> the requests routed to it that have not ended (its slots)
        self._buffered: dict[str, list[KvEventBatch]] = {}
        self._resyncing: set[str] = set()
        self._rr = 0
        self._costs: dict[str, tuple[tuple, KvCosts]] = {}  # worker -> (its card's KV figures, parsed)
        self._subs = []
        self._tasks: set[asyncio.Task] = set()
        self.resyncs = 0
        self.decisions = 0
        self.fetches = 0
        self.ignored = 0  # load reports and KV event batches from ids the registry does not vouch for
        self._kv_batches = metrics.ROUTER_KV_EVENTS.labels("batches")
        self._kv_hashes = metrics.ROUTER_KV_EVENTS.labels("hashes")

    def index(self, model: str) -> KvIndex:
        idx = self.indexes.get(model)
        if idx is None:
            idx = self.indexes[model] = KvIndex(slots=self.slots)
        return idx

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        s = self.bus.subjects
        self._subs = [
            await self.bus.subscribe(s.kv_events_any(), self._on_events, KvEventBatch, pending_msgs_limit=1 << 20),
            await self.bus.subscribe(s.kv_batches_any(), self._on_batches, KvEventBatches, pending_msgs_limit=1 << 20),
            *await subscribe_loads(self.bus, self._on_load, LoadSummary, LoadSummaries, self._on_loads),
            await self.bus.subscribe(s.router_decisions(), self._on_decision, RouterDecision),
        ]
        self.membership.on_change(self._on_member)
        for card in self.membership.cards(role="decode"):
            self._on_member(card.worker_id, card)

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for t in list(self._tasks):
            t.cancel()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- feeds ------------------------------------------------------------------------
    def _on_member(self, worker_id: str, card: WorkerCard | None) -> None:
        if card is None:
            for idx in self.indexes.values():
                idx.drop_worker(worker_id)
            self.loads.pop(worker_id, None)
            self._heard.pop(worker_id, None)
            self.inflight.pop(worker_id, None)
            self.open.pop(worker_id, None)
            self._buffered.pop(worker_id, None)
            self._costs.pop(worker_id, None)
            self.table.clear(worker_id)
            self.slots.release(worker_id)  # after every index dropped its blocks
            return
        if card.role == "decode":
            self.table.set_block_size(worker_id, card.block_size)
        if card.role == "decode" and card.publishes_kv_events and self.index(card.model).seq(worker_id) is None:
            self._spawn(self._resync(card.model, worker_id))

    async def _on_events(self, batch: KvEventBatch, raw) -> None:
        hashes = self._take_events(batch)
        if hashes >= 0:
            self._kv_batches.inc()
            self._kv_hashes.inc(hashes)

    async def _on_batches(self, together: KvEventBatches, raw) -> None:
        """A process's workers' batches of one turn (``mesh.kvevents.KvBatcher``): each as if alone
        (the metrics once for the message)."""
        indexed = hashes = 0
        for batch in together.batches:
            n = self._take_events(batch)
            if n >= 0:
                indexed += 1
                hashes += n
        if indexed:
            self._kv_batches.inc(indexed)
            self._kv_hashes.inc(hashes)

    def _take_events(self, batch: KvEventBatch) -> int:
        """The block hashes the batch indexed; -1 when it was not (not a member's, or held for a resync)."""
        w = batch.worker_id
        if not self.membership.vouches(w, "decode", batch.model):
            self._ignore("kv_events", w)  # a member's events before its card: its snapshot has them
            return -1
        if w in self._resyncing:
            self._buffered.setdefault(w, []).append(batch)
            return -1
        if not self.index(batch.model).apply(batch):
            self._buffered.setdefault(w, []).append(batch)
            self._spawn(self._resync(batch.model, w))
            return -1
        return sum(len(ev.hashes) for ev in batch.events)

    async def _on_load(self, report: LoadSummary, raw) -> None:
        self._take_load(report, time.monotonic())

    async def _on_loads(self, together: LoadSummaries, raw) -> None:
        """A process's reports of one tick (``mesh.loads``): each as if alone, heard at one time."""
        heard = time.monotonic()
        for report in together.reports:
            self._take_load(report, heard)

    def _take_load(self, report: LoadSummary, heard: float) -> None:
        if report.role != "decode":
            return
        if not self.membership.vouches(report.worker_id, "decode", report.model):
            self._ignore("load", report.worker_id)  # kept, an id that is no member would never be pruned
            return
        w = report.worker_id
        self.loads[w] = report
        self._heard[w] = heard
        self.table.report(w, report.kv_blocks_used, report.pending_prefill_tokens, heard,
                          report.running + report.waiting + report.waiting_for_kv)
        queue = self.inflight.get(w)
        if queue is not None:
            queue.drop_before(report.timestamp - REPORT_MARGIN)
            self.table.set_inflight(w, queue.new_blocks, queue.prompt_blocks)

    async def _on_decision(self, d: RouterDecision, raw) -> None:
        if d.router_id != self.router_id and self.membership.vouches(d.worker_id, "decode", d.model):
            self._count(d.worker_id, d.request_id, _Inflight(d.timestamp, d.prompt_blocks, d.new_blocks))

    def _ignore(self, what: str, worker_id: str) -> None:
        self.ignored += 1
        metrics.REFUSED_MESSAGES.labels("router", f"{what}_from_non_member").inc()
        log.debug("ignored %s from %r: not a decode worker of the registry", what, worker_id)

    async def _resync(self, model: str, worker: str) -> None:
        if worker in self._resyncing:
            return
        self._resyncing.add(worker)
        self._buffered.setdefault(worker, [])
        self.resyncs += 1
        try:
            for attempt in range(5):
                try:
                    await self._load_snapshot(model, worker)
                    break
                except Exception as e:
                    log.info("snapshot of %s failed (%s); retrying", worker, e)
                    await asyncio.sleep(0.2 * (attempt + 1))
            else:
                return
        finally:
            self._resyncing.discard(worker)
        idx = self.index(model)
        pending = sorted(self._buffered.pop(worker, []), key=lambda b: b.seq)
        for b in pending:
            if b.seq <= (idx.seq(worker) or 0):
                continue
            if not idx.apply(b):
                self._spawn(self._resync(model, worker))  # still a gap: start over
                return

    async def _load_snapshot(self, model: str, worker: str) -> None:
        subject = self.bus.subjects.kv_snapshot(model, worker)
        first = await self.bus.request(subject, KvSnapshotRequest(0), KvSnapshot, SNAPSHOT_TIMEOUT)
        idx = self.index(model)
        idx.load_snapshot(worker, first.seq, first.blocks)
        for page in range(1, first.pages):
            part = await self.bus.request(subject, KvSnapshotRequest(page, first.snapshot_id), KvSnapshot,
                                          SNAPSHOT_TIMEOUT)
            if part.snapshot_id != first.snapshot_id:
                raise RuntimeError("the snapshot expired while paging")
            idx.add_snapshot_page(worker, part.blocks)

    # -- deciding -----------------------------------------------------------------------
    def candidates(self, model: str) -> list[WorkerCard]:
        """Ready decode workers of ``model``, less those whose load reports stopped.

        A worker killed outright keeps its card until the card's TTL runs out (up to 10 s);
        its load reports stop at once, so after ``SILENT_AFTER`` it gets no new requests. If
        every worker is silent (the bus itself was down), all of them stay candidates.
        """
        ready = [c for c in self.membership.cards(model, "decode") if c.status == "ready"]
        now = time.monotonic()
        heard = self._heard
        live = [c for c in ready if now - heard.get(c.worker_id, now) <= SILENT_AFTER]
        return live or ready

    def route(self, model: str, token_ids: list[int], request_id: str = "",
              exclude: set[str] | frozenset[str] = frozenset(), adapter: str = "",
              cache_scope: str = "") -> Decision:
        """``adapter``: a LoRA adapter; only workers that hold it serve it, its prefixes are hashed
        with its seed, and a worker with it in a device slot now is preferred (``adapter_cost``).
        ``cache_scope``: the request's (``GenerateRequest.cache_scope``), part of its block hashes.

        The usual decision (``kv`` at temperature 0, no adapter, no peer fetch) is costed over every
        worker at once (``mesh.router.table``); the others build a ``WorkerLoad`` per candidate."""
        c = self.config
        if c.mode == "kv" and c.temperature <= 0 and not c.peer_fetch and not adapter:
            return self._route_kv(model, token_ids, request_id, exclude, cache_scope)
        live = self.candidates(model)
        cards = self._with_room([c for c in live if c.worker_id not in exclude and (not adapter or adapter in c.adapters)])
        if not cards:
            raise LookupError(f"no live worker for {adapter or model!r}")
        bs = cards[0].block_size
        hashes: list[int] = []
        matches = {}
        idx = self.index(model)
        if self.config.mode == "kv":
            hashes = block_hashes(token_ids, bs, hash_seed(self.config.hash_key, model, cache_scope, adapter or None))
            idx.expire()
            matches = idx.match(hashes)
        now = time.time()
        loads = {c.worker_id: self._load_of(c, now, adapter) for c in live}
        workers = [loads[c.worker_id] for c in cards]
        req = RouteRequest(len(token_ids), bs, tuple(hashes))
        # an excluded worker (tried already) may still send blocks: only serving it is ruled out
        decision = pick_worker(req, workers, matches, self.config, self.rng, self._rr, sources=list(loads.values()))
        card = next(c for c in cards if c.worker_id == decision.worker_id)
        return self._decided(model, decision, card, hashes, request_id, req.prompt_blocks, now)

    def _route_kv(self, model: str, token_ids: list[int], request_id: str, exclude: set[str] | frozenset[str],
                  cache_scope: str) -> Decision:
        """``route`` for ``kv`` at temperature 0 without adapters or fetches: every worker at once."""
        view = self._view(model)
        table = self.table
        live = view.ready & ((time.monotonic() - table.heard) <= SILENT_AFTER)  # never heard: inf, live
        if not live.any():
            live = view.ready
        candidates = live
        if exclude:
            candidates = live.copy()
            for w in exclude:
                s = self.slots.get(w)
                if s is not None and s < len(candidates):
                    candidates[s] = False
        candidates = table.has_room(candidates)
        hit = candidates[view.order_slots]  # the first candidate in the registry's order: its block size
        at = int(hit.argmax()) if len(hit) else 0
        if not len(hit) or not hit[at]:
            raise LookupError(f"no live worker for {model!r}")
        bs = view.order[at][1].block_size
        hashes = block_hashes(token_ids, bs, hash_seed(self.config.hash_key, model, cache_scope, None))
        idx = self.index(model)
        idx.expire()
        runs, below = idx.match_slots(hashes)
        cards = view.cards
        decision = pick_kv(KvRequest(len(token_ids), bs, runs, below), table, candidates, self.config, self.rng,
                           lambda w: self._costs_of(cards[w]))
        return self._decided(model, decision, cards[decision.worker_id], hashes, request_id,
                             -(-len(token_ids) // bs), time.time())

    def _view(self, model: str) -> _View:
        """The model's ready decode workers, kept until the registry changes (a registry without
        versions, a test's: rebuilt each time)."""
        m = self.membership
        version = getattr(m, "version", None)
        got = self._views.get(model)
        if got is not None and version is not None and got.key == (version, self.table.capacity):
            return got
        listed = m.cards_of(model, "decode") if hasattr(m, "cards_of") else m.cards(model, "decode")
        cards = [c for c in listed if c.status == "ready"]
        order = []
        for c in cards:
            self.table.set_block_size(c.worker_id, c.block_size)  # may grow the table: before the mask
            self.table.set_max_seqs(c.worker_id, c.capacity)
            order.append((self.slots.get(c.worker_id), c))
        ready = np.zeros(self.table.capacity, dtype=bool)
        for s, _ in order:
            ready[s] = True
        view = self._views[model] = _View((version, self.table.capacity), {c.worker_id: c for c in cards},
                                          ready, order, np.array([s for s, _ in order], dtype=np.intp))
        return view

    def _with_room(self, cards: list[WorkerCard]) -> list[WorkerCard]:
        """``cards`` less the workers at their sequence limit (``LoadTable.has_room``)."""
        if not cards:
            return cards
        rows = []
        for c in cards:
            self.table.set_max_seqs(c.worker_id, c.capacity)  # may grow the table: before the mask
            rows.append(self.table.row(c.worker_id))
        mask = np.zeros(self.table.capacity, dtype=bool)
        mask[rows] = True
        roomy = self.table.has_room(mask)
        return [c for c, r in zip(cards, rows, strict=True) if roomy[r]]

    def _decided(self, model: str, decision: Decision, card: WorkerCard, hashes: list[int], request_id: str,
                 prompt_blocks: int, now: float) -> Decision:
        """What follows a decision: counted, its load and prefix credited to the worker, published."""
        self._rr += 1
        self.decisions += 1
        request_id = request_id or uuid.uuid4().hex
        w = decision.worker_id
        opened = self.open.get(w)
        if opened is None:
            opened = self.open[w] = set()
        opened.add(request_id)
        self.table.set_open(w, len(opened))
        if decision.fetch_source:
            self.fetches += 1
            metrics.ROUTER_FETCHES.labels(model).inc()
            metrics.ROUTER_FETCH_BLOCKS.labels(model).inc(decision.fetch_blocks)
        self._count(decision.worker_id, request_id,
                    _Inflight(now, prompt_blocks, decision.new_blocks))
        if hashes:
            # Until the worker's own events show these blocks (after its prefill), the router
            # credits them from its decision, so that a request sharing the prefix that arrives
            # meanwhile follows this one instead of computing the same blocks elsewhere. Workers
            # without events are only ever predicted (approximate mode).
            ttl = self.config.pending_ttl if card.publishes_kv_events else self.config.predict_ttl
            self.index(model).predict(card.worker_id, hashes, ttl)
        self._spawn(self._publish(RouterDecision(
            self.router_id, model, decision.worker_id, request_id, prompt_blocks, decision.new_blocks,
            decision.overlap_blocks, decision.mode, now, hit_blocks=decision.hit_blocks,
            fetch_source=decision.fetch_source, fetch_blocks=decision.fetch_blocks,
        )))
        return decision

    def _load_of(self, card: WorkerCard, now: float, adapter: str = "") -> WorkerLoad:
        report = self.loads.get(card.worker_id)
        queue = self.inflight.get(card.worker_id)
        if queue is None:
            queue = _NO_INFLIGHT
        else:
            queue.drop_before(now - INFLIGHT_TTL)  # decisions no load report ever showed
            self.table.set_inflight(card.worker_id, queue.new_blocks, queue.prompt_blocks)
        pending = 0
        active = 0
        if report is not None:
            pending = -(-report.pending_prefill_tokens // card.block_size)
            active = report.kv_blocks_used
        return WorkerLoad(
            card.worker_id,
            active_blocks=active,
            pending_prefill_blocks=pending + queue.new_blocks,
            inflight_blocks=queue.prompt_blocks,
            total_blocks=card.kv_blocks,
            adapter_cold=bool(adapter) and (report is None or adapter not in report.hot_adapters),
            costs=self._costs_of(card),
            can_fetch=card.fetches_kv,
            can_serve=card.serves_kv_fetch,
        )

    def _costs_of(self, card: WorkerCard) -> KvCosts:
        """The per-block costs the worker publishes (the reference hardware's, for its block's bytes,
        where it does not)."""
        figures = (card.kv_costs, card.block_size, card.kv_block_bytes)
        got = self._costs.get(card.worker_id)
        if got is None or got[0] != figures:
            got = self._costs[card.worker_id] = (figures, KvCosts.from_dict(*figures))
        return got[1]

    def _count(self, worker: str, request_id: str, d: _Inflight) -> None:
        queue = self.inflight.get(worker)
        if queue is None:
            queue = self.inflight[worker] = _InflightQueue()
        queue.add(request_id, d)
        queue.drop_before(d.timestamp - INFLIGHT_TTL)
        self.table.set_inflight(worker, queue.new_blocks, queue.prompt_blocks)

    def suspect(self, worker: str) -> None:
        """A request to ``worker`` found nobody there or went silent: no new work for it until
        its next load report (which a worker that is only slow sends within a second)."""
        self._heard[worker] = time.monotonic() - SILENT_AFTER - 1.0
        self.table.set_heard(worker, self._heard[worker])

    def first_token(self, worker: str, request_id: str) -> None:
        """The request's prefill is done: it no longer counts as pending prefill."""
        queue = self.inflight.get(worker)
        if queue is not None:
            queue.prefilled(request_id)
            self.table.set_inflight(worker, queue.new_blocks, queue.prompt_blocks)

    def finished(self, worker: str, request_id: str) -> None:
        """The request ended: its blocks and its sequence slot are free again (whatever the next
        load report says)."""
        opened = self.open.get(worker)
        if opened is not None and request_id in opened:
            opened.discard(request_id)
            self.table.set_open(worker, len(opened))
        queue = self.inflight.get(worker)
        if queue is not None:
            queue.pop(request_id)
            self.table.set_inflight(worker, queue.new_blocks, queue.prompt_blocks)

    async def _publish(self, d: RouterDecision) -> None:
        with contextlib.suppress(Exception):
            await self.bus.publish(self.bus.subjects.router_decisions(), d, traced=False)
