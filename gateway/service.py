"""The gateway's work, HTTP aside: models, tokenizers, routing, one choice's token stream.

``Gateway`` owns the bus connection and the registry view. ``stream_choice`` turns a prompt into
a stream of ``ChoiceDelta``s: it picks a worker, streams its ``TokenChunk``s, detokenizes
incrementally, applies stop strings, and cancels the request on the worker when the client goes
away or a stop string ends it early.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
from opentelemetry import trace

from gateway.choices.choice import UNREACHABLE_BACKOFF, ChoiceRun, ChoiceState, RetryPolicy
from gateway.choices.direct import DeltaWriter, DirectSink
from gateway.choices.replies import ReplyStream, ReplyStreams
from gateway.errors import APIError
from gateway.limits import BatchConfig
from gateway.metrics import TOKEN_LINKS, ChoiceFigures, GatewayStats, workers_registry
from gateway.outputs.detok import IncrementalDetokenizer, StopMatcher, TokenTexts
from gateway.outputs.plan import OutputPlan
from mesh import client, metrics
from mesh.bus import Bus
from mesh.client import StreamError
from mesh.protocol import (
    GenerateRequest,
    PeerFetchPlan,
    PlannerDecision,
    SamplingOptions,
    TokenChunk,
    TokenLogprobs,
    Usage,
    WorkerCard,
)
from mesh.registry import Membership
from mesh.router.policy import Decision, RouterConfig
from mesh.router.router import KvRouter
from mesh.telemetry import setup_tracing, tracer
from mesh.tokenizer import Tokenizer
from mesh.tokenlink import LinkServer, listen_address, local_address_toward
from mesh.tracing import child_context

log = logging.getLogger(__name__)
TRACER = tracer("pdmesh.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str
    ns: str = "mesh"
    host: str = "0.0.0.0"
    port: int = 8000
    model_dirs: tuple[str, ...] = ()  # tokenizers and chat templates come from here
    served_names: tuple[str, ...] = ()  # names for model_dirs (default: directory names)
    max_inflight: int = 1024  # admitted requests at once; beyond it: 429
    default_max_tokens: int = 1024
    first_token_timeout: float = 120.0
    idle_timeout: float = 60.0
    retries: int = 2  # re-pick a worker when one is draining or vanished before answering
    max_migrations: int = 2  # a worker that dies mid-stream: resume elsewhere this many times
    unreachable_wait: float = 5.0  # every worker tried is unreachable: keep trying this long before a 503
    router: RouterConfig = field(default_factory=RouterConfig)
    nats: object = None  # mesh.natsauth.NatsConfig: servers, credentials, TLS (None: nats_url + environment)
    tool_call_parser: str | None = None  # a tool-call format for every model (default: each template's)
    reasoning_parser: str | None = None  # a reasoning format, or "none" (default: each template's)
    insecure_admin: bool = False  # without API keys the admin routes serve everyone (default: closed)
    responses_ttl: float = 30 * 24 * 3600.0  # seconds a stored response lives (the bucket's max age)
    batch: BatchConfig = field(default_factory=BatchConfig)  # /v1/files and /v1/batches: limits, pacing
    # mesh.tokenlink: "auto" (listen on this host's address toward the NATS server), "off", HOST or
    # HOST:PORT. Off where the bus runs over TLS: the link is plain TCP.
    token_link: str = "auto"


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` names: a served model, or a LoRA adapter on one."""

    model: str  # the served (base) model: tokenizer, limits, workers
    adapter: str = ""  # the LoRA adapter; "": the base model


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    # chat with a reasoning or tool-call parser (gateway.outputs.plan.ChoiceOutput): what of the
    # text was thinking, and the tool-call deltas (``text`` is then the rest, the content)
    reasoning: str = ""
    tool_calls: list | None = None


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.tokenizers: dict[str, Tokenizer] = {}
        self.token_texts: dict[str, TokenTexts] = {}
        for i, d in enumerate(config.model_dirs):
            name = config.served_names[i] if i < len(config.served_names) else Path(d).name
            self.tokenizers[name] = Tokenizer(d)
            self.token_texts[name] = TokenTexts(self.tokenizers[name], d)
        self.bus: Bus | None = None
        self.replies: ReplyStreams | None = None
        self.link: LinkServer | None = None
        self.membership: Membership | None = None
        self.router: KvRouter | None = None
        self.inflight = 0
        self.tracing = False  # start(): whether spans are recorded (else the tracer is a no-op)
        self.stats = GatewayStats()
        self.workers_metrics = workers_registry(self.ready_workers)
        self.retry_policy = RetryPolicy(config.retries, config.max_migrations, config.unreachable_wait,
                                        config.first_token_timeout, config.idle_timeout)
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.tracing = setup_tracing("pdmesh-gateway")
        # no_echo: our own routing decisions would come back to our router, to be decoded and dropped
        self.bus = await Bus.connect(self.config.nats_url, name="gateway", ns=self.config.ns,
                                     config=self.config.nats, no_echo=True)
        self.replies = ReplyStreams(self.bus, self.config.max_inflight)
        await self.replies.start()
        self.link = await self._start_link()
        self.membership = Membership(self.bus)
        self.membership.on_change(self._on_member)
        await self.membership.start(wait=2.0)
        self.router = KvRouter(self.bus, self.membership, self.config.router)
        await self.router.start()
        await self.bus.subscribe(self.bus.subjects.planner_decisions(), self._on_planner, PlannerDecision)

    async def _start_link(self) -> LinkServer | None:
        """The token link (``mesh.tokenlink``) as configured; None: the bus carries every batch."""
        want = self.config.token_link
        nats = self.config.nats
        tls = getattr(nats, "wants_tls", False) or urlsplit(self.config.nats_url).scheme in ("tls", "wss")
        if want == "off" or (want == "auto" and tls):
            return None
        if want == "auto":
            url = self.bus.nc.connected_url
            host, port = await asyncio.to_thread(local_address_toward, url.hostname, url.port or 4222), 0
        else:
            host, port = listen_address(want)
        link = LinkServer(self.replies.on_link_batch, host, port, on_bound=TOKEN_LINKS.inc)
        try:
            await link.start()
        except OSError as e:
            log.warning("no token link (%s:%s: %s): the bus carries every batch", host, port, e)
            return None
        return link

    def _on_member(self, worker_id: str, card: WorkerCard | None) -> None:
        if card is None and self.replies is not None and self.replies.worker_gone(worker_id):
            log.warning("worker %s left with requests in flight: resuming them elsewhere", worker_id)

    async def _on_planner(self, d: PlannerDecision, raw) -> None:
        metrics.PLANNER_REPLICAS.labels(d.model, d.pool, "current").set(d.current)
        metrics.PLANNER_REPLICAS.labels(d.model, d.pool, "target").set(d.target)

    async def stop(self) -> None:
        if self._background:  # cancels of abandoned requests: let them reach the bus
            await asyncio.wait(list(self._background), timeout=1.0)
        if self.router:
            await self.router.stop()
        if self.membership:
            await self.membership.stop()
        if self.link:
            await self.link.stop()
        if self.replies:
            await self.replies.stop()
        if self.bus:
            await self.bus.close()

    # -- models and workers -----------------------------------------------------------
    # kept until the registry changes (Membership.derived): at 1,000 workers each was a pass over every card
    def decode_workers(self, model: str) -> list[WorkerCard]:
        m = self.membership
        return m.derived(("decode", model), lambda: [c for c in m.cards_of(model, "decode") if c.status == "ready"])

    def live_models(self) -> list[str]:
        m = self.membership
        return m.derived(("live",), lambda: sorted({c.model for c in m.cards_of(role="decode")}))

    def embed_models(self) -> list[str]:
        """Models with ready embed workers (``--task embed``: /v1/embeddings only)."""
        m = self.membership
        return m.derived(("embed",), lambda: sorted({c.model for c in m.cards_of(role="embed") if c.status == "ready"}))

    def served_models(self) -> list[str]:
        """What /v1/models lists: models with decode or embed workers."""
        return sorted({*self.live_models(), *self.embed_models()})

    def ready_workers(self) -> dict[str, int]:
        """Ready decode workers per live model (none before ``start``): the /metrics gauge."""
        if self.membership is None:
            return {}
        return {m: len(self.decode_workers(m)) for m in self.live_models()}

    def check_model(self, model: str) -> None:
        self.resolve(model)

    def adapters(self) -> dict[str, str]:
        """LoRA adapter -> its base model, over every ready decode worker's card."""
        m = self.membership
        return m.derived(("adapters",), lambda: {
            a: c.model for c in m.cards_of(role="decode") if c.status == "ready" for a in c.adapters})

    def resolve(self, name: str) -> Target:
        """A request's ``model``: a served model, else a LoRA adapter some decode worker holds;
        404 in OpenAI's shape for neither."""
        if name in self.live_models():
            return Target(name)
        base = self.adapters().get(name)
        if base is not None:
            return Target(base, name)
        if name in self.embed_models():
            raise APIError(400, f"the model {name!r} serves embeddings only (POST /v1/embeddings)", "model",
                           "model_not_supported")
        if name in self.tokenizers or self.membership.served_recently(name):
            raise APIError(503, f"no live worker serves model {name!r}")
        raise APIError(404, f"the model {name!r} does not exist", "model", "model_not_found")

    def tokenizer(self, model: str) -> Tokenizer | None:
        return self.tokenizers.get(model)

    def require_tokenizer(self, model: str, param: str) -> Tokenizer:
        tok = self.tokenizers.get(model)
        if tok is None:
            raise APIError(400, f"this gateway has no tokenizer for {model!r}: send token ids "
                                "to /v1/completions", param)
        return tok

    def max_model_len(self, model: str) -> int:
        m = self.membership
        return min(m.derived(("max_len", model), lambda: [c.max_model_len for c in m.cards_of(model, "decode")]
                             or [c.max_model_len for c in m.cards_of(model, "embed")] or [0]))

    def pick_worker(self, model: str, token_ids: list[int], exclude: set[str], request_id: str = "",
                    parent: trace.Span | None = None, adapter: str = "", cache_scope: str = "") -> Decision:
        """The router decides which ready decode worker serves the request (and whether it fetches
        prefix blocks from a peer first); the gateway sends."""
        with TRACER.start_as_current_span("route", context=child_context(parent)) as span:
            began = time.perf_counter()
            try:
                d = self.router.route(model, token_ids, request_id, exclude, adapter=adapter, cache_scope=cache_scope)
            except LookupError:
                span.set_attribute("pdmesh.error", "no live worker")
                raise APIError(503, f"no live worker for {adapter or model!r}") from None
            metrics.ROUTER_DECISION_SECONDS.labels(model).observe(time.perf_counter() - began)
            span.set_attributes({"pdworker.base": d.worker_id, "pdmesh.mode": d.mode,
                                 "pdmesh.overlap_blocks": d.overlap_blocks, "pdmesh.new_blocks": d.new_blocks})
        mode = self.config.router.mode
        metrics.ROUTER_DECISIONS.labels(model, mode).inc()
        blocks = d.overlap_blocks + d.new_blocks
        metrics.ROUTER_OVERLAP.labels(model, mode).observe(d.overlap_blocks / blocks if blocks else 0.0)
        return d

    # -- admission ----------------------------------------------------------------------
    def acquire(self, n: int) -> None:
        """Admit ``n`` choices or raise 429; every acquire is paired with a ``release``."""
        if self.inflight + n > self.config.max_inflight:
            raise APIError(429, "too many requests in flight; retry shortly", headers={"Retry-After": "1"})
        self.inflight += n
        self.stats.inflight(n)

    def release(self, n: int) -> None:
        self.inflight -= n
        self.stats.inflight(-n)

    # -- one choice -----------------------------------------------------------------------
    async def stream_choice(
        self, index: int, request_id: str, model: str, prompt_ids: list[int],
        sampling: SamplingOptions, stops: list[str], priority: int = 0, plan: OutputPlan | None = None,
        adapter: str = "", cache_scope: str = "", direct: DeltaWriter | None = None,
    ) -> AsyncIterator[ChoiceDelta]:
        """One ``ChoiceDelta`` per batch of chunks that has arrived; the last has a finish reason.
        ``ChoiceRun`` (gateway/choices/choice.py) decides what each failure leads to; this does the
        I/O.

        Who cancels on the worker: this generator's ``finally`` (``_ended``), whenever it ends
        before the worker's last chunk (client gone, stop string, error), whether it is closed or
        cancelled; and a migration (``_lost``), on the worker it leaves.
        ``direct``: where a ``DirectSink`` writes the mid-stream deltas
        (gateway/choices/direct.py); they are then not yielded here.
        """
        text = _ChoiceText(index, self.tokenizer(model), stops, len(prompt_ids), sampling.min_tokens, plan)
        run = ChoiceRun(self.retry_policy)
        span = TRACER.start_span("generate", attributes={"pdmesh.request_id": request_id, "pdmesh.choice": index,
                                                         "pdmesh.prompt_tokens": len(prompt_ids)})
        stream, latency = None, self.stats.latency(model)
        figures = self.stats.choice_figures(latency)  # tokens and ITL: into Prometheus once, at the end
        self.stats.choice_started()
        try:
            while True:
                if run.state is ChoiceState.BACKOFF:
                    await self._back_off(run)
                if run.state is ChoiceState.ROUTING:
                    stream = await self._send(run, request_id, model, prompt_ids, sampling, priority, span, adapter,
                                             cache_scope)
                    if direct is not None and not text.stop.stops:  # a stop string may end it: the task looks
                        stream.sink = DirectSink(direct, run, text, figures)
                try:
                    chunks = await stream.next_batch(run.timeout)
                except StreamError as e:
                    self._lost(run, e, stream, model, request_id, span, adapter)  # raises, or closes it
                    stream = None
                    continue
                last = chunks[-1]
                if last.error:
                    stream = self._close(stream, request_id)
                    if run.refused(last.error_status, last.error, self._untried(model, run.tried, adapter)) is ChoiceState.FAILED:
                        raise run.error
                    continue
                if run.state is ChoiceState.WAITING:  # this worker's first chunk: its prefill is done
                    self.router.first_token(run.worker_id, request_id)
                now, delta = self._took(run, text, chunks, figures, latency)
                if run.state is ChoiceState.FINISHED:
                    if last.finish_reason is not None:  # else a stop string ended it: the worker goes on
                        stream = self._close(stream, request_id)
                    latency.e2e.observe(now - run.started)
                    yield delta
                    return
                yield delta
        finally:
            self._ended(run, span, stream, model, request_id, figures)

    @staticmethod
    def _took(run: ChoiceRun, text: _ChoiceText, chunks: list[TokenChunk], figures: ChoiceFigures,
              latency) -> tuple[float, ChoiceDelta]:
        """The delta of chunks the choice's task reads (what ``DirectSink`` does for the ones it takes)."""
        first = not run.generated
        delta = text.delta(chunks)
        run.streamed(delta.token_ids, delta.finish_reason is not None)
        figures.tokens += len(delta.token_ids)
        now = time.monotonic()
        if first:
            latency.ttft.observe(now - run.started)
        elif delta.token_ids:
            figures.gap((now - figures.last_at) / len(delta.token_ids))
        figures.last_at = now
        return now, delta

    async def _back_off(self, run: ChoiceRun) -> None:
        """Every worker tried is unreachable: wait, then try them all again."""
        self.stats.rerouted()
        await asyncio.sleep(UNREACHABLE_BACKOFF)
        run.backed_off()

    def _lost(self, run: ChoiceRun, e: StreamError, stream: ReplyStream, model: str, request_id: str,
              span: trace.Span, adapter: str) -> None:
        """The stream broke: raise the choice's error, or close the stream for a migration or a
        back-off. A failed choice's stream is left open for ``stream_choice``'s ``finally`` to close
        and cancel on the worker."""
        if e.status in (503, 504):  # gone or silent: no new work for it until it reports
            self.router.suspect(run.worker_id)
        if run.lost(e, self._untried(model, run.tried, adapter)) is ChoiceState.FAILED:
            raise run.error from None
        if run.state is ChoiceState.ROUTING:
            self.stats.migrated(with_tokens=bool(run.generated))
            span.add_event("migrated", {"pdmesh.from": run.worker_id, "pdmesh.after_tokens": len(run.generated)})
            log.warning("request %s: %s; resuming elsewhere after %d tokens", request_id, e, len(run.generated))
            self._cancel_later(model, stream, request_id)  # if it is only slow, free it
        self._close(stream, request_id)

    def _ended(self, run: ChoiceRun, span: trace.Span, stream: ReplyStream | None, model: str,
               request_id: str, figures: ChoiceFigures) -> None:
        """The choice's generator is done, however it ended: count it, end its span, and stop the
        worker if it ended before the worker's last chunk (``stream`` still open)."""
        run.closed()
        figures.flush()
        self.stats.choice_ended(run.state.name)
        span.set_attributes({"pdmesh.output_tokens": len(run.generated), "pdmesh.state": run.state.name})
        span.end()
        if stream is not None:
            self._close(stream, request_id)
            self._cancel_later(model, stream, request_id)

    async def _send(self, run: ChoiceRun, request_id: str, model: str, prompt_ids: list[int],
                    sampling: SamplingOptions, priority: int, span: trace.Span, adapter: str = "",
                    cache_scope: str = "") -> ReplyStream:
        """Pick a worker for the choice (after the tokens it already has) and send it the request."""
        generated = run.generated
        try:
            d = self.pick_worker(model, prompt_ids + generated, run.tried, request_id, span, adapter, cache_scope)
        except APIError as e:
            run.no_worker(e)
            raise
        worker_id = d.worker_id
        stream = self.replies.open(worker_id)
        req = GenerateRequest(request_id, model, prompt_ids, sampling, priority, time.time(), batch_to=self.replies.batch_subject,
                              stream=stream.key, adapter=adapter, cache_scope=cache_scope)
        if self.link is not None:
            req.batch_link, req.batch_link_key = self.link.address, self.link.key_for(worker_id)
        if d.fetch_source:  # the worker fetches these prefix blocks from a peer before prefilling
            req.peer_fetch = PeerFetchPlan(d.fetch_source, d.fetch_blocks, d.hit_blocks)
        if generated:  # resumed: the tokens streamed so far join the prompt and count as outputs
            req.token_ids = prompt_ids + generated
            req.sampling = msgspec.structs.replace(sampling, max_tokens=max(1, sampling.max_tokens - len(generated)))
            req.output_offset = len(generated)
        span.set_attribute("pdworker.base", worker_id)
        run.sent(worker_id)
        try:
            await self.bus.publish(self.bus.subjects.generate(model, worker_id), req, reply=stream.subject, span=span)
        except BaseException:  # never sent (or cancelled meanwhile): the router holds its slot until it ends
            self._close(stream, request_id)
            raise
        return stream

    def _close(self, stream: ReplyStream, request_id: str) -> None:
        stream.close()
        self.router.finished(stream.worker_id, request_id)

    def _untried(self, model: str, tried: set[str], adapter: str = "") -> bool:
        return any(c.worker_id not in tried and (not adapter or adapter in c.adapters) for c in self.decode_workers(model))

    def _cancel_later(self, model: str, stream: ReplyStream, request_id: str) -> None:
        # Runs even when the calling task is being cancelled (client disconnect).
        self.stats.cancel()
        task = asyncio.get_running_loop().create_task(
            client.cancel(self.bus, model, stream.worker_id, request_id, stream.subject))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _ChoiceText:
    """One choice's text so far (incremental detokenization, stop strings) and its token counts."""

    def __init__(self, index: int, tok: Tokenizer | None, stops: list[str], prompt_tokens: int, min_tokens: int = 0,
                 plan: OutputPlan | None = None):
        self.index = index
        self.min_tokens = min_tokens  # stop strings are looked for once the output is past it (as vLLM)
        self.detok = IncrementalDetokenizer(tok, keep_special=plan.keep_special if plan else frozenset()) if tok else None
        self.output = plan.choice_output() if plan else None  # reasoning and tool calls out of the text
        self.stop = StopMatcher(stops)
        self.prompt_tokens = prompt_tokens
        self.completion = 0
        self.cached: int | None = None

    @property
    def plain(self) -> bool:
        """Its deltas carry text only: a detokenizer, no reasoning or tool-call parser, no special
        tokens kept among skipped ones (with no stop strings, ``push_plain`` may stand for ``delta``)."""
        return self.detok is not None and self.output is None and not self.detok.drop

    def push_plain(self, ids: list[int]) -> str:
        """``delta``'s text for a mid-stream chunk of only ``ids`` (no logprobs, usage or finish) of
        a ``plain`` choice with no stop strings, counted as ``delta`` counts, with no ``ChoiceDelta``
        made (``gateway.choices.direct.DirectSink``, once per token at GPU pace)."""
        self.completion += len(ids)
        return self.detok.push(ids)

    def delta(self, chunks: list[TokenChunk]) -> ChoiceDelta:
        """The delta of a batch of chunks; finished when the worker finished or a stop string matched."""
        last = chunks[-1]
        if len(chunks) == 1:
            ids, lps = last.token_ids, last.logprobs
        else:
            ids = [t for c in chunks for t in c.token_ids]
            lps = [lp for c in chunks for lp in c.logprobs]
        for c in chunks:
            if c.usage is not None and self.cached is None:
                self.cached = c.usage.cached_tokens  # the first worker's: a resumed request's is not the client's
        reason = last.finish_reason
        if self.detok and self.stop.stops and len(ids) > 1:
            out, ids, lps = self._stop_per_token(ids, lps, reason is not None)
        else:
            self.completion += len(ids)
            text = self.detok.push(ids, final=reason is not None) if self.detok else ""
            out = self.stop.feed(text) if self.completion > self.min_tokens else self.stop.skip(text)
        if self.stop.stopped:
            reason = "stop"
        elif reason is not None:
            out += self.stop.flush()
        usage = Usage(self.prompt_tokens, self.completion, self.cached or 0) if reason is not None else None
        delta = ChoiceDelta(self.index, out, ids, lps, reason, usage)
        if self.output is not None:
            self.output.parse(delta)
        return delta

    def _stop_per_token(self, ids: list[int], lps: list, final: bool) -> tuple[str, list[int], list]:
        """Several tokens at once (a verification step's accepted drafts, steps merged by the stream
        interval) where a stop string may end inside them: looked for token by token, so the output
        ends with the token that completed it, as it would have had they come one by one."""
        out = []
        for i, t in enumerate(ids):
            self.completion += 1
            text = self.detok.push([t], final=final and i == len(ids) - 1)
            out.append(self.stop.feed(text) if self.completion > self.min_tokens else self.stop.skip(text))
            if self.stop.stopped:
                return "".join(out), ids[:i + 1], lps[:i + 1]
        return "".join(out), ids, lps
