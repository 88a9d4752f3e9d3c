"""The decode worker: owns each request from ``GenerateRequest`` to the last ``TokenChunk``.

Each request is one ``DecodeRequest`` whose ``state`` moves only through ``decode.lifecycle``
(the table of every transition). Each engine step's outputs leave as one ``TokenBatch`` per
gateway (its ``batch_to`` subject), or one ``TokenChunk`` per request for clients that ask for
none, and update the metrics once.

Per request:

    generate --> prefix match --> uncached >= threshold and prefill pool free?
                                    | yes                          | no
                     reserve blocks, publish PrefillJob      prefill locally
                                    |
               PrefillDone (ok) --> bytes in place --> first token, decode on
               PrefillDone (fail) or timeout ------> prefill locally

Who frees the blocks of a remote prefill: the engine, once ``complete_remote``
(they join the running sequence) or ``fail_remote`` (they are freed and the
request is requeued) runs. Never while the prefill worker may still write them:
after its PrefillDone (sent once its copy has ended), or at the job's deadline
once every transport has revoked the job (``KvReceiver.revoke``: no write can
land any more). A copy still running at the deadline does not hold the request
up (it prefills locally, in other blocks), but its blocks stay out of the pool
(``_Fence``) until the writer is known to have stopped. A cancel during a
remote prefill is deferred the same way.

Request-scoped messages count only from the peer the request is bound to: a
``Cancel`` must name the request's reply subject (only its gateway knows it), a
``PrefillDone`` must carry its job's token (only the prefill worker that pulled the
job knows it). Anything else is logged, counted and dropped (``_refuse``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from opentelemetry import trace

from decode.lifecycle import Event, ReqState, advance
from engine.core import EngineCore
from engine.scheduler import StepOutput
from engine.sequence import SampledToken, Sequence
from kvstore.transfer import KvReceiver, host_id, make_receiver
from mesh import metrics
from mesh.errors import RequestError, UnknownAdapterError
from mesh.prefill_queue import PrefillQueue
from mesh.protocol import (
    Cancel,
    GenerateRequest,
    LoadReport,
    PrefillDone,
    PrefillJob,
    TokenBatch,
    TokenChunk,
    Usage,
)
from mesh.registry import Membership
from mesh.telemetry import tracer
from mesh.tracing import child_context, context_from
from worker.base import (
    Window,
    WorkerBase,
    build_engine,
    engine_logprob,
    prepare_grammar,
    sampling_params,
    wire_logprob,
)

log = logging.getLogger(__name__)

FENCE_POLL = 0.05  # seconds between asking the transports whether a late copy has ended
TRACER = tracer("pdmesh.decode")
_ADMITTED_HERE = (ReqState.ADMITTING, ReqState.PREFILLING)  # an overflow prompt's states until its first token
_EMITTING = (ReqState.PREFILLING, ReqState.DECODING)  # the states whose step outputs go out


METRICS_FLUSH_S = 0.1


@dataclass(slots=True)
class _StepStats:
    """What one step's outputs add to the metrics, gathered while its chunks are built."""

    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    gaps: dict[float, int] = field(default_factory=dict)  # inter-token gap -> tokens (most share one)
    interactive_gap: float = 0.0  # sum of gap x tokens over interactive requests
    interactive_tokens: int = 0
    finished: list = field(default_factory=list)  # (output, e2e seconds) of requests that ended


@dataclass(slots=True)
class DecodeRequest:
    """Everything the worker knows of one request; ``state`` moves only through ``move``."""

    request: GenerateRequest
    reply: str
    seq: Sequence
    arrived: float
    state: ReqState = ReqState.ADMITTING
    chunks_sent: int = 0  # the next chunk's index
    last_token_at: float = 0.0
    deadline: asyncio.TimerHandle | None = None  # WAITING_FOR_KV / CANCELLING: the prefill job's deadline
    job_token: str = ""  # the prefill job's capability: its PrefillDone must carry it
    dest: list[int] = field(default_factory=list)  # the blocks the prefill worker writes
    span: trace.Span | None = None  # decode.request: arrival to the last token
    phase: trace.Span | None = None  # its current child: prefill.local | prefill.remote | decode
    overflow: bool = False  # prefilled here although meant for the prefill pool (no room, or a fallback)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def move(self, event: Event) -> ReqState:
        self.state = advance(self.state, event)
        return self.state

    def enter(self, name: str, **attributes) -> trace.Span:
        """End the current phase span and start the next one under the request's span."""
        if self.phase is not None:
            self.phase.end()
        self.phase = TRACER.start_span(name, context=child_context(self.span), attributes=attributes)
        return self.phase

    def end_spans(self, outcome: str, **attributes) -> None:
        if self.phase is not None:
            self.phase.end()
            self.phase = None
        if self.span is not None:
            self.span.set_attributes({"pdmesh.outcome": outcome, **attributes})
            self.span.end()
            self.span = None


@dataclass(slots=True)
class _Fence:
    """Blocks of a timed-out job that a copy may still be writing: out of the pool until it stops."""

    token: str
    blocks: list[int]
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # its PrefillDone came


class DecodeWorker(WorkerBase):
    role = "decode"
    publishes_kv_events = True

    def __init__(self, settings):
        super().__init__(settings)
        self.active: dict[str, DecodeRequest] = {}
        self.receivers: dict[str, KvReceiver] = {}
        self.fences: dict[str, _Fence] = {}  # request id -> blocks a late copy may still write
        self.prefill_loads: dict[str, LoadReport] = {}
        self.membership: Membership | None = None
        self.jobs: PrefillQueue | None = None
        self.ttft = Window()
        self.itl = Window()
        self.peer_fetch = None  # decode.peerfetch.PeerFetch with --peer-fetch (issue 20)
        self._unflushed: list[_StepStats] = []  # steps whose figures Prometheus has not had yet
        self._flushed_at = 0.0

    # -- setup --------------------------------------------------------------------
    def build(self) -> EngineCore:
        shm = None
        if "shm" in self.transport_names():
            from kvstore.transfer.shm import remove_stale_files, shm_path

            remove_stale_files()
            shm = shm_path(self.worker_id)
        return build_engine(self.settings, shm_path=shm)

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
        self.step_metrics = metrics.StepMetrics.of(model, self.role)
        self.jobs = PrefillQueue(bus, model)
        self.membership = Membership(bus, ttl=self.settings.registry_ttl)
        await self.membership.start(wait=1.0)
        stack.push_async_callback(self.membership.stop)
        s = bus.subjects
        subs = [
            await bus.subscribe(s.generate(model, self.worker_id), self._admit_soon, GenerateRequest),
            await bus.subscribe(s.cancel(model, self.worker_id), self._on_cancel, Cancel),
            await bus.subscribe(s.kv_ready(model, self.worker_id), self._on_kv_ready, PrefillDone),
            await bus.subscribe(s.load_model(model), self._on_load, LoadReport),
        ]
        for sub in subs:
            stack.push_async_callback(_unsubscribe, sub)
        if self.settings.peer_fetch:
            from decode.peerfetch import PeerFetch

            self.peer_fetch = PeerFetch(self, self.settings.peer_fetch_timeout)
            await self.peer_fetch.start(stack)

    def card(self):
        card = super().card()
        card.capacity = self.engine.scheduler.config.max_num_seqs
        card.transports = {name: {} for name in self.receivers}
        kv = self.engine.kv_cache
        if "shm" in card.transports:
            card.transports["shm"] = {"path": kv.shm_path, "host": host_id()}
        if self.peer_fetch is not None:
            self.peer_fetch.fill_card(card)
        return card

    def load(self, engine):
        if self.peer_fetch is not None:
            engine.pins.expire()  # between steps: a fetch whose requester vanished frees its pins here
        report = super().load(engine)
        report.capacity = engine.scheduler.config.max_num_seqs
        report.ttft_ms = self.ttft.mean() * 1000
        report.itl_ms = self.itl.mean() * 1000
        report.ttft_p90_ms = self.ttft.quantile(0.9) * 1000
        report.itl_p90_ms = self.itl.quantile(0.9) * 1000
        return report

    def in_flight(self) -> int:
        return len(self.active)

    def _queued(self) -> int:
        """Requests admitted here that have not produced their first token yet."""
        return sum(1 for r in self.active.values() if r.state < ReqState.DECODING)

    @property
    def _max_queued(self) -> int:
        return self.settings.max_queued or 4 * self.engine.scheduler.config.max_num_seqs

    # -- requests -----------------------------------------------------------------
    async def _admit_soon(self, req: GenerateRequest, raw) -> None:
        """A subscription runs its handler one message at a time, and admitting waits for the engine
        to finish its step: handled inline, a worker would take one new request per step."""
        task = asyncio.create_task(self._on_generate(req, raw))
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def _on_generate(self, req: GenerateRequest, raw) -> None:
        if not raw.reply:
            log.warning("generate %s without a reply subject: dropped", req.request_id)
            return
        error = self._refusal(req)
        seq = None
        if error is None:
            try:
                seq = self.engine.new_sequence(req.token_ids, sampling_params(req.sampling),
                                               request_id=req.request_id, lora=req.adapter or None)
                if not 0 <= req.output_offset < len(req.token_ids):
                    raise ValueError(f"output_offset {req.output_offset} does not fit the prompt")
            except UnknownAdapterError as e:
                error = (str(e), 404)
            except (RequestError, ValueError) as e:
                error = (str(e), 400)
        if error is not None:
            await self._fail(raw.reply, req.request_id, *error)
            return
        seq.output_offset = req.output_offset  # before the grammar replays the tokens generated so far
        seq.priority = req.priority
        self.counters.requests += 1
        rec = DecodeRequest(req, raw.reply, seq, time.monotonic())
        rec.span = TRACER.start_span(
            "decode.request", context=context_from(raw.headers), kind=trace.SpanKind.SERVER,
            attributes={"pdmesh.request_id": req.request_id, "pdmesh.model": req.model,
                        "pdworker.base": self.worker_id, "pdmesh.prompt_tokens": len(req.token_ids)},
        )
        self.active[req.request_id] = rec
        if seq.params.constraint is not None and not await self._grammar_ready(rec):
            return
        if self.peer_fetch is not None and req.peer_fetch is not None:
            span = rec.enter("peer.fetch", **{"pdmesh.fetch_source": req.peer_fetch.fetch_source})
            span.set_attribute("pdmesh.fetched_blocks", await self.peer_fetch.fetch_for(req))  # staged for admission
            if rec.state is not ReqState.ADMITTING:
                return  # cancelled or aborted meanwhile: nothing reached the engine yet
        threshold = self.settings.disagg_threshold
        route = self._prefill_route(req.adapter) if seq.num_prompt_tokens >= threshold else "local"
        rec.overflow = route == "overflow"  # set now: the next long prompt's decision sees it
        # (a late copy of its last job may still run: a fenced request prefills here)
        want_remote = route == "remote" and req.request_id not in self.fences

        def admit(engine: EngineCore):
            if want_remote and engine.num_uncached_tokens(seq) >= threshold and engine.reserve_remote(seq):
                return list(seq.block_table), seq.num_cached_tokens
            engine.add(seq)
            return None

        reservation = await self.loop.call(admit)
        if rec.state is not ReqState.ADMITTING:
            return  # cancelled meanwhile (its abort was queued after the admission), or already emitting
        if reservation is None:
            self._admitted_locally(rec)
        else:
            rec.move(Event.REMOTE)
            metrics.PREFILL_DECISIONS.labels(req.model, "remote").inc()
            await self._send_job(rec, *reservation)

    async def _grammar_ready(self, rec: DecodeRequest) -> bool:
        """Compile the request's constraint and build its matcher before the engine takes it (in a
        thread: a compile never stalls a step or the event loop). False: it was cancelled meanwhile,
        or refused with a 400 (a grammar that does not compile, or tokens it rejects)."""
        refused = await prepare_grammar(self.engine, rec.seq)
        if rec.state is not ReqState.ADMITTING:
            return False  # cancelled while it compiled (_on_cancel dropped it)
        if refused is None:
            return True
        rec.move(Event.REFUSE)
        del self.active[rec.request_id]
        rec.end_spans("refused")
        await self._fail(rec.reply, rec.request_id, refused, 400)
        return False

    def _admitted_locally(self, rec: DecodeRequest) -> None:
        """ADMITTING -> PREFILLING. Runs when the admission returns, or earlier, when the engine's
        first output for the request is delivered before the admission's own result is."""
        rec.move(Event.LOCAL)
        n = len(rec.request.token_ids)
        self.counters.bump("local_prefill")
        self.counters.bump("local_prefill_tokens", n)
        if n >= self.settings.disagg_threshold:  # meant for the prefill pool, which had no room
            self.counters.bump("overflow_prefill_tokens", n)
        metrics.PREFILL_DECISIONS.labels(rec.request.model, "local").inc()
        rec.enter("prefill.local")

    def _refusal(self, req: GenerateRequest) -> tuple[str, int] | None:
        """Why this worker will not take the request (message, status), or None."""
        if self.status != "ready":
            return "worker is draining", 503
        if req.model != self.engine.model_name:
            return f"model {req.model!r} is not served here", 404
        if req.request_id in self.active:
            return "duplicate request id", 409
        if self._queued() >= self._max_queued:
            self.counters.bump("rejected_overloaded")
            return "worker overloaded: too many requests queued", 429
        return None

    async def _send_job(self, rec: DecodeRequest, block_table: list[int], num_cached: int) -> None:
        rid = rec.request_id
        dest = block_table[num_cached // self.engine.block_size :]
        timeout = self.settings.prefill_timeout
        req = rec.request
        rec.job_token, rec.dest = secrets.token_hex(16), dest
        job = PrefillJob(
            request_id=rid, model=self.engine.model_name, token_ids=req.token_ids,
            decode_worker=self.worker_id, num_cached_tokens=num_cached, dest_block_ids=dest,
            transports={n: rx.params(rid, dest) for n, rx in self.receivers.items()},
            deadline=time.time() + timeout, block_size=self.engine.block_size,
            sampling=req.sampling, created=time.time(), output_offset=req.output_offset,
            priority=req.priority, token=rec.job_token, adapter=req.adapter,
        )
        rec.deadline = asyncio.get_running_loop().call_later(timeout, self._on_deadline, rid)
        span = rec.enter("prefill.remote", **{"pdmesh.cached_tokens": num_cached, "pdmesh.blocks": len(dest)})
        try:
            await self.jobs.publish(job, span=span)
            self.counters.bump("remote_prefill_sent")
        except Exception as e:
            # Nobody took the job, so nobody can write the blocks: prefill locally now.
            log.warning("could not queue prefill job %s: %s", rid, e)
            await self._remote_ended(rec, ok=False, writer_done=False)

    def _on_deadline(self, rid: str) -> None:
        rec = self.active.get(rid)
        if rec is not None and rec.state in (ReqState.WAITING_FOR_KV, ReqState.CANCELLING):
            if rec.state is ReqState.WAITING_FOR_KV:
                log.warning("no prefill result for %s in time: prefilling locally", rid)
                self.counters.bump("remote_prefill_timeout")
            rec.deadline = None  # this is it firing
            self._spawn(self._remote_ended(rec, ok=False, writer_done=False))

    async def _on_kv_ready(self, done: PrefillDone, raw) -> None:
        fence = self.fences.get(done.request_id)
        if fence is not None and done.token == fence.token:
            fence.stopped.set()  # the late copy has ended: its blocks can go back to the pool
            return
        rec = self.active.get(done.request_id)
        if rec is None or rec.state not in (ReqState.WAITING_FOR_KV, ReqState.CANCELLING):
            return  # late: already fell back or cancelled
        if done.token != rec.job_token:
            self._refuse("unbound_prefill_done", done.request_id,
                         f"PrefillDone claiming to be from {done.prefill_worker!r} without the job's token")
            return
        ok = done.ok and done.transport in self.receivers
        if ok:
            ok = await self.receivers[done.transport].finish(done.request_id)
        if ok:
            self.counters.bump("remote_prefill_done")
            self.counters.bump(f"transport_{done.transport}")
            if rec.phase is not None:
                rec.phase.set_attributes({"pdmesh.transport": done.transport,
                                          "pdmesh.transfer_bytes": done.transfer_bytes,
                                          "pdmesh.prefill_worker": done.prefill_worker})
        elif rec.state is ReqState.WAITING_FOR_KV:
            log.warning("prefill of %s failed (%s): prefilling locally", done.request_id, done.error)
            self.counters.bump("remote_prefill_failed")
        await self._remote_ended(rec, ok, SampledToken(done.token_id, engine_logprob(done.logprob)))

    async def _remote_ended(self, rec: DecodeRequest, ok: bool, first: SampledToken | None = None,
                            writer_done: bool = True) -> None:
        """The prefill worker is done with the blocks (it finished or failed: ``writer_done``), or
        its deadline passed (a copy may still be running: then the blocks are fenced): a cancelled
        request frees them; otherwise the request goes on here, from its first token (``ok``) or
        from a local prefill."""
        if rec.deadline is not None:
            rec.deadline.cancel()
            rec.deadline = None
        rid = rec.request_id
        if rec.state not in (ReqState.WAITING_FOR_KV, ReqState.CANCELLING):
            return  # a PrefillDone and the deadline raced: the first one decided
        if writer_done or self._writes_revoked(rid):
            for rx in self.receivers.values():
                rx.forget(rid)
        else:
            await self._fence(rec)
        if rec.state is ReqState.CANCELLING:
            rec.move(Event.RELEASED)
            await self._drop(rec, "cancelled")
            return
        if ok:
            rec.move(Event.KV_READY)

            def complete(engine: EngineCore) -> None:
                # Emitted from the engine thread, so the first token is queued before any later step's.
                out = engine.complete_remote(rid, first)
                if out is not None:
                    self.loop.emit([out])

            await self.loop.call(complete)
            return
        rec.move(Event.FALLBACK)
        rec.overflow = True
        self.counters.bump("local_prefill_fallback")
        self.counters.bump("overflow_prefill_tokens", len(rec.request.token_ids))
        metrics.PREFILL_DECISIONS.labels(self.engine.model_name, "fallback").inc()
        rec.enter("prefill.local", **{"pdmesh.fallback": True})
        await self.loop.call(lambda e: e.fail_remote(rid))

    # -- fences: blocks a late copy may still write ----------------------------------
    def _writes_revoked(self, rid: str) -> bool:
        """Revoke the job on every transport: True when no write into its blocks can land any more."""
        return all([rx.revoke(rid) for rx in self.receivers.values()])

    async def _fence(self, rec: DecodeRequest) -> None:
        """Keep the job's blocks out of the pool (one more reference, taken before the request lets
        go of them) until its writer has stopped; ``_unfence`` gives them back."""
        fence = _Fence(rec.job_token, rec.dest)
        self.fences[rec.request_id] = fence
        await self.loop.call(lambda e: e.pool.hold(fence.blocks))
        metrics.FENCED_BLOCKS.labels(self.engine.model_name).inc(len(fence.blocks))
        self.counters.bump("fenced_jobs")
        log.warning("prefill of %s is late and its copy may still run: %d blocks fenced until it stops",
                    rec.request_id, len(fence.blocks))
        self._spawn(self._unfence(rec.request_id, fence))

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
        await self.loop.call(lambda e: e.pool.free(fence.blocks))
        metrics.FENCED_BLOCKS.labels(self.engine.model_name).dec(len(fence.blocks))
        self.counters.bump("unfenced_jobs")
        log.info("the late copy of %s stopped after %.2fs: %d blocks back in the pool",
                 rid, time.monotonic() - started, len(fence.blocks))

    def _refuse(self, reason: str, rid: str, what: str) -> None:
        """A request-scoped message from a peer the request is not bound to: logged, counted, dropped."""
        log.warning("refused a message for %s: %s", rid, what)
        metrics.REFUSED_MESSAGES.labels(self.role, reason).inc()
        self.counters.bump("refused_messages")

    async def _on_cancel(self, msg: Cancel, raw) -> None:
        rec = self.active.get(msg.request_id)
        if rec is None:
            return
        if msg.reply != rec.reply:
            self._refuse("unbound_cancel", msg.request_id, "Cancel from a sender that did not send the request")
            return
        self.counters.cancelled += 1
        if rec.move(Event.CANCEL) is ReqState.CANCELLED:
            await self._drop(rec, "cancelled")
        # CANCELLING: freed once the prefill worker is done with the blocks (_remote_ended)

    async def _drop(self, rec: DecodeRequest, outcome: str) -> None:
        """Forget a request that ended without its last chunk, and free it in the engine."""
        rid = rec.request_id
        if self.active.get(rid) is rec:
            del self.active[rid]
        rec.end_spans(outcome)
        metrics.WORKER_REQUESTS.labels(rec.request.model, self.role, outcome).inc()
        await self.loop.call(lambda e: e.abort(rid))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    # -- streaming: one message per step per destination ---------------------------------
    async def handle_outputs(self, outs: list[StepOutput]) -> None:
        """A step's outputs: one ``TokenBatch`` per ``batch_to`` subject, a ``TokenChunk`` per
        request for the rest; the step's metrics in one update."""
        now = time.monotonic()
        batches: dict[str, list[TokenChunk]] = {}
        singles: list[tuple[str, TokenChunk]] = []
        step = _StepStats()
        active = self.active
        for out in _per_request(outs):
            rec = active.get(out.request_id)
            if rec is None:
                continue  # cancelled, or the tail of a request that already ended
            if rec.state not in _EMITTING:
                if rec.state is not ReqState.ADMITTING:
                    continue  # cancelled (CANCELLED requests are gone from ``active``; CANCELLING wait)
                # The engine stepped it before the event loop saw the admission's result (both
                # come from the engine thread; the step's outputs can be handled first).
                self._admitted_locally(rec)
            chunk = self._chunk(rec, out, now, step)
            to = rec.request.batch_to
            if to:
                chunk.stream = rec.request.stream
                batch = batches.get(to)
                if batch is None:
                    batches[to] = [chunk]
                else:
                    batch.append(chunk)
            else:
                singles.append((rec.reply, chunk))
        self._record(step, now)
        publish = self.bus.publish
        for subject, chunks in batches.items():
            await publish(subject, TokenBatch(self.worker_id, chunks), traced=False)
        for reply, chunk in singles:
            await publish(reply, chunk, traced=False)

    def _chunk(self, rec: DecodeRequest, out: StepOutput, now: float, step: _StepStats) -> TokenChunk:
        """The request's next chunk; moves its state and counts the step's figures."""
        ids = out.new_token_ids
        n = len(ids)
        step.tokens += n
        interactive = rec.request.priority >= 0  # the SLA windows (and so the planner) count only these
        if rec.state is ReqState.PREFILLING:
            step.ttfts.append(now - rec.arrived)
            if interactive:
                self.ttft.add(now - rec.arrived)
            if out.finish_reason is None:
                rec.move(Event.FIRST_TOKEN)
                rec.enter("decode")
        elif n:
            gap = (now - rec.last_token_at) / n
            step.gaps[gap] = step.gaps.get(gap, 0) + n
            if interactive:
                step.interactive_gap += gap * n
                step.interactive_tokens += n
        rec.last_token_at = now
        chunk = TokenChunk(out.request_id, rec.chunks_sent, ids,
                           [wire_logprob(lp) for lp in out.new_logprobs] if out.new_logprobs else [],
                           out.finish_reason, worker=self.worker_id)
        if rec.chunks_sent == 0 or out.finish_reason is not None:
            chunk.usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        rec.chunks_sent += 1
        if out.finish_reason is not None:
            self._finish(rec, out, now, step)
            if out.finish_reason == "error":
                chunk.error, chunk.error_status = "the engine failed on this request", 500
        return chunk

    def _finish(self, rec: DecodeRequest, out: StepOutput, now: float, step: _StepStats) -> None:
        failed = out.finish_reason == "error"
        rec.move(Event.ERROR if failed else Event.FINISH)
        del self.active[rec.request_id]
        self.counters.finished += 1
        step.finished.append((out, now - rec.arrived))
        rec.end_spans("error" if failed else "finished",
                      **{"pdmesh.output_tokens": out.num_output_tokens, "pdmesh.cached_tokens": out.num_cached_tokens,
                         "pdmesh.finish_reason": out.finish_reason})

    def _record(self, step: _StepStats, now: float) -> None:
        """One step's figures. The SLA windows take them now; Prometheus (a lock per update) every
        ``METRICS_FLUSH_S`` in one update per metric, and whenever a request ends, so a request's
        figures are exported before its last chunk is sent."""
        if not step.tokens and not step.finished:
            return
        self.counters.bump("decode_tokens", step.tokens)
        if step.interactive_tokens:
            self.itl.add(step.interactive_gap / step.interactive_tokens)
        self._unflushed.append(step)
        if step.finished or now - self._flushed_at >= METRICS_FLUSH_S:
            self._flush_metrics(now)

    def _flush_metrics(self, now: float) -> None:
        steps, self._unflushed = self._unflushed, []
        self._flushed_at = now
        m = self.step_metrics
        gaps: dict[float, int] = {}
        tokens = 0
        for step in steps:
            tokens += step.tokens
            for ttft in step.ttfts:
                m.ttft.observe(ttft)
            for gap, count in step.gaps.items():
                gaps[gap] = gaps.get(gap, 0) + count
            for out, e2e in step.finished:
                (m.failed if out.finish_reason == "error" else m.finished).inc()
                m.e2e.observe(e2e)
                m.prompt_tokens.inc(out.num_prompt_tokens)
                m.cached_tokens.inc(out.num_cached_tokens)
        m.output_tokens.inc(tokens)
        metrics.observe_counts(m.itl, gaps)

    async def _fail(self, reply: str, rid: str, message: str, status: int) -> None:
        self.counters.errors += 1
        await self.bus.publish(
            reply, TokenChunk(rid, 0, finish_reason="error", error=message, error_status=status,
                              worker=self.worker_id)
        )

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
                await self.bus.publish(rec.reply, chunk, traced=False)

    # -- the prefill pool -----------------------------------------------------------
    async def _on_load(self, report: LoadReport, raw) -> None:
        if report.role == "prefill":
            self.prefill_loads[report.worker_id] = report

    def _prefill_route(self, adapter: str = "") -> str:
        """Where a long prompt is prefilled: ``remote`` while a live prefill worker (holding the
        request's LoRA adapter) has room; ``local`` with no prefill worker at all. When none has
        room, ``overflow`` (here) for one prompt at a time: each is a long step for every stream
        this worker decodes, and prompts admitted here stay here, so a backlog of them would
        outlast the prefill pool's scaling up. Past that one, ``remote`` anyway: they queue for
        the pool (a JetStream work queue, pulled by the next free prefill worker;
        ``prefill_timeout`` still falls back here). Per request; the load data is per second."""
        cards = [c for c in self.membership.cards(self.engine.model_name, "prefill")
                 if c.status == "ready" and (not adapter or adapter in c.adapters)]
        if not cards:
            return "local"
        capacity = sum(c.capacity for c in cards)
        busy = sum(r.active_jobs for w, r in self.prefill_loads.items() if any(c.worker_id == w for c in cards))
        mine = sum(1 for r in self.active.values() if r.state is ReqState.WAITING_FOR_KV)
        if mine < capacity and busy < capacity:
            return "remote"
        if any(r.overflow and r.state in _ADMITTED_HERE for r in self.active.values()):
            self.counters.bump("queued_for_prefill_pool")  # past the pool's room: it waits in the queue
            return "remote"
        return "overflow"


def _per_request(outs: list[StepOutput]) -> list[StepOutput] | dict.values:
    """One output per request: a request with outputs of several steps (the event loop took
    them together) gets one with all their tokens, and the last one's finish and counts."""
    merged: dict[str, StepOutput] = {}
    for out in outs:
        prev = merged.get(out.request_id)
        merged[out.request_id] = out if prev is None else StepOutput(
            out.request_id, prev.new_token_ids + out.new_token_ids, prev.new_logprobs + out.new_logprobs,
            out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens)
    return outs if len(merged) == len(outs) else merged.values()


async def _close(rx) -> None:
    with contextlib.suppress(Exception):
        result = rx.close()
        if asyncio.iscoroutine(result):
            await result


async def _unsubscribe(sub) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
