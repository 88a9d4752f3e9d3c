"""The decode worker: owns each request from ``GenerateRequest`` to the last ``TokenChunk``.

Per request:

    generate --> prefix match --> uncached >= threshold and prefill pool free?
                                    | yes                          | no
                     reserve blocks, publish PrefillJob      prefill locally
                                    |
               PrefillDone (ok) --> bytes in place --> first token, decode on
               PrefillDone (fail) or timeout ------> prefill locally

Who frees the blocks of a remote prefill: the engine, once ``complete_remote``
(they join the running sequence) or ``fail_remote`` (they are freed and the
request is requeued) runs. Never before the prefill worker's deadline has
passed or its PrefillDone has arrived, so a late write cannot land in blocks
that belong to someone else. A cancel during a remote prefill is deferred the
same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

from opentelemetry import trace

from kvstore.transfer import KvReceiver, host_id, make_receiver
from mesh import metrics
from mesh.engine.core import EngineCore
from mesh.engine.errors import RequestError
from mesh.engine.scheduler import StepOutput
from mesh.engine.sequence import SampledToken, Sequence
from mesh.prefill_queue import PrefillQueue
from mesh.protocol import (
    Cancel,
    GenerateRequest,
    LoadReport,
    PrefillDone,
    PrefillJob,
    TokenChunk,
    Usage,
)
from mesh.registry import Membership
from mesh.telemetry import tracer
from mesh.tracing import child_context, context_from
from mesh.worker import (
    Window,
    WorkerBase,
    build_engine,
    engine_logprob,
    sampling_params,
    wire_logprob,
)

log = logging.getLogger(__name__)

# After a job's deadline, how long to wait before reusing its blocks (a copy already started may finish).
DEADLINE_GRACE = 2.0
TRACER = tracer("pdmesh.decode")


@dataclass
class Active:
    request: GenerateRequest
    reply: str
    seq: Sequence
    arrived: float
    next_index: int = 0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    remote: asyncio.TimerHandle | None = None  # set while a prefill worker owns the blocks
    cancelled: bool = False
    span: trace.Span | None = None  # decode.request: arrival to the last token
    phase: trace.Span | None = None  # its current child: prefill.local | prefill.remote | decode

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


class DecodeWorker(WorkerBase):
    role = "decode"
    publishes_kv_events = True

    def __init__(self, settings):
        super().__init__(settings)
        self.active: dict[str, Active] = {}
        self.receivers: dict[str, KvReceiver] = {}
        self.prefill_loads: dict[str, LoadReport] = {}
        self.membership: Membership | None = None
        self.jobs: PrefillQueue | None = None
        self.ttft = Window()
        self.itl = Window()

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
            self.receivers[name] = rx
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

    def card(self):
        card = super().card()
        card.capacity = self.engine.scheduler.config.max_num_seqs
        card.transports = {name: {} for name in self.receivers}
        kv = self.engine.kv_cache
        if "shm" in card.transports:
            card.transports["shm"] = {"path": kv.shm_path, "host": host_id()}
        return card

    def load(self, engine):
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
        return sum(1 for a in self.active.values() if a.next_index == 0)

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
        if self.status != "ready":
            await self._fail(raw.reply, req.request_id, "worker is draining", 503)
            return
        if req.model != self.engine.model_name:
            await self._fail(raw.reply, req.request_id, f"model {req.model!r} is not served here", 404)
            return
        if req.request_id in self.active:
            await self._fail(raw.reply, req.request_id, "duplicate request id", 409)
            return
        if self._queued() >= self._max_queued:
            self.counters.bump("rejected_overloaded")
            await self._fail(raw.reply, req.request_id, "worker overloaded: too many requests queued", 429)
            return
        try:
            params = sampling_params(req.sampling)
            seq = self.engine.new_sequence(req.token_ids, params, request_id=req.request_id)
            if not 0 <= req.output_offset < len(req.token_ids):
                raise ValueError(f"output_offset {req.output_offset} does not fit the prompt")
        except (RequestError, ValueError) as e:
            await self._fail(raw.reply, req.request_id, str(e), 400)
            return
        seq.output_offset = req.output_offset
        seq.priority = req.priority
        self.counters.requests += 1
        act = Active(req, raw.reply, seq, time.monotonic())
        act.span = TRACER.start_span(
            "decode.request", context=context_from(raw.headers), kind=trace.SpanKind.SERVER,
            attributes={"pdmesh.request_id": req.request_id, "pdmesh.model": req.model,
                        "pdmesh.worker": self.worker_id, "pdmesh.prompt_tokens": len(req.token_ids)},
        )
        self.active[req.request_id] = act
        want_remote = seq.num_prompt_tokens >= self.settings.disagg_threshold and self._prefill_free()
        threshold = self.settings.disagg_threshold

        def admit(engine: EngineCore):
            if want_remote and engine.num_uncached_tokens(seq) >= threshold and engine.reserve_remote(seq):
                return list(seq.block_table), seq.num_cached_tokens
            engine.add(seq)
            return None

        reservation = await self.loop.call(admit)
        if reservation is None:
            self.counters.bump("local_prefill")
            self.counters.bump("local_prefill_tokens", len(req.token_ids))
            if len(req.token_ids) >= threshold:  # meant for the prefill pool, which had no room
                self.counters.bump("overflow_prefill_tokens", len(req.token_ids))
            metrics.PREFILL_DECISIONS.labels(req.model, "local").inc()
            act.enter("prefill.local")
        else:
            metrics.PREFILL_DECISIONS.labels(req.model, "remote").inc()
            await self._send_job(act, *reservation)

    async def _send_job(self, act: Active, block_table: list[int], num_cached: int) -> None:
        rid = act.request.request_id
        dest = block_table[num_cached // self.engine.block_size :]
        timeout = self.settings.prefill_timeout
        job = PrefillJob(
            request_id=rid, model=self.engine.model_name, token_ids=act.request.token_ids,
            decode_worker=self.worker_id, num_cached_tokens=num_cached, dest_block_ids=dest,
            transports={n: rx.params(rid, dest) for n, rx in self.receivers.items()},
            deadline=time.time() + timeout, block_size=self.engine.block_size,
            sampling=act.request.sampling, created=time.time(), output_offset=act.request.output_offset,
            priority=act.request.priority,
        )
        loop = asyncio.get_running_loop()
        act.remote = loop.call_later(timeout + DEADLINE_GRACE, self._on_prefill_timeout, rid)
        span = act.enter("prefill.remote", **{"pdmesh.cached_tokens": num_cached, "pdmesh.blocks": len(dest)})
        try:
            await self.jobs.publish(job, span=span)
            self.counters.bump("remote_prefill_sent")
        except Exception as e:
            # Nobody took the job, so nobody can write the blocks: prefill locally now.
            log.warning("could not queue prefill job %s: %s", rid, e)
            await self._fallback(act)

    def _on_prefill_timeout(self, rid: str) -> None:
        act = self.active.get(rid)
        if act is not None and act.remote is not None:
            log.warning("no prefill result for %s in time: prefilling locally", rid)
            self.counters.bump("remote_prefill_timeout")
            task = asyncio.create_task(self._fallback(act))
            self._tasks.append(task)
            task.add_done_callback(self._tasks.remove)

    async def _fallback(self, act: Active) -> None:
        rid = act.request.request_id
        self._end_remote(act)
        if act.cancelled:
            await self._abort(rid)
            return
        self.counters.bump("local_prefill_fallback")
        self.counters.bump("overflow_prefill_tokens", len(act.request.token_ids))
        metrics.PREFILL_DECISIONS.labels(self.engine.model_name, "fallback").inc()
        act.enter("prefill.local", **{"pdmesh.fallback": True})
        await self.loop.call(lambda e: e.fail_remote(rid))

    def _end_remote(self, act: Active) -> None:
        if act.remote is not None:
            act.remote.cancel()
            act.remote = None
        for rx in self.receivers.values():
            rx.forget(act.request.request_id)

    async def _on_kv_ready(self, done: PrefillDone, raw) -> None:
        act = self.active.get(done.request_id)
        if act is None or act.remote is None:
            return  # late: already fell back or cancelled
        ok = done.ok and done.transport in self.receivers
        if ok:
            ok = await self.receivers[done.transport].finish(done.request_id)
        if not ok:
            log.warning("prefill of %s failed (%s): prefilling locally", done.request_id, done.error)
            self.counters.bump("remote_prefill_failed")
            await self._fallback(act)
            return
        self._end_remote(act)
        if act.cancelled:
            await self._abort(done.request_id)
            return
        self.counters.bump("remote_prefill_done")
        self.counters.bump(f"transport_{done.transport}")
        if act.phase is not None:
            act.phase.set_attributes({"pdmesh.transport": done.transport, "pdmesh.transfer_bytes": done.transfer_bytes,
                                      "pdmesh.prefill_worker": done.prefill_worker})
        first = SampledToken(done.token_id, engine_logprob(done.logprob))

        def complete(engine: EngineCore) -> None:
            # Emitted from the engine thread, so the first token is queued before any later step's.
            out = engine.complete_remote(done.request_id, first)
            if out is not None:
                self.loop.emit([out])

        await self.loop.call(complete)

    async def _on_cancel(self, msg: Cancel, raw) -> None:
        act = self.active.get(msg.request_id)
        if act is None:
            return
        act.cancelled = True
        self.counters.cancelled += 1
        if act.remote is None:  # else: freed once the prefill worker is done with the blocks
            await self._abort(msg.request_id)

    async def _abort(self, rid: str) -> None:
        act = self.active.pop(rid, None)
        if act is not None:
            act.end_spans("cancelled")
            metrics.WORKER_REQUESTS.labels(act.request.model, self.role, "cancelled").inc()
        await self.loop.call(lambda e: e.abort(rid))

    # -- streaming ----------------------------------------------------------------
    async def handle_outputs(self, outs: list[StepOutput]) -> None:
        for out in outs:
            await self._emit(out)

    async def _emit(self, out: StepOutput) -> None:
        act = self.active.get(out.request_id)
        if act is None or act.cancelled:
            return
        now = time.monotonic()
        model = act.request.model
        interactive = act.request.priority >= 0  # the SLA windows (and so the planner) count only these
        if act.next_index == 0:
            act.first_token_at = now
            if interactive:
                self.ttft.add(now - act.arrived)
            metrics.WORKER_TTFT.labels(model).observe(now - act.arrived)
            act.enter("decode")
        elif act.last_token_at:
            gap = (now - act.last_token_at) / max(1, len(out.new_token_ids))
            if interactive:
                self.itl.add(gap)
            itl = metrics.WORKER_ITL.labels(model)
            for _ in out.new_token_ids:
                itl.observe(gap)
        act.last_token_at = now
        self.counters.bump("decode_tokens", len(out.new_token_ids))
        chunk = TokenChunk(
            request_id=out.request_id, index=act.next_index, token_ids=out.new_token_ids,
            logprobs=[wire_logprob(lp) for lp in out.new_logprobs], finish_reason=out.finish_reason,
            worker=self.worker_id,
        )
        if act.next_index == 0 or out.finish_reason is not None:
            chunk.usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        if out.finish_reason == "error":
            chunk.error, chunk.error_status = "the engine failed on this request", 500
        act.next_index += 1
        metrics.OUTPUT_TOKENS.labels(model).inc(len(out.new_token_ids))
        if out.finish_reason is not None:
            self.active.pop(out.request_id, None)
            self.counters.finished += 1
            outcome = "error" if out.finish_reason == "error" else "finished"
            metrics.WORKER_REQUESTS.labels(model, self.role, outcome).inc()
            metrics.WORKER_E2E.labels(model).observe(now - act.arrived)
            metrics.PROMPT_TOKENS.labels(model).inc(out.num_prompt_tokens)
            metrics.CACHED_TOKENS.labels(model).inc(out.num_cached_tokens)
            act.end_spans(outcome, **{"pdmesh.output_tokens": out.num_output_tokens,
                                      "pdmesh.cached_tokens": out.num_cached_tokens,
                                      "pdmesh.finish_reason": out.finish_reason})
        await self.bus.publish(act.reply, chunk, traced=False)

    async def _fail(self, reply: str, rid: str, message: str, status: int) -> None:
        self.counters.errors += 1
        await self.bus.publish(
            reply, TokenChunk(rid, 0, finish_reason="error", error=message, error_status=status,
                              worker=self.worker_id)
        )

    # -- the prefill pool -----------------------------------------------------------
    async def _on_load(self, report: LoadReport, raw) -> None:
        if report.role == "prefill":
            self.prefill_loads[report.worker_id] = report

    def _prefill_free(self) -> bool:
        """Is there a live prefill worker with room? (the decision is per request, the data per second)"""
        cards = [c for c in self.membership.cards(self.engine.model_name, "prefill") if c.status == "ready"]
        if not cards:
            return False
        capacity = sum(c.capacity for c in cards)
        busy = sum(r.active_jobs for w, r in self.prefill_loads.items() if any(c.worker_id == w for c in cards))
        mine = sum(1 for a in self.active.values() if a.remote is not None)
        return mine < capacity and busy < capacity


async def _unsubscribe(sub) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
