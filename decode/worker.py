"""The decode worker: owns each request from ``GenerateRequest`` to the last ``TokenChunk``.

Each request is one ``DecodeRequest`` (``decode.request``) in ``active``, whose ``state`` moves
only through ``decode.lifecycle`` (the table of every transition). The worker wires one part
per resource, each with its own state, and handles what spans them (cancel, drain):

    subject                 part                              holds
    generate          -->   Admission  (decode.admission)     refusals, back-pressure, prefill route
                                |  local: engine.admit   remote: reserved blocks
                                v
    kv_ready          -->   RemoteKv   (decode.remote)        jobs, deadlines, tokens, fences
    step outputs      -->   Emission   (decode.emission)      TokenChunk / TokenBatch, step metrics
    kv_fetch(_release) -->  PeerFetch  (decode.peerfetch)     pins lent to peers (--peer-fetch)
    cancel            -->   the worker: drop, or (during a remote prefill) wait for the blocks

Per request:

    generate --> prefix match --> uncached >= threshold and prefill pool free?
                                    | yes                          | no
                     reserve blocks, publish PrefillJob      prefill locally
                                    |
               PrefillDone (ok) --> bytes in place --> first token, decode on
               PrefillDone (fail) or timeout ------> prefill locally

Who frees what: a request's blocks are the engine's (``drop`` aborts it there, a finish frees
them in the step); a remote prefill's blocks, and a late copy's, are ``RemoteKv``'s to give
back (its docstring); peers' pins, ``PeerFetch``'s (or their lease, expired between steps in
``load``). The parts get what they need of the worker in one ``WorkerContext``.

Request-scoped messages count only from the peer the request is bound to: a ``Cancel`` must
name the request's reply subject (only its gateway knows it), a ``PrefillDone`` must carry its
job's token. Anything else is logged, counted and dropped (``WorkerContext.refuse``).
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING

from decode.admission import Admission
from decode.context import WorkerContext
from decode.emission import Emission
from decode.lifecycle import Event, ReqState
from decode.remote import RemoteKv
from decode.request import DecodeRequest
from engine.core import EngineCore
from engine.scheduler import StepOutput
from kvstore.transfer import KvReceiver, host_id, make_receiver
from mesh import metrics
from mesh.protocol import Cancel, GenerateRequest, PrefillDone, TokenChunk
from worker.base import WorkerBase, build_engine

if TYPE_CHECKING:
    from decode.peerfetch import PeerFetch


class DecodeWorker(WorkerBase):
    role = "decode"
    publishes_kv_events = True

    def __init__(self, settings):
        super().__init__(settings)
        self.active: dict[str, DecodeRequest] = {}
        self.receivers: dict[str, KvReceiver] = {}
        # the parts, made in setup (they need the bus and the engine loop)
        self.ctx: WorkerContext | None = None
        self.admission: Admission | None = None
        self.remote: RemoteKv | None = None
        self.emission: Emission | None = None
        self.peer_fetch: PeerFetch | None = None  # with --peer-fetch (issue 20)

    # -- setup --------------------------------------------------------------------
    def build(self) -> EngineCore:
        shm = None
        if "shm" in self.transport_names():
            from kvstore.transfer.shm import remove_stale_files, shm_path

            remove_stale_files()
            shm = shm_path(self.worker_id)
        return build_engine(self.settings, shm_path=shm, remote_ranks=self.remote_ranks)

    def transport_names(self) -> list[str]:
        return self.settings.transport_names()

    async def setup(self, stack: AsyncExitStack) -> None:
        bus, model = self.bus, self.engine.model_name
        for name in self.transport_names():
            rx = make_receiver(name, kv=self.engine.kv_cache, bus=bus, model=model, worker_id=self.worker_id)
            if hasattr(rx, "start"):
                await rx.start()
            if hasattr(rx, "close"):
                stack.push_async_callback(_close, rx)
            self.receivers[name] = rx
        self.ctx = ctx = WorkerContext(self.worker_id, self.role, self.settings, bus, self.engine, self.loop,
                                       self.counters, self.transport_names(), self._tasks,
                                       self.shared.membership if self.shared is not None else None,
                                       self.shared.links if self.shared is not None else None)
        if self.settings.peer_fetch:
            from decode.peerfetch import PeerFetch  # imports torch, which the mocker never loads

            self.peer_fetch = PeerFetch(ctx, self.settings.peer_fetch_timeout)
        self.remote = RemoteKv(ctx, self.active, self.receivers, self._drop)
        self.admission = Admission(ctx, self.active, self.remote, self.peer_fetch,
                                   accepting=lambda: self.status == "ready")
        self.emission = Emission(ctx, self.active, self.admission.admitted_locally)
        stack.callback(self.emission.links.close)  # after the drain's last chunks went out on them
        await self.admission.start(stack)
        self.admission.membership.on_change(self._on_member)
        stack.callback(self.admission.membership.off_change, self._on_member)
        s = bus.subjects
        await ctx.subscribe(stack, s.generate(model, self.worker_id), self._admit_soon, GenerateRequest)
        await ctx.subscribe(stack, s.cancel(model, self.worker_id), self._on_cancel, Cancel)
        await ctx.subscribe(stack, s.kv_ready(model, self.worker_id), self.remote.on_kv_ready, PrefillDone)
        if self.peer_fetch is not None:
            await self.peer_fetch.start(stack, self.admission.membership)

    def _on_member(self, worker_id: str, card) -> None:
        """A worker left the registry: a transport fenced on its word stops waiting for it."""
        if card is None:
            for rx in self.receivers.values():
                if hasattr(rx, "writer_left"):
                    rx.writer_left(worker_id)

    def card(self):
        card = super().card()
        card.capacity = self.engine.scheduler.config.max_num_seqs
        card.transports = {name: {} for name in self.receivers}
        kv = self.engine.kv_cache
        if "shm" in card.transports:
            card.transports["shm"] = {"path": kv.shm_path, "host": host_id()}
        if "nixl" in card.transports:  # its agent; the metadata is asked on its subject, once per peer
            card.transports["nixl"] = self.receivers["nixl"].card_params()
        if self.peer_fetch is not None:
            self.peer_fetch.fill_card(card)
        return card

    def load(self, engine):
        if self.peer_fetch is not None:
            engine.expire_pins()  # between steps: a fetch whose requester vanished frees its pins here
        report = super().load(engine)
        report.capacity = engine.scheduler.config.max_num_seqs
        ttft, itl = self.emission.ttft, self.emission.itl
        report.ttft_ms = ttft.mean() * 1000
        report.itl_ms = itl.mean() * 1000
        report.ttft_p90_ms = ttft.quantile(0.9) * 1000
        report.itl_p90_ms = itl.quantile(0.9) * 1000
        return report

    def in_flight(self) -> int:
        return len(self.active)

    # -- requests -----------------------------------------------------------------
    async def _admit_soon(self, req: GenerateRequest, raw) -> None:
        """A subscription runs its handler one message at a time, and admitting waits for the engine
        to finish its step: handled inline, a worker would take one new request per step."""
        self.ctx.spawn(self.on_generate(req, raw))

    async def on_generate(self, req: GenerateRequest, raw) -> None:
        """A generate request, in a task of its own (a subclass may do more first: the mocker's
        peer fetch)."""
        await self.admission.generate(req, raw)

    async def _on_cancel(self, msg: Cancel, raw) -> None:
        rec = self.active.get(msg.request_id)
        if rec is None:
            return
        if msg.reply != rec.reply:
            self.ctx.refuse("unbound_cancel", msg.request_id, "Cancel from a sender that did not send the request")
            return
        self.counters.cancelled += 1
        if rec.move(Event.CANCEL) is ReqState.CANCELLED:
            await self._drop(rec, "cancelled")
        # CANCELLING: freed once the prefill worker is done with the blocks (RemoteKv)

    async def _drop(self, rec: DecodeRequest, outcome: str) -> None:
        """Forget a request that ended without its last chunk, and free it in the engine."""
        rid = rec.request_id
        if self.active.get(rid) is rec:
            del self.active[rid]
        rec.end_spans(outcome)
        metrics.WORKER_REQUESTS.labels(rec.request.model, self.role, outcome).inc()
        await self.loop.call(partial(EngineCore.abort, request_id=rid))

    # -- streaming: one message per step per destination ---------------------------------
    async def handle_outputs(self, outs: list[StepOutput]) -> None:
        await self.emission.handle_outputs(outs)

    async def drain(self, stop: asyncio.Event | None = None) -> None:
        await super().drain(stop)
        await self.abort_all("the worker stopped before the request finished", 503)

    async def abort_all(self, message: str, status: int) -> None:
        """End every live request with an error chunk (503: the gateway resumes it elsewhere)."""
        for rec in list(self.active.values()):
            rec.move(Event.ABORT)
            del self.active[rec.request_id]
            rec.end_spans("aborted")
            metrics.WORKER_REQUESTS.labels(rec.request.model, self.role, "aborted").inc()
            chunk = TokenChunk(rec.request_id, rec.chunks_sent, finish_reason="error", error=message,
                               error_status=status, worker=self.worker_id)
            with contextlib.suppress(Exception):
                await self.emission.send_last(rec, chunk)


async def _close(rx) -> None:
    with contextlib.suppress(Exception):
        result = rx.close()
        if asyncio.iscoroutine(result):
            await result
