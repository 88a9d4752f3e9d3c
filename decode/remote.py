"""A decode worker's remote prefills: the jobs it sends, and the KV they write into its blocks.

    admission reserved blocks --> send_job: PrefillJob (token, dest blocks, transports), deadline
    PrefillDone (ok, its token) --> the receiver finishes the bytes --> first token, decode on
      (nixl carries it in the notification after the bytes: no NATS hop; the NATS one then is late)
    PrefillDone (fail) or the deadline ----------------------------------> prefill locally

Who frees the blocks of a remote prefill: the engine, once ``complete_remote``
(they join the running sequence) or ``fail_remote`` (they are freed and the
request is requeued) runs. Never while the prefill worker may still write them:
after its PrefillDone (sent once its copy has ended), or at the job's deadline
once every transport has revoked the job (``KvReceiver.revoke``: no write can
land any more). A copy still running at the deadline does not hold the request
up (it prefills locally, in other blocks), but its blocks stay out of the pool
(``_Fence``: one more reference each) until the writer is known to have stopped,
and ``_unfence`` gives them back. A cancel during a remote prefill is deferred the
same way: the request is dropped (``drop``) once the writer is done with its blocks.

A ``PrefillDone`` counts only if it carries its job's token (only the prefill
worker that pulled the job knows it); any other is refused (``WorkerContext.refuse``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from decode.context import WorkerContext
from decode.lifecycle import Event, ReqState
from decode.request import DecodeRequest, RemoteJob
from engine.core import EngineCore
from engine.sequence import SampledToken
from kvstore.transfer import KvReceiver
from mesh import metrics
from mesh.prefill_queue import PrefillQueue
from mesh.protocol import DecodeError, PrefillDone, PrefillJob, decode
from worker.base import engine_logprob

log = logging.getLogger(__name__)

FENCE_POLL = 0.05  # seconds between asking the transports whether a late copy has ended
_REMOTE = (ReqState.WAITING_FOR_KV, ReqState.CANCELLING)  # a prefill worker may write the blocks


@dataclass(slots=True)
class _Fence:
    """Blocks of a timed-out job that a copy may still be writing: out of the pool until it stops."""

    token: str
    blocks: list[int]
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # its PrefillDone came


class RemoteKv:
    """The prefill jobs in flight, their deadlines and tokens, the receivers' per-job state and the
    fences. ``receivers`` (by transport name) are opened and closed by the worker."""

    def __init__(self, ctx: WorkerContext, active: dict[str, DecodeRequest], receivers: dict[str, KvReceiver],
                 drop: Callable[[DecodeRequest, str], Awaitable[None]]):
        self.ctx = ctx
        self.active = active
        self.receivers = receivers
        self.drop = drop  # ends a cancelled request once the writer let go of its blocks
        self.fences: dict[str, _Fence] = {}  # request id -> blocks a late copy may still write
        self.jobs = PrefillQueue(ctx.bus, ctx.model)
        for name, rx in receivers.items():
            if hasattr(rx, "on_done"):  # it may carry the PrefillDone with the bytes (nixl)
                rx.on_done = partial(self._carried, name)

    def fenced(self, rid: str) -> bool:
        """A late copy of this request's last job may still run (a new job for it must not)."""
        return rid in self.fences

    async def send_job(self, rec: DecodeRequest, block_table: list[int], num_cached: int) -> None:
        """Publish the request's prefill job for the blocks past its cached prefix (WAITING_FOR_KV)."""
        ctx, rid, req = self.ctx, rec.request_id, rec.request
        engine = ctx.engine
        dest = block_table[num_cached // engine.block_size :]
        timeout = ctx.settings.prefill_timeout
        rec.remote = remote = RemoteJob(secrets.token_hex(16), dest)
        job = PrefillJob(
            request_id=rid, model=engine.model_name, token_ids=req.token_ids,
            decode_worker=ctx.worker_id, num_cached_tokens=num_cached, dest_block_ids=dest,
            transports={n: rx.params(rid, dest) for n, rx in self.receivers.items()},
            deadline=time.time() + timeout, block_size=engine.block_size,
            sampling=req.sampling, created=time.time(), output_offset=req.output_offset,
            priority=req.priority, token=remote.token, adapter=req.adapter,
            cache_scope=req.cache_scope,
        )
        remote.deadline = asyncio.get_running_loop().call_later(timeout, self._on_deadline, rid)
        span = rec.enter("prefill.remote", **{"pdmesh.cached_tokens": num_cached, "pdmesh.blocks": len(dest)})
        try:
            await self.jobs.publish(job, span=span)
            ctx.counters.bump("remote_prefill_sent")
        except Exception as e:
            # Nobody took the job, so nobody can write the blocks: prefill locally now.
            log.warning("could not queue prefill job %s: %s", rid, e)
            await self._job_ended(rec, ok=False, writer_done=False)

    def _on_deadline(self, rid: str) -> None:
        rec = self.active.get(rid)
        if rec is not None and rec.state in _REMOTE:
            if rec.state is ReqState.WAITING_FOR_KV:
                log.warning("no prefill result for %s in time: prefilling locally", rid)
                self.ctx.counters.bump("remote_prefill_timeout")
            rec.remote.deadline = None  # this is it firing
            self.ctx.spawn(self._job_ended(rec, ok=False, writer_done=False))

    def _carried(self, transport: str, rid: str, payload: bytes) -> None:
        """``transport`` brought request ``rid``'s bytes with its PrefillDone (nixl: in the
        notification after them, from the job's granted writer): go on now, not when the same
        PrefillDone comes over NATS (that one is then late, and ignored)."""
        try:
            done = decode(payload, PrefillDone)
        except DecodeError as e:
            self.ctx.refuse("undecodable", rid, f"a PrefillDone carried by {transport} that does not decode: {e}")
            return
        if done.request_id != rid or done.transport != transport:
            self.ctx.refuse("unbound_prefill_done", rid,
                            f"a PrefillDone carried by {transport} for {done.request_id!r} over {done.transport!r}")
            return
        self.ctx.counters.bump("carried_prefill_done")
        self.ctx.spawn(self.on_kv_ready(done, None))

    async def on_kv_ready(self, done: PrefillDone, raw) -> None:
        fence = self.fences.get(done.request_id)
        if fence is not None and done.token == fence.token:
            fence.stopped.set()  # the late copy has ended: its blocks can go back to the pool
            return
        rec = self.active.get(done.request_id)
        if rec is None or rec.state not in _REMOTE:
            return  # late: already fell back or cancelled
        if done.token != rec.remote.token:
            self.ctx.refuse("unbound_prefill_done", done.request_id,
                            f"PrefillDone claiming to be from {done.prefill_worker!r} without the job's token")
            return
        counters = self.ctx.counters
        ok = done.ok and done.transport in self.receivers
        if ok:
            ok = await self.receivers[done.transport].finish(done.request_id)
            if rec.state not in _REMOTE:
                return  # the same PrefillDone came by the other way meanwhile (carried, and over NATS)
        if ok:
            counters.bump("remote_prefill_done")
            counters.bump(f"transport_{done.transport}")
            if rec.phase is not None:
                rec.phase.set_attributes({"pdmesh.transport": done.transport,
                                          "pdmesh.transfer_bytes": done.transfer_bytes,
                                          "pdmesh.prefill_worker": done.prefill_worker})
        elif rec.state is ReqState.WAITING_FOR_KV:
            log.warning("prefill of %s failed (%s): prefilling locally", done.request_id, done.error)
            counters.bump("remote_prefill_failed")
        await self._job_ended(rec, ok, SampledToken(done.token_id, engine_logprob(done.logprob)))

    async def _job_ended(self, rec: DecodeRequest, ok: bool, first: SampledToken | None = None,
                         writer_done: bool = True) -> None:
        """The prefill worker is done with the blocks (it finished or failed: ``writer_done``), or
        its deadline passed (a copy may still be running: then the blocks are fenced): a cancelled
        request frees them; otherwise the request goes on here, from its first token (``ok``) or
        from a local prefill."""
        remote = rec.remote
        if remote.deadline is not None:
            remote.deadline.cancel()
            remote.deadline = None
        rid = rec.request_id
        if rec.state not in _REMOTE:
            return  # a PrefillDone and the deadline raced: the first one decided
        if writer_done or self._writes_revoked(rid):
            for rx in self.receivers.values():
                rx.forget(rid)
        else:
            await self._fence(rec)
        if rec.state is ReqState.CANCELLING:
            rec.move(Event.RELEASED)
            await self.drop(rec, "cancelled")
            return
        loop = self.ctx.loop
        if ok:
            rec.move(Event.KV_READY)
            await loop.call(partial(self._complete, rid, first))
            return
        rec.move(Event.FALLBACK)
        rec.overflow = True
        counters = self.ctx.counters
        counters.bump("local_prefill_fallback")
        counters.bump("overflow_prefill_tokens", len(rec.request.token_ids))
        metrics.PREFILL_DECISIONS.labels(self.ctx.model, "fallback").inc()
        rec.enter("prefill.local", **{"pdmesh.fallback": True})
        await loop.call(partial(EngineCore.fail_remote, request_id=rid))

    def _complete(self, rid: str, first: SampledToken, engine: EngineCore) -> None:
        """Engine thread: the request joins the running batch with its first token, which is
        emitted from here, so it is queued before any later step's."""
        out = engine.complete_remote(rid, first)
        if out is not None:
            self.ctx.loop.emit([out])

    # -- fences: blocks a late copy may still write ----------------------------------
    def _writes_revoked(self, rid: str) -> bool:
        """Revoke the job on every transport: True when no write into its blocks can land any more."""
        return all([rx.revoke(rid) for rx in self.receivers.values()])

    async def _fence(self, rec: DecodeRequest) -> None:
        """Keep the job's blocks out of the pool (one more reference, taken before the request lets
        go of them) until its writer has stopped; ``_unfence`` gives them back."""
        fence = _Fence(rec.remote.token, rec.remote.dest)
        self.fences[rec.request_id] = fence
        await self.ctx.loop.call(partial(EngineCore.hold_blocks, blocks=fence.blocks))
        metrics.FENCED_BLOCKS.labels(self.ctx.model).inc(len(fence.blocks))
        self.ctx.counters.bump("fenced_jobs")
        log.warning("prefill of %s is late and its copy may still run: %d blocks fenced until it stops",
                    rec.request_id, len(fence.blocks))
        self.ctx.spawn(self._unfence(rec.request_id, fence))

    async def _unfence(self, rid: str, fence: _Fence) -> None:
        """Wait until the writer has stopped (its PrefillDone, or every transport revokes the job:
        the copy ended, or its process did), then free the blocks. Each wait is bounded: the
        transports are asked again every ``FENCE_POLL`` seconds."""
        started = time.monotonic()
        while not fence.stopped.is_set() and not self._writes_revoked(rid):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fence.stopped.wait(), FENCE_POLL)
        for rx in self.receivers.values():
            rx.forget(rid)
        if self.fences.get(rid) is fence:
            del self.fences[rid]
        await self.ctx.loop.call(partial(EngineCore.release_blocks, blocks=fence.blocks))
        metrics.FENCED_BLOCKS.labels(self.ctx.model).dec(len(fence.blocks))
        self.ctx.counters.bump("unfenced_jobs")
        log.info("the late copy of %s stopped after %.2fs: %d blocks back in the pool",
                 rid, time.monotonic() - started, len(fence.blocks))
