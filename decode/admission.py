"""A decode worker's admission: from a ``GenerateRequest`` to a request the engine has.

    generate --> refused? (draining 503, wrong model 404, duplicate 409, queue full 429, bad 400)
             --> constraint compiled (a thread) --> peer fetch (--peer-fetch) --> prefix match
             --> uncached >= threshold and the prefill pool has room?
                   | yes                                 | no
                   reserve blocks, send the job          prefill locally
                   (``decode.remote``)

Back-pressure: past ``max_queued`` requests without their first token, new ones get a 429 and
the gateway tries another worker. A long prompt goes to the prefill pool while it has room;
when it has none, one prompt at a time is prefilled here (``prefill_route``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING

from opentelemetry import trace

from decode.context import WorkerContext, unsubscribe
from decode.lifecycle import Event, ReqState
from decode.remote import RemoteKv
from decode.request import TRACER, DecodeRequest
from engine.core import EngineCore
from mesh import metrics
from mesh.errors import RequestError, UnknownAdapterError
from mesh.protocol import GenerateRequest, LoadReport, TokenChunk
from mesh.registry import Membership
from mesh.tracing import context_from
from worker.base import prepare_grammar, sampling_params

if TYPE_CHECKING:
    from decode.peerfetch import PeerFetch

log = logging.getLogger(__name__)

_ADMITTED_HERE = (ReqState.ADMITTING, ReqState.PREFILLING)  # an overflow prompt's states until its first token


class Admission:
    """New requests into ``active`` and the engine: refusals and back-pressure, grammar readiness,
    local or remote prefill. Holds the prefill pool's cards (``membership``) and load reports.
    Frees nothing: a request it refuses never reached the engine; one it admits is the engine's
    (or, with its blocks reserved, the remote part's until the job ends)."""

    def __init__(self, ctx: WorkerContext, active: dict[str, DecodeRequest], remote: RemoteKv,
                 peer_fetch: PeerFetch | None, accepting: Callable[[], bool]):
        self.ctx = ctx
        self.active = active
        self.remote = remote
        self.peer_fetch = peer_fetch
        self.accepting = accepting  # False once the worker drains
        self._owns_membership = ctx.membership is None
        # the prefill pool's cards (every decode worker's too with peer fetch: its sources)
        self.membership = ctx.membership or Membership(ctx.bus, ttl=ctx.settings.registry_ttl,
                                                       role=None if ctx.settings.peer_fetch else "prefill")
        self.prefill_loads: dict[str, LoadReport] = {}
        self._load_subs: dict[str, object] = {}  # prefill worker -> the subscription to its load reports

    async def start(self, stack: AsyncExitStack) -> None:
        if self._owns_membership:
            await self.membership.start(wait=1.0)
            stack.push_async_callback(self.membership.stop)
        # Load reports of the model's prefill workers only, one subscription each as they join:
        # all of the model's reports (one per worker per second) would cost every decode worker
        # a decode per worker per second, N x N across a mesh of N.
        self.membership.on_change(self._on_member)
        stack.callback(self.membership.off_change, self._on_member)
        stack.push_async_callback(self._unsubscribe_loads)
        for card in self.membership.cards(self.ctx.model, "prefill"):
            self._on_member(card.worker_id, card)

    def _on_member(self, worker_id: str, card) -> None:
        if card is None:
            self.prefill_loads.pop(worker_id, None)
            sub = self._load_subs.pop(worker_id, None)
            if sub is not None:
                self.ctx.spawn(unsubscribe(sub))
        elif card.role == "prefill" and card.model == self.ctx.model and worker_id not in self._load_subs:
            self._load_subs[worker_id] = None  # subscribing
            self.ctx.spawn(self._subscribe_load(worker_id))

    async def _subscribe_load(self, worker_id: str) -> None:
        sub = await self.ctx.bus.subscribe(self.ctx.bus.subjects.load(self.ctx.model, worker_id), self.on_load,
                                           LoadReport)
        if worker_id in self._load_subs:
            self._load_subs[worker_id] = sub
        else:  # it left while we subscribed
            await unsubscribe(sub)

    async def _unsubscribe_loads(self) -> None:
        subs, self._load_subs = [s for s in self._load_subs.values() if s is not None], {}
        for sub in subs:
            await unsubscribe(sub)

    def queued(self) -> int:
        """Requests admitted here that have not produced their first token yet."""
        return sum(1 for r in self.active.values() if r.state < ReqState.DECODING)

    @property
    def max_queued(self) -> int:
        return self.ctx.settings.max_queued or 4 * self.ctx.engine.scheduler.config.max_num_seqs

    # -- requests -----------------------------------------------------------------
    async def generate(self, req: GenerateRequest, raw) -> None:
        """Admit a request, or answer it with an error chunk."""
        rec = await self._open(req, raw)
        if rec is None:
            return
        if rec.seq.params.constraint is not None and not await self._grammar_ready(rec):
            return
        if self.peer_fetch is not None and req.peer_fetch is not None:
            span = rec.enter("peer.fetch", **{"pdmesh.fetch_source": req.peer_fetch.fetch_source})
            span.set_attribute("pdmesh.fetched_blocks", await self.peer_fetch.fetch_for(req))  # staged for admission
            if rec.state is not ReqState.ADMITTING:
                return  # cancelled or aborted meanwhile: nothing reached the engine yet
        await self._admit(rec)

    async def _open(self, req: GenerateRequest, raw) -> DecodeRequest | None:
        """The request's record, in ``active`` (ADMITTING); None when it was refused (answered)."""
        if not raw.reply:
            log.warning("generate %s without a reply subject: dropped", req.request_id)
            return None
        ctx = self.ctx
        error = self.refusal(req)
        seq = None
        if error is None:
            try:
                seq = ctx.engine.new_sequence(req.token_ids, sampling_params(req.sampling),
                                              request_id=req.request_id, lora=req.adapter or None,
                                              cache_scope=req.cache_scope)
                if not 0 <= req.output_offset < len(req.token_ids):
                    raise ValueError(f"output_offset {req.output_offset} does not fit the prompt")
            except UnknownAdapterError as e:
                error = (str(e), 404)
            except (RequestError, ValueError) as e:
                error = (str(e), 400)
        if error is not None:
            await self.fail(raw.reply, req.request_id, *error)
            return None
        seq.output_offset = req.output_offset  # before the grammar replays the tokens generated so far
        seq.priority = req.priority
        ctx.counters.requests += 1
        rec = DecodeRequest(req, raw.reply, seq, time.monotonic())
        rec.span = TRACER.start_span(
            "decode.request", context=context_from(raw.headers), kind=trace.SpanKind.SERVER,
            attributes={"pdmesh.request_id": req.request_id, "pdmesh.model": req.model,
                        "pdworker.base": ctx.worker_id, "pdmesh.prompt_tokens": len(req.token_ids)},
        )
        self.active[req.request_id] = rec
        return rec

    async def _admit(self, rec: DecodeRequest) -> None:
        """Into the engine: its blocks reserved for a prefill worker, or queued for a local prefill."""
        req, seq = rec.request, rec.seq
        threshold = self.ctx.settings.disagg_threshold
        route = self.prefill_route(req.adapter) if seq.num_prompt_tokens >= threshold else "local"
        rec.overflow = route == "overflow"  # set now: the next long prompt's decision sees it
        # (a late copy of its last job may still run: a fenced request prefills here)
        want_remote = route == "remote" and not self.remote.fenced(req.request_id)
        admit = partial(EngineCore.admit, seq=seq, remote_min_tokens=threshold if want_remote else None)
        reservation = await self.ctx.loop.call(admit)
        if rec.state is not ReqState.ADMITTING:
            return  # cancelled meanwhile (its abort was queued after the admission), or already emitting
        if reservation is None:
            self.admitted_locally(rec)
        else:
            rec.move(Event.REMOTE)
            metrics.PREFILL_DECISIONS.labels(req.model, "remote").inc()
            await self.remote.send_job(rec, *reservation)

    async def _grammar_ready(self, rec: DecodeRequest) -> bool:
        """Compile the request's constraint and build its matcher before the engine takes it (in a
        thread: a compile never stalls a step or the event loop). False: it was cancelled meanwhile,
        or refused with a 400 (a grammar that does not compile, or tokens it rejects)."""
        refused = await prepare_grammar(self.ctx.engine, rec.seq)
        if rec.state is not ReqState.ADMITTING:
            return False  # cancelled while it compiled (the worker's cancel dropped it)
        if refused is None:
            return True
        rec.move(Event.REFUSE)
        del self.active[rec.request_id]
        rec.end_spans("refused")
        await self.fail(rec.reply, rec.request_id, refused, 400)
        return False

    def admitted_locally(self, rec: DecodeRequest) -> None:
        """ADMITTING -> PREFILLING. Runs when the admission returns, or earlier, when the engine's
        first output for the request is delivered before the admission's own result is."""
        rec.move(Event.LOCAL)
        n = len(rec.request.token_ids)
        counters = self.ctx.counters
        counters.bump("local_prefill")
        counters.bump("local_prefill_tokens", n)
        if rec.request.priority < 0:  # batch work: the planner does not grow the pools for it
            counters.bump("deferrable_prefill_tokens", n)
        if n >= self.ctx.settings.disagg_threshold:  # meant for the prefill pool, which had no room
            counters.bump("overflow_prefill_tokens", n)
        metrics.PREFILL_DECISIONS.labels(rec.request.model, "local").inc()
        rec.enter("prefill.local")

    def refusal(self, req: GenerateRequest) -> tuple[str, int] | None:
        """Why this worker will not take the request (message, status), or None."""
        if not self.accepting():
            return "worker is draining", 503
        if req.model != self.ctx.model:
            return f"model {req.model!r} is not served here", 404
        if req.request_id in self.active:
            return "duplicate request id", 409
        # (queued() walks every active request: only when they could be too many)
        if len(self.active) >= self.max_queued and self.queued() >= self.max_queued:
            self.ctx.counters.bump("rejected_overloaded")
            return "worker overloaded: too many requests queued", 429
        return None

    async def fail(self, reply: str, rid: str, message: str, status: int) -> None:
        """Answer a request the engine never had with its one (error) chunk."""
        self.ctx.counters.errors += 1
        await self.ctx.bus.publish(
            reply, TokenChunk(rid, 0, finish_reason="error", error=message, error_status=status,
                              worker=self.ctx.worker_id)
        )

    # -- the prefill pool -----------------------------------------------------------
    async def on_load(self, report: LoadReport, raw) -> None:
        # only from prefill workers of the registry (anyone may claim an id); a worker that left is pruned
        if report.role == "prefill" and self.membership.vouches(report.worker_id, "prefill", report.model):
            self.prefill_loads[report.worker_id] = report
            for gone in [w for w in self.prefill_loads if self.membership.get(w) is None]:
                del self.prefill_loads[gone]

    def prefill_route(self, adapter: str = "") -> str:
        """Where a long prompt is prefilled: ``remote`` while a live prefill worker (holding the
        request's LoRA adapter) has room; ``local`` with no prefill worker at all. When none has
        room, ``overflow`` (here) for one prompt at a time: each is a long step for every stream
        this worker decodes, and prompts admitted here stay here, so a backlog of them would
        outlast the prefill pool's scaling up. Past that one, ``remote`` anyway: they queue for
        the pool (a JetStream work queue, pulled by the next free prefill worker;
        ``prefill_timeout`` still falls back here). Per request; the load data is per second."""
        if not self.ctx.transports:  # no KV can reach this worker (its ranks on other hosts: --local-ranks)
            return "local"
        cards = [c for c in self.membership.cards_of(self.ctx.model, "prefill")
                 if c.status == "ready" and (not adapter or adapter in c.adapters)]
        if not cards:
            return "local"
        capacity = sum(c.capacity for c in cards)
        busy = sum(r.active_jobs for w, r in self.prefill_loads.items() if any(c.worker_id == w for c in cards))
        mine = sum(1 for r in self.active.values() if r.state is ReqState.WAITING_FOR_KV)
        if mine < capacity and busy < capacity:
            return "remote"
        if any(r.overflow and r.state in _ADMITTED_HERE for r in self.active.values()):
            self.ctx.counters.bump("queued_for_prefill_pool")  # past the pool's room: it waits in the queue
            return "remote"
        return "overflow"
