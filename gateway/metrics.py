"""The gateway's Prometheus metrics: requests by endpoint and status, tokens, cancels, migrations,
choices by final state, token batches, load; and the ``/metrics`` text.

Every gateway process counts into ``prometheus_client`` metrics. With several processes on one
port (``mesh gateway --workers N``), ``PROMETHEUS_MULTIPROC_DIR`` is set before they start, so
their counters live in files there and a scrape, whichever process answers it, adds them up
(prometheus_client's multiprocess mode; gauges of in-flight work sum over live processes).
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily

from mesh.metrics import GATEWAY_E2E, GATEWAY_ITL, GATEWAY_TTFT
from mesh.telemetry import REGISTRY

REQUESTS = Counter("pdmesh_gateway_requests", "Requests answered, by endpoint and HTTP status",
                   ["endpoint", "status"], registry=REGISTRY)
COMPLETION_TOKENS = Counter("pdmesh_gateway_completion_tokens", "Tokens streamed from workers", registry=REGISTRY)
CANCELS = Counter("pdmesh_gateway_cancels", "Requests cancelled on a worker before they finished",
                  registry=REGISTRY)
MIGRATIONS = Counter("pdmesh_gateway_migrations", "Streams resumed on another worker mid-request",
                     registry=REGISTRY)
REROUTES = Counter("pdmesh_gateway_reroutes",
                   "Requests sent to another worker after theirs died or went silent before a token",
                   registry=REGISTRY)
CHOICES = Counter("pdmesh_gateway_choices", "Choices that ended, by final state (FINISHED, FAILED, CLOSED)",
                  ["state"], registry=REGISTRY)


class Tally:
    """A counter bumped per message on the token path: counted in a plain int and handed to its
    Prometheus counter every ``FLUSH_EVERY`` counts, every ``FLUSH_S`` and at each scrape. A
    Prometheus ``inc`` takes a lock (and, with several gateway processes, writes a file); at 1,000
    workers a gateway gets one token batch per worker per step, and three ``inc``s per batch were
    2% of its time. A scrape sees another process's counts at most ``FLUSH_S`` late."""

    FLUSH_EVERY = 256
    FLUSH_S = 0.5
    ALL: list[Tally] = []

    __slots__ = ("at", "counter", "n")

    def __init__(self, counter: Counter):
        self.counter = counter
        self.n = 0
        self.at = 0.0
        Tally.ALL.append(self)

    def inc(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self.FLUSH_EVERY:
            self.flush()
        elif self.n == n:  # the first since the last flush: the clock is read once per flush period
            self.at = time.monotonic()
        elif time.monotonic() - self.at >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.n:
            n, self.n = self.n, 0
            self.counter.inc(n)

    @classmethod
    def flush_all(cls) -> None:
        for t in cls.ALL:
            t.flush()


TOKEN_BATCHES = Tally(Counter("pdmesh_gateway_token_batches", "TokenBatch messages received (one per worker step)",
                              registry=REGISTRY))
LINK_BATCHES = Tally(Counter("pdmesh_gateway_link_batches", "TokenBatch messages that came over token links "
                             "(mesh.tokenlink) rather than through NATS", registry=REGISTRY))
TOKEN_LINKS = Gauge("pdmesh_gateway_token_links", "Workers connected to this gateway over token links",
                    registry=REGISTRY, multiprocess_mode="livesum")
BATCHED_CHUNKS = Tally(Counter("pdmesh_gateway_batched_chunks", "Token chunks that arrived inside TokenBatch "
                               "messages", registry=REGISTRY))
LIVE_CHOICES = Gauge("pdmesh_gateway_live_choices", "Choices routing, waiting or streaming (not final)",
                     registry=REGISTRY, multiprocess_mode="livesum")
DIRECT_DELTAS = Counter("pdmesh_gateway_direct_deltas", "Mid-stream deltas written to the client from the reply "
                        "handler (gateway/choices/direct.py), not through the choice's task", registry=REGISTRY)
INFLIGHT = Gauge("pdmesh_gateway_inflight_requests", "Choices admitted and not finished",
                 registry=REGISTRY, multiprocess_mode="livesum")

BATCHES = Counter("pdmesh_gateway_batches", "Batches that entered a state (validating, in_progress, finalizing, "
                  "completed, failed, cancelling, cancelled, expired), by state", ["state"], registry=REGISTRY)
BATCH_LINES = Counter("pdmesh_gateway_batch_lines", "Batch lines done, by outcome (completed: a 2xx kept in the "
                      "output file; failed: kept in the error file)", ["outcome"], registry=REGISTRY)
BATCH_RUNNING = Gauge("pdmesh_gateway_batches_running", "Batches this gateway holds the lease of and runs",
                      registry=REGISTRY, multiprocess_mode="livesum")
BATCH_INFLIGHT = Gauge("pdmesh_gateway_batch_inflight", "Batch lines running now, and the governor's limit",
                       ["kind"], registry=REGISTRY, multiprocess_mode="livesum")


@dataclass(frozen=True)
class Latency:
    """One model's latency histograms (labelled children, looked up once per model)."""

    ttft: object
    itl: object
    e2e: object


class ChoiceFigures:
    """One choice's streamed tokens and inter-token gaps, added to Prometheus once, when the choice
    ends: at GPU pace every token is its own batch, and ``Histogram.observe`` walks the buckets in
    Python under a lock (with the token counter's lock, a few us per token)."""

    __slots__ = ("bounds", "buckets", "direct", "gap_sum", "itl", "last_at", "tokens")

    def __init__(self, itl):
        self.itl = itl
        self.bounds = itl._upper_bounds
        self.buckets = [0] * len(self.bounds)
        self.gap_sum = 0.0
        self.tokens = 0
        self.direct = 0  # deltas written by the choice's DirectSink
        self.last_at = 0.0  # when the last batch of tokens arrived (time.monotonic())

    def gap(self, seconds: float) -> None:
        """One observation of the ITL histogram (the time per token of a batch after the first)."""
        self.buckets[bisect.bisect_left(self.bounds, seconds)] += 1
        self.gap_sum += seconds

    def flush(self) -> None:
        """Into Prometheus, as that many ``observe`` and ``inc`` calls would (once per choice)."""
        if self.tokens:
            COMPLETION_TOKENS.inc(self.tokens)
            self.tokens = 0
        if self.direct:
            DIRECT_DELTAS.inc(self.direct)
            self.direct = 0
        if self.gap_sum or any(self.buckets):
            self.itl._sum.inc(self.gap_sum)
            for i, n in enumerate(self.buckets):
                if n:
                    self.itl._buckets[i].inc(n)
            self.buckets = [0] * len(self.bounds)
            self.gap_sum = 0.0


class GatewayStats:
    """What the gateway's code bumps; one per process."""

    def __init__(self):
        self.migrations = 0  # this process's, for logs and tests
        self.reroutes = 0
        self._latency: dict[str, Latency] = {}

    def latency(self, model: str) -> Latency:
        got = self._latency.get(model)
        if got is None:
            got = self._latency[model] = Latency(GATEWAY_TTFT.labels(model), GATEWAY_ITL.labels(model),
                                                 GATEWAY_E2E.labels(model))
        return got

    def request(self, endpoint: str, status: int) -> None:
        REQUESTS.labels(endpoint, str(status)).inc()

    def tokens(self, n: int) -> None:
        COMPLETION_TOKENS.inc(n)

    def choice_figures(self, latency: Latency) -> ChoiceFigures:
        return ChoiceFigures(latency.itl)

    def cancel(self) -> None:
        CANCELS.inc()

    def migrated(self, with_tokens: bool) -> None:
        """A choice resumed elsewhere: a migration when tokens had been streamed, else a reroute."""
        if with_tokens:
            self.migrations += 1
            MIGRATIONS.inc()
        else:
            self.rerouted()

    def rerouted(self) -> None:
        self.reroutes += 1
        REROUTES.inc()

    def choice_started(self) -> None:
        LIVE_CHOICES.inc()

    def choice_ended(self, state_name: str) -> None:
        LIVE_CHOICES.dec()
        CHOICES.labels(state_name).inc()

    def inflight(self, delta: int) -> None:
        INFLIGHT.inc(delta)


class WorkersCollector:
    """Scrape-time gauges from this process's view of the registry (the same in every process).

    ``ready_workers`` is the gateway's count of ready decode workers per model (empty before it
    has joined the registry), asked at each scrape."""

    def __init__(self, ready_workers: Callable[[], dict[str, int]]):
        self.ready_workers = ready_workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        live = GaugeMetricFamily("pdmesh_gateway_live_workers", "Ready decode workers per model", labels=["model"])
        for model, n in self.ready_workers().items():
            live.add_metric([model], n)
        yield live


def workers_registry(ready_workers: Callable[[], dict[str, int]]) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(WorkersCollector(ready_workers))
    return reg


def render(workers: CollectorRegistry) -> bytes:
    """The /metrics text: this process's registry, or every gateway process's in multiprocess mode,
    then ``workers`` (``workers_registry``: this process's view, not summed over processes)."""
    Tally.flush_all()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry) + generate_latest(workers)
    return generate_latest(REGISTRY) + generate_latest(workers)
