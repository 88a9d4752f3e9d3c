"""The prefill worker: pulls jobs while it has room, computes their KV, writes it
into the decode worker's blocks, reports the first token.

    fetch(n free) --> PrefillJob --> engine (max_tokens=1, blocks held)
                  --> first token --> transport.send(blocks) --> PrefillDone --> release blocks

Who frees the blocks: the engine holds a finished job's blocks (``hold_blocks``)
until ``release`` after the send, whatever its outcome. They then stay in the
prefix cache, so the next job sharing the prompt's prefix computes less.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

import nats.errors
from opentelemetry import trace

from engine.scheduler import StepOutput
from engine.sequence import Sequence
from kvstore.manager import blocks_for
from kvstore.transfer import KvSender, Refused, TransferTarget, make_sender
from mesh import metrics
from mesh.adapters import adapter_names
from mesh.config import settings
from mesh.errors import RequestError
from mesh.natsauth import retry_unavailable
from mesh.prefill_queue import PrefillQueue
from mesh.protocol import DecodeError, PrefillDone, PrefillJob, decode, encode
from mesh.telemetry import tracer
from mesh.tracing import child_context, context_from
from worker.base import Window, WorkerBase, prepare_grammar, sampling_params, wire_logprob

log = logging.getLogger(__name__)

# Do not start writing a decode worker's blocks this close to the job's deadline.
DEADLINE_MARGIN = 0.5
# Nor when our card is this old, as a share of the registry's TTL: at the TTL the decode worker
# counts us gone and lets go of the blocks our grants held (nixl's ``writer_left``). Cards are
# refreshed every third of the TTL; a write started before this share has a third of it to end.
CARD_FRESH = 2 / 3
# A job no worker of the pool can serve is failed (the decode worker prefills locally) after this many tries.
MAX_DELIVERIES = 20
TRACER = tracer("pdmesh.prefill")


@dataclass
class Job:
    job: PrefillJob
    seq: Sequence
    started: float
    span: trace.Span | None = None  # prefill.job: taken to reported


def _deliveries(m) -> int:
    try:
        return m.metadata.num_delivered
    except Exception:
        return MAX_DELIVERIES


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, settings):
        super().__init__(settings)
        self.capacity = settings.prefill_capacity
        self.jobs: dict[str, Job] = {}
        self.senders: dict[str, KvSender] = {}
        self._room = asyncio.Event()
        self.compute = Window()

    async def setup(self, stack: AsyncExitStack) -> None:
        names = self.settings.transport_names()
        speedup = getattr(self.settings.engine, "speedup", 1.0)
        copy_delay_s = settings().fault_kv_copy_delay_s
        for name in names:
            self.senders[name] = make_sender(name, bus=self.bus, speedup=speedup, copy_delay_s=copy_delay_s,
                                             worker_id=self.worker_id)
        self.queue = PrefillQueue(self.bus, self.engine.model_name)
        # a host's roles can start before its JetStream has a leader again: wait, don't die
        self._sub = await retry_unavailable(self.queue.pull, "the prefill queue")
        stack.push_async_callback(self._unsubscribe)
        self._tasks.append(asyncio.create_task(self._pull(), name="prefill-pull"))

    async def _unsubscribe(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    def card(self):
        card = super().card()
        card.capacity = self.capacity
        card.transports = {n: {} for n in self.senders}
        return card

    def load(self, engine):
        report = super().load(engine)
        report.capacity = self.capacity
        report.active_jobs = len(self.jobs)
        report.ttft_ms = self.compute.mean() * 1000
        report.ttft_p90_ms = self.compute.quantile(0.9) * 1000
        return report

    def in_flight(self) -> int:
        return len(self.jobs)

    # -- pulling --------------------------------------------------------------------
    async def _pull(self) -> None:
        while True:
            free = self.capacity - len(self.jobs)
            if self.status != "ready":
                return  # draining: take nothing more
            if free <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                msgs = await self._sub.fetch(batch=free, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as e:
                # e.g. the server restarted and lost the stream: subscribe anew
                log.warning("fetching prefill jobs failed: %s", e)
                await asyncio.sleep(0.5)
                with contextlib.suppress(Exception):
                    old, self._sub = self._sub, await self.queue.pull()
                    with contextlib.suppress(Exception):
                        await old.unsubscribe()
                continue
            for m in msgs:
                await self._take(m)

    async def _take(self, m) -> None:
        try:
            job = decode(m.data, PrefillJob)
        except DecodeError as e:
            metrics.BUS_DROPPED.labels("PrefillJob", e.reason).inc()
            log.warning("dropped a malformed prefill job: %s", e)
            with contextlib.suppress(Exception):
                await m.term()
            return
        refused = self._refused(job)
        if refused is not None:
            with contextlib.suppress(Exception):
                await m.ack()  # consumed: no other worker gets it either
            await self._refuse(job, refused)
            return
        misfit = self._misfit(job)
        deliveries = _deliveries(m)
        if misfit is not None and deliveries < MAX_DELIVERIES:
            # Another worker of the pool may be able to serve it (e.g. it shares the decode worker's
            # host). Back off longer each time, so that a worker that fetches often cannot spend the
            # job's deliveries before one that fits fetches it (20 deliveries: about 4 s in all).
            with contextlib.suppress(Exception):
                await m.nak(delay=0.02 * deliveries)
            return
        # Ack at once: a job is never redelivered into blocks a decode worker may have reused.
        with contextlib.suppress(Exception):
            await m.ack()
        span = TRACER.start_span(
            "prefill.job", context=context_from(m.headers), kind=trace.SpanKind.CONSUMER,
            attributes={"pdmesh.request_id": job.request_id, "pdworker.base": self.worker_id,
                        "pdmesh.prompt_tokens": len(job.token_ids), "pdmesh.cached_tokens": job.num_cached_tokens},
        )
        if job.created:
            waited = max(0.0, time.time() - job.created)
            metrics.WORKER_QUEUE.labels(job.model).observe(waited)
            queue = TRACER.start_span("prefill.queue", context=child_context(span),
                                      start_time=int(job.created * 1e9))
            queue.end()
        await self._start(job, misfit, span)

    async def _start(self, job: PrefillJob, error: str | None, span: trace.Span | None = None) -> None:
        if job.request_id in self.jobs:
            return
        if error is None:
            error = self._check(job)
        seq = None
        if error is None:
            try:
                params = sampling_params(job.sampling, max_tokens=1)
                seq = self.engine.new_sequence(job.token_ids, params, request_id=job.request_id,
                                               lora=job.adapter or None, cache_scope=job.cache_scope)
                if not 0 <= job.output_offset < len(job.token_ids):
                    raise ValueError("output_offset does not fit the prompt")
                seq.output_offset = job.output_offset
                seq.priority = job.priority
            except (RequestError, ValueError) as e:
                error = str(e)
        if error is None:  # the first token is sampled under the constraint: compile it first, in a thread
            error = await prepare_grammar(self.engine, seq)
        if error is not None:
            await self._done(job, ok=False, error=error, span=span)
            return
        seq.hold_blocks = True
        self.jobs[job.request_id] = Job(job, seq, time.monotonic(), span)
        self._prepare(job)
        self.counters.requests += 1
        await self.loop.call(lambda e: e.add(seq))

    def _prepare(self, job: PrefillJob) -> None:
        """Start what the transfer will wait for (nixl: the write grant) while the prefill computes."""
        name, params = next(((n, p) for n, p in job.transports.items() if self._usable(n, p)), ("", {}))
        prepare = getattr(self.senders.get(name), "prepare", None)
        if prepare is not None:
            target = TransferTarget(job.request_id, job.decode_worker, job.dest_block_ids, job.block_size)
            try:
                prepare(target, params, self.engine.kv_cache)
            except Exception as e:  # send meets it again, and reports it
                log.info("prefill %s: nothing prepared for %s: %s", job.request_id, name, e)

    def _refused(self, job: PrefillJob) -> str | None:
        """Why nobody may serve this job: its transport params name something that is not the
        decode worker's own (a file outside the mesh's KV directory, ...)."""
        for name, params in job.transports.items():
            if name in self.senders:
                try:
                    self.senders[name].usable(params)
                except Refused as e:
                    return f"{name}: {e}"
                except Exception:
                    pass  # not usable here; _misfit says so
        return None

    async def _refuse(self, job: PrefillJob, reason: str) -> None:
        """Logged, counted, dropped; the decode worker hears ``ok=False`` and prefills locally."""
        log.warning("refused prefill job %s for %s: %s", job.request_id, job.decode_worker, reason)
        metrics.REFUSED_MESSAGES.labels(self.role, "unsafe_transport_params").inc()
        self.counters.bump("refused_jobs")
        await self._done(job, ok=False, error=f"refused: {reason}")

    def _usable(self, name: str, params: dict) -> bool:
        try:
            return name in self.senders and self.senders[name].usable(params)
        except Exception:
            return False

    def _misfit(self, job: PrefillJob) -> str | None:
        """Why this worker cannot serve the job while another of the pool might."""
        if job.model != self.engine.model_name:
            return f"model {job.model!r} is not served here"
        if job.adapter and job.adapter not in adapter_names(self.engine):
            return f"LoRA adapter {job.adapter!r} is not loaded here"
        if job.block_size != self.engine.block_size:
            return f"block size {job.block_size} differs from ours ({self.engine.block_size})"
        if not any(self._usable(n, p) for n, p in job.transports.items()):
            return f"no usable transport among {sorted(job.transports)}"
        return None

    def _check(self, job: PrefillJob) -> str | None:
        bs = self.engine.block_size
        if time.time() > job.deadline:
            return "expired before it started"
        if job.num_cached_tokens % bs or job.num_cached_tokens >= len(job.token_ids):
            return "bad cached prefix length"
        if len(job.dest_block_ids) != blocks_for(len(job.token_ids), bs) - job.num_cached_tokens // bs:
            return "destination blocks do not match the prompt"
        return None

    # -- finishing ------------------------------------------------------------------
    async def handle_outputs(self, outs: list[StepOutput]) -> None:
        for out in outs:
            if out.finish_reason is not None and out.request_id in self.jobs:
                task = asyncio.create_task(self._send(self.jobs[out.request_id], out))
                self._tasks.append(task)
                task.add_done_callback(self._tasks.remove)

    async def _send(self, j: Job, out: StepOutput) -> None:
        job = j.job
        compute_ms = (time.monotonic() - j.started) * 1000
        self.compute.add(compute_ms / 1000)
        metrics.PREFILL_COMPUTE.labels(job.model).observe(compute_ms / 1000)
        compute = TRACER.start_span("prefill.compute", context=child_context(j.span),
                                    start_time=time.time_ns() - int(compute_ms * 1e6))
        compute.end()
        transfer = TRACER.start_span("kv.transfer", context=child_context(j.span))
        if settings().fault_prefill_delay_s:
            await asyncio.sleep(settings().fault_prefill_delay_s)
        try:
            name, params = next((n, p) for n, p in job.transports.items() if self._usable(n, p))
            remaining = job.deadline - time.time() - DEADLINE_MARGIN
            if remaining <= 0:
                raise TimeoutError("past the deadline before the transfer")
            self._check_registered()
            first = job.num_cached_tokens // job.block_size
            src = j.seq.block_table[first : first + len(job.dest_block_ids)]
            target = TransferTarget(job.request_id, job.decode_worker, job.dest_block_ids, job.block_size)
            sender = self.senders[name]
            carried = {}
            if getattr(sender, "carries_done", False):  # the PrefillDone rides with the bytes
                nbytes = len(src) * self.engine.kv_cache.spec.block_bytes
                carried["done"] = encode(self._message(job, True, **self._success_fields(out, name, compute_ms, nbytes)))
            result = await asyncio.wait_for(sender.send(target, params, self.engine.kv_cache, src, **carried),
                                            remaining)
        except Exception as e:
            if isinstance(e, Refused):
                metrics.REFUSED_MESSAGES.labels(self.role, "unsafe_transport_params").inc()
                self.counters.bump("refused_jobs")
            log.warning("prefill %s: transfer failed: %s", job.request_id, e)
            transfer.set_attribute("pdmesh.error", str(e))
            transfer.end()
            await self._done(job, ok=False, error=f"transfer failed: {e}", compute_ms=compute_ms, span=j.span)
        else:
            transfer.set_attributes({"pdmesh.transport": name, "pdmesh.bytes": result.bytes})
            transfer.end()
            metrics.TRANSFER_BYTES.labels(job.model, name).inc(result.bytes)
            metrics.TRANSFER_SECONDS.labels(job.model, name).observe(result.seconds)
            self.counters.bump(f"transport_{name}")
            self.counters.bump("prefill_tokens", len(job.token_ids) - job.num_cached_tokens)
            if job.priority < 0:  # batch work: the planner does not grow the pools for it
                self.counters.bump("deferrable_prefill_tokens", len(job.token_ids) - job.num_cached_tokens)
            await self._done(job, ok=True, span=j.span, **self._success_fields(
                out, name, compute_ms, result.bytes, transfer_ms=result.seconds * 1000, num_chunks=result.chunks))
        finally:
            self.jobs.pop(job.request_id, None)
            self._room.set()
            await self.loop.call(lambda e: e.release(job.request_id))

    @staticmethod
    def _success_fields(out: StepOutput, transport: str, compute_ms: float, nbytes: int, **more) -> dict:
        """A successful PrefillDone's fields: the first token, how its KV went."""
        return dict(token_id=out.new_token_ids[0],
                    logprob=wire_logprob(out.new_logprobs[0]) if out.new_logprobs else None,
                    transport=transport, transfer_bytes=nbytes, compute_ms=compute_ms, **more)

    def _message(self, job: PrefillJob, ok: bool, **fields) -> PrefillDone:
        """The job's PrefillDone (a transport may carry a successful one with the bytes, built
        before the transfer's time is known)."""
        return PrefillDone(request_id=job.request_id, prefill_worker=self.worker_id, ok=ok, token=job.token, **fields)

    def _check_registered(self) -> None:
        """Write only while the registry surely counts us in (else ``TimeoutError``)."""
        ttl = self.settings.registry_ttl
        if self.cards is not None and self.cards.age() > ttl * CARD_FRESH:
            raise TimeoutError(f"our registry card is {self.cards.age():.1f}s old (TTL {ttl:g}s): the decode "
                               "worker may count us gone and reuse the blocks")

    async def _done(self, job: PrefillJob, ok: bool, span: trace.Span | None = None, **fields) -> None:
        if ok:
            self.counters.finished += 1
        else:
            self.counters.errors += 1
        metrics.WORKER_REQUESTS.labels(job.model, self.role, "finished" if ok else "error").inc()
        msg = self._message(job, ok, **fields)
        try:
            await self.bus.publish(self.bus.subjects.kv_ready(job.model, job.decode_worker), msg, span=span)
        except Exception as e:  # the decode worker falls back on its own timeout
            log.warning("could not report prefill %s: %s", job.request_id, e)
        if span is not None:
            span.set_attributes({"pdmesh.ok": ok, **({"pdmesh.error": fields["error"]} if "error" in fields else {})})
            span.end()
