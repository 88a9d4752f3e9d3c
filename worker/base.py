"""What every worker process shares: the bus, an engine in its own thread, a
card in the registry, load reports, ordered output delivery, graceful stop.

``DecodeWorker`` and ``PrefillWorker`` (and custom workers) subclass
``WorkerBase`` and fill in ``setup()``, ``handle_outputs()``, ``card()`` and
``load()``.

Lifecycle (``run``): connect -> build engine (in a thread) -> start engine
thread -> setup subscriptions -> register card -> serve until stop -> drain
(status "draining", finish in-flight work) -> deregister -> unsubscribe ->
stop engine -> close bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import deque
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar, Protocol

from engine.core import EngineCore
from engine.loop import EngineLoop, InlineEngineLoop
from engine.sampling import SamplingParams
from engine.sequence import Sequence, TokenLogprob
from mesh.adapters import adapter_names, hot_adapters, lora_slots, serve_lora_requests
from mesh.bus import Bus
from mesh.constraints.spec import Constraint
from mesh.errors import RequestError
from mesh.kvevents import KvEventPublisher
from mesh.metrics import LoadCollector
from mesh.natsauth import retry_unavailable
from mesh.procutil import StopEvent, cancel_and_wait, settle_heap, stop_event_on_signals
from mesh.protocol import LoadReport, SamplingOptions, TokenLogprobs, WorkerCard, subject_token
from mesh.registry import DEFAULT_TTL, CardPublisher
from mesh.telemetry import REGISTRY, register_gpu_collector, serve_metrics, setup_tracing

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from mesh.natsauth import NatsConfig

log = logging.getLogger(__name__)


def new_worker_id(role: str) -> str:
    return subject_token(f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}")


class SimulatedEngineConfig(Protocol):
    """The configuration of an engine that simulates a model (the mocker's ``MockConfig``, a layer
    above this one): it builds its own engine, which moves no KV bytes (its transport is "mock")
    and needs no warm-up. A model's ``EngineConfig`` (``simulated`` False) is built here instead:
    it cannot name ``engine.engine.Engine``, which imports it."""

    simulated: ClassVar[bool]

    def build(self) -> EngineCore: ...


@dataclass(frozen=True)
class WorkerSettings:
    nats_url: str
    ns: str = "mesh"
    worker_id: str = ""
    engine: EngineConfig | SimulatedEngineConfig | None = None  # None: a custom worker builds its own
    transports: tuple[str, ...] = ()  # () = for the device: shm,nixl,nats on CPU; cuda_ipc,nccl,nixl,nats on CUDA (nixl: if installed)
    disagg_threshold: int = 512  # decode: uncached prompt tokens from which to prefill remotely
    prefill_timeout: float = 10.0  # decode: seconds to wait for a prefill worker before prefilling locally
    prefill_capacity: int = 4  # prefill: jobs held at once
    load_interval: float = 1.0
    registry_ttl: float = DEFAULT_TTL
    drain_timeout: float = 30.0
    metrics_port: int = 0  # Prometheus /metrics on this port (0: any free port; -1: off)
    # decode: at most one emission (TokenBatch per gateway) per this many ms; steps that end in
    # between go out together. 0: each emission as soon as the event loop is free.
    # At most one token message per gateway per interval: a step's tokens wait at most this long
    # (nothing, when steps are longer than it, as a GPU's are), and the bus carries at most
    # 1000/interval messages per second per gateway however short the steps (docs/operations.md).
    stream_interval_ms: float = 1.0
    kv_event_interval_ms: float = 5.0  # decode: at most one KV event batch per this many ms (mesh/kvevents.py)
    max_queued: int = 0  # decode: requests waiting for their first token beyond which new ones get 429
    # (0: 4 x max_num_seqs); the gateway then tries another worker (back-pressure)
    nats: NatsConfig | None = None  # servers, credentials, TLS (None: nats_url + environment)
    metrics_host: str = "127.0.0.1"  # where /metrics listens ("0.0.0.0" or the pod IP to be scraped)
    peer_fetch: bool = False  # decode (model): serve prefix blocks to peers, fetch what the router plans
    peer_fetch_timeout: float = 5.0  # decode: seconds a peer fetch may take before the request prefills
    peer_pin_max_s: float = 10.0  # decode: the longest a peer's fetch keeps our blocks pinned, whatever it asks
    pooling: str = "last"  # embed: the pooling of a model whose directory names none (sentence-transformers')

    @property
    def is_mock(self) -> bool:
        return getattr(self.engine, "simulated", False)

    def transport_names(self) -> list[str]:
        """The KV transports this worker offers (decode) or uses (prefill), best first."""
        from kvstore.transfer import nixl_available, ordered

        if self.is_mock:
            return ["mock"]
        on_cuda = self.engine.torch_device.type == "cuda"
        names = self.transports or _default_transports(on_cuda, getattr(self.engine, "tp", 1))
        if on_cuda and "shm" in names:
            raise ValueError("the shm transport is for CPU workers; on CUDA use cuda_ipc, nccl, nixl or nats")
        if "nixl" in names and not nixl_available():
            raise ValueError("the nixl transport needs NIXL: pip install 'pdmesh[nixl]'")
        if "nixl" in names and getattr(self.engine, "tp", 1) != 1:
            log.warning("the nixl transport serves TP 1 workers only: KV between hosts goes over nats")
            names = tuple(n for n in names if n != "nixl")
        return ordered(names)


_told_no_nixl = False


def _default_transports(on_cuda: bool, tp: int) -> tuple[str, ...]:
    """Same-host transports, nixl between hosts when NIXL imports (TP 1: it registers one pool
    tensor), nats as the fallback."""
    from kvstore.transfer import nixl_available

    global _told_no_nixl
    same_host = ("cuda_ipc", "nccl") if on_cuda else ("shm",)
    if tp == 1 and nixl_available():
        return (*same_host, "nixl", "nats")
    if not _told_no_nixl:
        _told_no_nixl = True
        log.info("KV between hosts goes over nats (%s)",
                 "NIXL serves TP 1 only" if tp != 1 else "NIXL is not installed: pip install 'pdmesh[nixl]'")
    return (*same_host, "nats")


def build_engine(settings: WorkerSettings, shm_path: str | None = None) -> EngineCore:
    if settings.is_mock:
        return settings.engine.build()
    from engine.engine import Engine

    cfg = settings.engine if shm_path is None else replace(settings.engine, kv_shm_path=shm_path)
    return Engine(cfg)


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


@dataclass
class Counters:
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    errors: int = 0
    by_key: dict[str, int] = field(default_factory=dict)

    def bump(self, key: str, n: int = 1) -> None:
        self.by_key[key] = self.by_key.get(key, 0) + n


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
    return {f"spec_{kind}:{drafter.name}": getattr(c, attr) for kind, attr in SPEC_COUNTER_FIELDS}


def wire_logprob(lp: TokenLogprob | None) -> TokenLogprobs | None:
    if lp is None:
        return None
    return TokenLogprobs(lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top])


def engine_logprob(lp: TokenLogprobs | None) -> TokenLogprob | None:
    if lp is None:
        return None
    return TokenLogprob(lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs, strict=False)))


class WorkerBase:
    role = ""
    publishes_kv_events = False  # decode workers do: the router indexes their caches

    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        self.worker_id = settings.worker_id or new_worker_id(self.role)
        self.started = time.time()
        self.status = "ready"
        self.counters = Counters()
        self.ready = asyncio.Event()
        self.bus: Bus | None = None
        self.engine: EngineCore | None = None
        self.loop: EngineLoop | None = None
        self.cards: CardPublisher | None = None
        self._tasks: list[asyncio.Task] = []
        self.last_load: LoadReport | None = None
        self.metrics_port = 0
        self.exit_code = 0

    # -- for subclasses -----------------------------------------------------------
    def build(self) -> EngineCore:
        return build_engine(self.settings)

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

    def in_flight(self) -> int:
        return 0

    def card(self) -> WorkerCard:
        e = self.engine
        return WorkerCard(
            worker_id=self.worker_id, role=self.role, model=e.model_name, block_size=e.block_size,
            kv_blocks=e.pool.num_blocks, max_model_len=e.max_model_len, host=socket.gethostname(),
            pid=os.getpid(), started=self.started, updated=time.time(), status=self.status,
            engine="mock" if self.settings.is_mock else "model", publishes_kv_events=self.publishes_kv_events,
            metrics_port=self.metrics_port, adapters=adapter_names(e), max_loras=lora_slots(e),
        )

    def load(self, engine: EngineCore) -> LoadReport:
        """Runs in the engine thread, between steps."""
        s = engine.scheduler
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

    # -- lifecycle ----------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or stop_event_on_signals()
        s = self.settings
        setup_tracing(f"pdmesh-{self.role}")
        async with AsyncExitStack() as stack:
            self.bus = await Bus.connect(s.nats_url, name=self.worker_id, ns=s.ns, config=s.nats)
            stack.push_async_callback(self.bus.close)
            self.engine = await asyncio.to_thread(self.build)
            stack.callback(self.close_engine)
            await asyncio.to_thread(self.warm_up)
            self._serve_metrics()
            self.kv_events = None
            if self.publishes_kv_events:
                self.kv_events = KvEventPublisher(self.bus, self.worker_id, self.engine.model_name,
                                                  self.settings.kv_event_interval_ms / 1000.0)
            else:
                self.engine.pool.events.enabled = False
            # the mocker steps on the event loop itself (its step is a pause, never a block)
            loop_type = InlineEngineLoop if getattr(self.engine, "steps_inline", False) else EngineLoop
            self.loop = loop_type(self.engine, asyncio.get_running_loop(),
                                   after_work=self.kv_events.flush if self.kv_events else None,
                                   name=f"engine-{self.role}", on_failure=lambda e: self._engine_died(stop))
            self.loop.start()
            stack.callback(self.loop.stop)
            if self.kv_events is not None:
                await self.kv_events.start(self.loop)
                stack.push_async_callback(self.kv_events.stop)
            stack.push_async_callback(self._cancel_tasks)
            self._tasks.append(asyncio.create_task(self._deliver_outputs(), name="outputs"))
            await self.setup(stack)
            await serve_lora_requests(self, stack)
            self.cards = CardPublisher(self.bus, self.card, ttl=s.registry_ttl)
            await retry_unavailable(self.cards.start, "the worker registry")
            stack.push_async_callback(self.cards.stop)
            self._tasks.append(asyncio.create_task(self._report_load(), name="load"))
            settle_heap()  # start-up state built: out of the collector's way
            self.ready.set()
            log.info("%s worker %s serving %s", self.role, self.worker_id, self.engine.model_name)
            await stop.wait()
            await self.drain(stop)

    async def drain(self, stop: asyncio.Event | None = None) -> None:
        """Stop taking work, let in-flight work finish (bounded: ``drain_timeout`` after SIGTERM,
        a few seconds after SIGINT, none after a second signal), then return to deregister."""
        self.status = "draining"
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.cards.put(), 2.0)
        seconds = self.settings.drain_timeout
        if isinstance(stop, StopEvent):
            seconds = stop.drain_seconds(seconds)
        deadline = time.monotonic() + seconds
        while self.in_flight() and time.monotonic() < deadline and not (
                isinstance(stop, StopEvent) and stop.hurry.is_set()):
            await asyncio.sleep(0.05)
        if self.in_flight():
            log.warning("%d requests still in flight after the drain timeout", self.in_flight())

    def _serve_metrics(self) -> None:
        if self.settings.metrics_port < 0:
            return
        REGISTRY.register(LoadCollector(lambda: self.last_load))
        if getattr(self.engine, "device", None) is not None and self.engine.device.type == "cuda":
            register_gpu_collector()
        self.metrics_port = serve_metrics(self.settings.metrics_port, self.settings.metrics_host)

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
        sent goes in one call; with ``stream_interval`` at most one call per interval."""
        interval = self.settings.stream_interval_ms / 1000.0
        while True:
            outs = await self.loop.outputs()
            sent = time.monotonic()
            try:
                await self.handle_outputs(outs)
            except Exception:
                log.exception("delivering step outputs failed")
            if interval:
                await asyncio.sleep(interval - (time.monotonic() - sent))

    async def _report_load(self) -> None:
        subject = self.bus.subjects.load(self.engine.model_name, self.worker_id)
        while True:
            try:
                report = await asyncio.wait_for(self.loop.call(self.load), 10.0)
                self.last_load = report
                await self.bus.publish(subject, report, traced=False)
            except Exception as e:
                log.warning("load report failed: %s", e)
            await asyncio.sleep(self.settings.load_interval)
