"""What every worker with a KV engine shares, on top of ``worker.core.WorkerCore`` (the bus, the
card, load reports, graceful stop): an engine in its own thread, KV events, ordered output
delivery, LoRA requests, and the engine's half of a load report.

``DecodeWorker`` and ``PrefillWorker`` (and custom workers) subclass ``WorkerBase`` and fill in
``setup()``, ``handle_outputs()``, ``card()`` and ``load()``.

Lifecycle (``WorkerCore.run``, with ``start`` here): connect -> build engine (in a thread) ->
start engine thread -> setup subscriptions -> register card -> serve until stop -> drain
(status "draining", finish in-flight work) -> deregister -> unsubscribe -> stop engine ->
close bus.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import deque
from contextlib import AsyncExitStack
from dataclasses import replace

from engine.core import EngineCore
from engine.loop import EngineLoop, InlineEngineLoop
from engine.sampling import SamplingParams
from engine.sequence import Sequence, TokenLogprob
from mesh.adapters import adapter_names, hot_adapters, lora_slots, serve_lora_requests
from mesh.constraints.spec import Constraint
from mesh.errors import RequestError
from mesh.kvevents import KvEventPublisher
from mesh.metrics import ExpertTokens, ExpertTokensCollector, LoadCollector
from mesh.procutil import cancel_and_wait
from mesh.protocol import LoadReport, SamplingOptions, TokenLogprobs, WorkerCard, WorkerLayout
from mesh.telemetry import REGISTRY, register_gpu_collector
from worker.core import WorkerCore
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def build_engine(settings: WorkerSettings, shm_path: str | None = None, remote_ranks=None) -> EngineCore:
    """``remote_ranks``: the engine's ranks on other hosts (``WorkerBase.before_engine``)."""
    if settings.is_mock:
        return settings.engine.build()
    from engine.engine import Engine

    cfg = settings.engine if shm_path is None else replace(settings.engine, kv_shm_path=shm_path)
    return Engine(cfg, remote_ranks)


class Window:
    """Samples of a latency from the last ``horizon`` seconds, for load reports."""

    def __init__(self, horizon: float = 6.0, size: int = 4096):
        self.horizon = horizon
        self._v: deque[tuple[float, float]] = deque(maxlen=size)

    def add(self, v: float) -> None:
        self._v.append((time.monotonic(), v))

    def _recent(self) -> list[float]:
        # Read from the engine thread while the event loop appends: copy first (one C call,
        # atomic under the GIL); iterating the live deque could see it mutate.
        cutoff = time.monotonic() - self.horizon
        return [v for t, v in self._v.copy() if t >= cutoff]

    def mean(self) -> float:
        v = self._recent()
        return sum(v) / len(v) if v else 0.0

    def quantile(self, q: float) -> float:
        v = sorted(self._recent())
        return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def sampling_params(opts: SamplingOptions, **override) -> SamplingParams:
    """Wire options -> validated engine parameters (ValueError on bad values; a constraint that is
    not one, ``ConstraintError``: both are the request's 400)."""
    spec = opts.constraint
    return SamplingParams(
        max_tokens=override.get("max_tokens", opts.max_tokens),
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k,
        min_p=opts.min_p,
        seed=opts.seed,
        stop_token_ids=tuple(opts.stop_token_ids),
        ignore_eos=opts.ignore_eos,
        logprobs=opts.logprobs,
        presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty,
        repetition_penalty=opts.repetition_penalty,
        min_tokens=min(opts.min_tokens, override.get("max_tokens", opts.max_tokens)),
        speculate=opts.speculate,
        constraint=None if spec is None else Constraint(spec.kind, spec.source, spec.start_after),
    )


GRAMMAR_TIMEOUT = 30.0  # seconds to compile a request's constraint before it is refused


async def prepare_grammar(engine: EngineCore, seq: Sequence, timeout: float = GRAMMAR_TIMEOUT) -> str | None:
    """Before ``seq`` is added: compile its constraint (cached) and build its grammar state, caught
    up with the tokens it already generated (a migrated request's), in a thread, so that neither
    the engine thread nor the event loop waits for a compile. None when ready (or unconstrained),
    else why the request cannot be served (the worker's 400)."""
    if seq.params.constraint is None:
        return None
    try:
        await asyncio.wait_for(asyncio.to_thread(engine.attach_grammar, seq), timeout)
    except TimeoutError:
        return f"the constraint took over {timeout:g} s to compile"
    except RequestError as e:
        return str(e)
    return None


SPEC_COUNTER_FIELDS = (("drafted", "drafted"), ("accepted", "accepted"), ("emitted", "emitted"), ("rows", "steps"))


def grammar_counters(engine: EngineCore) -> dict[str, int]:
    """The compiled-grammar cache and mask figures of an engine that enforces constraints."""
    if engine.grammar is None:
        return {}
    st = engine.grammar.stats()
    return {"grammar_compile_hits": st["compile_hits"], "grammar_compile_misses": st["compile_misses"],
            "grammar_compile_ms": int(1000 * st["compile_seconds"]), "grammar_mask_rows": st["mask_rows"]}


def speculative_counters(engine: EngineCore) -> dict[str, int]:
    """Speculative decoding since start, keyed ``spec_{drafted,accepted,emitted,rows}:{method}``
    (``mesh.metrics.SpecCollector`` reads them); {} when the engine drafts nothing."""
    drafter = engine.scheduler.drafter
    if drafter is None:
        return {}
    c = engine.scheduler.spec
    out = {f"spec_{kind}:{drafter.name}": getattr(c, attr) for kind, attr in SPEC_COUNTER_FIELDS}
    rebuilt = getattr(drafter, "rebuilt_tokens", None)  # eagle3, mtp: target states recomputed for it
    if rebuilt is not None:
        out[f"spec_rebuilt:{drafter.name}"] = rebuilt
    return out


def wire_logprob(lp: TokenLogprob | None) -> TokenLogprobs | None:
    if lp is None:
        return None
    return TokenLogprobs(lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top])


def engine_logprob(lp: TokenLogprobs | None) -> TokenLogprob | None:
    if lp is None:
        return None
    return TokenLogprob(lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs, strict=False)))


def card_layout(engine) -> WorkerLayout:
    """The card's ``layout`` of an engine's ranks (``engine.parallel.layout.Layout``; an engine
    without one, the mocker's: one rank)."""
    layout = getattr(engine, "layout", None)
    if layout is None or layout.size == 1:
        return WorkerLayout()
    return WorkerLayout(layout.tp, layout.pp, list(layout.stage_layers) if layout.pp > 1 else [], layout.ep)


def card_kv_dtype(engine) -> str:
    """The card's ``kv_dtype``: the KV pool's dtype (``float8_e4m3fn``, ``bfloat16``); "" for an
    engine with no KV bytes (the mocker)."""
    spec = getattr(engine, "kv_spec", None)
    return str(spec.dtype).removeprefix("torch.") if spec is not None else ""


class WorkerBase(WorkerCore):
    role = ""
    publishes_kv_events = False  # decode workers do: the router indexes their caches

    def __init__(self, settings: WorkerSettings):
        super().__init__(settings)
        self.engine: EngineCore | None = None
        self.loop: EngineLoop | None = None
        self.kv_events: KvEventPublisher | None = None
        self.remote_ranks = None  # engine.parallel.remote.RemoteRanks: its ranks on other hosts
        self._tasks: list[asyncio.Task] = []
        self.expert_tokens: ExpertTokens | None = None  # MoE engines: refreshed with each load report

    # -- for subclasses -----------------------------------------------------------
    def build(self) -> EngineCore:
        return build_engine(self.settings, remote_ranks=self.remote_ranks)

    def _engine_died(self, stop: asyncio.Event) -> None:
        """The engine can never step again: leave (drain what is left, deregister) and exit non-zero,
        so that whoever runs the worker replaces it and gateways resume its streams elsewhere."""
        log.error("the engine is broken for good: %s worker %s leaves", self.role, self.worker_id)
        self.exit_code = 1
        self.settings = replace(self.settings, drain_timeout=0.0)
        stop.set()

    def warm_up(self) -> None:
        """One tiny request before the card goes up: the first step faults in pages and picks
        kernels, and no user request should wait for that. (Too short to cache a block.)"""
        if not self.settings.is_mock:
            self.engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))

    async def setup(self, stack: AsyncExitStack) -> None:
        """Subscribe and start role tasks; push cleanups onto ``stack``."""

    async def handle_outputs(self, outs: list) -> None:
        """Step outputs, in step order, on the event loop (several steps' at once when the loop was
        busy: a request may then have several outputs in ``outs``)."""

    def card(self) -> WorkerCard:
        e = self.engine
        return WorkerCard(
            worker_id=self.worker_id, role=self.role, model=e.model_name, block_size=e.block_size,
            kv_blocks=e.pool.num_blocks, max_model_len=e.max_model_len, host=socket.gethostname(),
            pid=os.getpid(), started=self.started, updated=time.time(), status=self.status,
            engine="mock" if self.settings.is_mock else "model", publishes_kv_events=self.publishes_kv_events,
            metrics_port=self.metrics_port, adapters=adapter_names(e), max_loras=lora_slots(e),
            layout=card_layout(e), kv_block_bytes=e.kv_cache.spec.block_bytes if e.kv_cache is not None else 0,
            kv_dtype=card_kv_dtype(e),
        )

    def load(self, engine: EngineCore) -> LoadReport:
        """Runs in the engine thread, between steps."""
        s = engine.scheduler
        counts = getattr(engine, "expert_token_counts", None)  # MoE: the per-expert load, for scrapes
        if counts is not None:
            self.expert_tokens = ExpertTokens(engine.model_name, self.role, counts())
        pending = sum(q.num_uncomputed_tokens for q in s.waiting) + sum(
            q.num_uncomputed_tokens for q in s.running if q.is_prefilling
        )
        return LoadReport(
            worker_id=self.worker_id, model=engine.model_name, role=self.role, timestamp=time.time(),
            waiting=len(s.waiting), running=len(s.running), waiting_for_kv=len(s.remote),
            kv_blocks_used=engine.pool.num_used, kv_blocks_total=engine.pool.num_blocks,
            pending_prefill_tokens=pending, requests_total=self.counters.requests, status=self.status,
            counters={
                **self.counters.by_key, "requests": self.counters.requests, "finished": self.counters.finished,
                "cancelled": self.counters.cancelled, "errors": self.counters.errors,
                "steps": engine.num_steps, "preemptions": s.num_preemptions,
                "prefix_hit_blocks": engine.pool.hit_blocks,
                "prefix_query_blocks": engine.pool.queried_blocks, **engine.kv_counters(),
                **grammar_counters(engine), **speculative_counters(engine),
            },
            hot_adapters=hot_adapters(engine),
            deferrable=sum(1 for q in (*s.waiting, *s.running, *s.remote.values()) if q.priority < 0),
        )

    # -- WorkerCore's hooks: the engine ---------------------------------------------
    async def before_engine(self, stack: AsyncExitStack) -> None:
        """With ranks on other hosts (``--local-ranks``): the door they join through, and its
        answers on the bus, open while the engine loads (it waits for them)."""
        ranks = self.settings.remote_ranks
        if not ranks:
            return
        from engine.parallel.remote import RemoteRanks
        from engine.parallel.rendezvous import group_token, serve_joins
        from mesh.tokenlink import local_address_toward

        e = self.settings.engine
        addr = self.settings.rank_addr
        if not addr:
            url = self.bus.nc.connected_url
            addr = await asyncio.to_thread(local_address_toward, url.hostname, url.port or 4222)
        token = group_token(e.hash_key, self.bus.subjects.ns, self.worker_id)
        self.remote_ranks = RemoteRanks(self.worker_id, ranks, token, addr)
        stack.callback(self.remote_ranks.close)
        await serve_joins(self.bus, self.remote_ranks, token, e.tp, e.pp, stack)
        log.warning("worker %s waits for rank(s) %s on other hosts (at %s): mesh rank --join %s", self.worker_id,
                    ", ".join(map(str, ranks)), addr, self.worker_id)

    def open_engine(self) -> None:
        self.engine = self.build()

    def served_model(self) -> str:
        return self.engine.model_name

    def register_collectors(self) -> None:
        REGISTRY.register(LoadCollector(lambda: self.last_load))
        REGISTRY.register(ExpertTokensCollector(lambda: self.expert_tokens))
        if getattr(self.engine, "device", None) is not None and self.engine.device.type == "cuda":
            register_gpu_collector()

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        """KV events, the engine thread, output delivery, the role's ``setup``, LoRA requests."""
        if self.publishes_kv_events:
            self.kv_events = KvEventPublisher(self.bus, self.worker_id, self.engine.model_name,
                                              self.settings.kv_event_interval_ms / 1000.0,
                                              together=self.shared.kv_batches if self.shared is not None else None)
        else:
            self.engine.pool.events.enabled = False
        # the mocker steps on the event loop itself (its step is a pause, never a block)
        loop_type = InlineEngineLoop if getattr(self.engine, "steps_inline", False) else EngineLoop
        self.loop = loop_type(self.engine, asyncio.get_running_loop(),
                               after_work=self.kv_events.flush if self.kv_events else None,
                               name=f"engine-{self.role}", on_failure=lambda e: self._engine_died(stop))
        self.loop.start()
        stack.callback(self.loop.stop)
        if self.remote_ranks is not None:  # a rank lost on another host: leave now, not at the next step
            main = asyncio.get_running_loop()
            self.engine.ranks.on_lost = lambda why: main.call_soon_threadsafe(self._engine_died, stop)
        if self.kv_events is not None:
            await self.kv_events.start(self.loop)
            stack.push_async_callback(self.kv_events.stop)
        stack.push_async_callback(self._cancel_tasks)
        self._tasks.append(asyncio.create_task(self._deliver_outputs(), name="outputs"))
        await self.setup(stack)
        await serve_lora_requests(self, stack)

    async def next_load(self) -> LoadReport:
        return await asyncio.wait_for(self.loop.call(self.load), 10.0)

    def close_engine(self) -> None:
        """After the engine loop stopped: the real engine closes its grammar process (and its shared
        buffer), host-tier copier (its slots file), tensor-parallel ranks and KV cache; the mocker
        has only a KV cache."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
            return
        kv = getattr(self.engine, "kv_cache", None)
        if kv is not None:
            kv.close(unlink=True)

    async def _cancel_tasks(self) -> None:
        await cancel_and_wait(self._tasks)

    async def _deliver_outputs(self) -> None:
        """Steps' outputs to ``handle_outputs``: every step that ended while the last ones were being
        sent goes in one call; with ``stream_interval`` at most one call per interval. Outputs that
        come sooner than that wait out the rest of it (and go with those that end meanwhile);
        steps slower than the interval wait for nothing, not even a turn of the loop."""
        interval = self.settings.stream_interval_ms / 1000.0
        sent = -interval
        while True:
            outs = await self.loop.outputs()
            if interval:
                wait = sent + interval - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    if self.loop.has_outputs:
                        outs += await self.loop.outputs()
            sent = time.monotonic()
            try:
                await self.handle_outputs(outs)
            except Exception:
                log.exception("delivering step outputs failed")
