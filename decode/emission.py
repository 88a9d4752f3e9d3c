"""A decode worker's token path: each engine step's outputs to the wire, and their figures.

Each step's outputs leave as one ``TokenBatch`` per gateway (its ``batch_to`` subject), or one
``TokenChunk`` per request for clients that ask for none (``WorkerSettings.stream_interval_ms``
paces the calls, in ``WorkerBase._deliver_outputs``). A request's chunks move its state
(FIRST_TOKEN, FINISH, ERROR); a finished one leaves ``active`` here. The step's figures go to
the SLA windows at once and to Prometheus in one update per ``METRICS_FLUSH_S``.

This runs per step for every token: nothing here may add work per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from decode.context import WorkerContext
from decode.lifecycle import Event, ReqState
from decode.request import UNDECIDED, DecodeRequest
from engine.scheduler import StepOutput
from mesh import metrics
from mesh.protocol import TokenBatch, TokenChunk, Usage, encode
from mesh.tokenlink import TokenLinks
from worker.base import Window, wire_logprob

METRICS_FLUSH_S = 0.1
_EMITTING = (ReqState.PREFILLING, ReqState.DECODING)  # the states whose step outputs go out


@dataclass(slots=True)
class _StepStats:
    """What one step's outputs add to the metrics, gathered while its chunks are built."""

    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    gaps: dict[float, int] = field(default_factory=dict)  # inter-token gap -> tokens (most share one)
    interactive_gap: float = 0.0  # sum of gap x tokens over interactive requests
    interactive_tokens: int = 0
    finished: list = field(default_factory=list)  # (output, e2e seconds) of requests that ended


class Emission:
    """Step outputs to chunks and batches; the TTFT and ITL windows (read by load reports) and the
    step metrics. Frees nothing in the engine: a request that ends here has ended there too."""

    def __init__(self, ctx: WorkerContext, active: dict[str, DecodeRequest],
                 admitted_locally: Callable[[DecodeRequest], None]):
        self.active = active
        self.worker_id = ctx.worker_id
        self.engine_loop = ctx.loop
        self.bus = ctx.bus
        self.counters = ctx.counters
        # the engine stepped a request before the event loop saw its admission's result
        self.admitted_locally = admitted_locally
        self.ttft = Window()
        self.itl = Window()
        self.step_metrics = metrics.StepMetrics.of(ctx.model, ctx.role)
        self.links = TokenLinks(ctx.worker_id, ctx.links)  # to gateways that run a token link (mesh.tokenlink)
        self._unflushed: list[_StepStats] = []  # steps whose figures Prometheus has not had yet
        self._flushed_at = 0.0

    async def handle_outputs(self, outs: list[StepOutput]) -> None:
        """A step's outputs: one ``TokenBatch`` per ``batch_to`` subject, a ``TokenChunk`` per
        request for the rest; the step's metrics in one update."""
        now = time.monotonic()
        batches: dict[str, list[TokenChunk]] = {}
        singles: list[tuple[str, TokenChunk]] = []
        step = _StepStats()
        active = self.active
        links = self.links
        for out in _per_request(outs):
            rec = active.get(out.request_id)
            if rec is None:
                continue  # cancelled, or the tail of a request that already ended
            if rec.state not in _EMITTING:
                if rec.state is not ReqState.ADMITTING:
                    continue  # cancelled (CANCELLED requests are gone from ``active``; CANCELLING wait)
                # The engine stepped it before the event loop saw the admission's result (both
                # come from the engine thread; the step's outputs can be handled first).
                self.admitted_locally(rec)
            chunk = self._chunk(rec, out, now, step)
            req = rec.request
            to = req.batch_to
            if to:
                chunk.stream = req.stream
                link = rec.link
                if link is UNDECIDED:  # its first chunk: the path its chunks keep
                    link = rec.link = links.sender(req.batch_link, req.batch_link_key, to) if req.batch_link else None
                dest = to if link is None else link
                batch = batches.get(dest)
                if batch is None:
                    batches[dest] = [chunk]
                else:
                    batch.append(chunk)
            else:
                singles.append((rec.reply, chunk))
        self._record(step, now)
        publish = self.bus.publish
        for dest, chunks in batches.items():
            batch = TokenBatch(self.worker_id, chunks)
            if type(dest) is str:
                await publish(dest, batch, traced=False)
            elif not dest.send(encode(batch)):  # the link dropped: the bus, as its gateway's fallback
                await publish(dest.subject, batch, traced=False)
        for reply, chunk in singles:
            await publish(reply, chunk, traced=False)

    async def send_last(self, rec: DecodeRequest, chunk: TokenChunk) -> None:
        """A request's last chunk sent outside a step (an abort): the way its others went, so that
        it cannot overtake them (a link and the bus keep no order between them)."""
        link = rec.link
        if link is not UNDECIDED and link is not None and rec.request.batch_to:
            chunk.stream = rec.request.stream
            if link.send(encode(TokenBatch(self.worker_id, [chunk]))):
                return
        await self.bus.publish(rec.reply, chunk, traced=False)

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
            if out.finish_reason == "error" and self.engine_loop.failure is not None:
                # the engine can never step again (a rank is lost): the worker leaves, and the
                # gateway resumes the request elsewhere with the tokens it has
                chunk.error, chunk.error_status = "the worker's engine failed for good", 503
            elif out.finish_reason == "error":
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
