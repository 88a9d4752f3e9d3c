"""Every Prometheus metric of pdmesh, defined once (names ``pdmesh_*``, in ``telemetry.REGISTRY``).

Counters and histograms are updated where things happen; gauges of a worker's
state (KV blocks per tier, queues) are read at scrape time from its latest load
report, so they cost nothing between scrapes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from mesh.protocol import LoadReport
from mesh.telemetry import LATENCY_BUCKETS, REGISTRY

# -- workers ------------------------------------------------------------------------------
WORKER_REQUESTS = Counter("pdmesh_worker_requests", "Requests a worker ended, by outcome",
                          ["model", "role", "outcome"], registry=REGISTRY)
WORKER_TTFT = Histogram("pdmesh_worker_ttft_seconds", "Arrival at the decode worker to its first token",
                        ["model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
WORKER_ITL = Histogram("pdmesh_worker_itl_seconds", "Time between output tokens at the decode worker",
                       ["model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
WORKER_E2E = Histogram("pdmesh_worker_e2e_seconds", "Arrival at the decode worker to its last token",
                       ["model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
WORKER_QUEUE = Histogram("pdmesh_worker_queue_seconds", "Prefill jobs: queued until a prefill worker took them",
                         ["model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
PROMPT_TOKENS = Counter("pdmesh_worker_prompt_tokens", "Prompt tokens of finished requests", ["model"],
                        registry=REGISTRY)
CACHED_TOKENS = Counter("pdmesh_worker_cached_prompt_tokens", "Prompt tokens served from a prefix cache",
                        ["model"], registry=REGISTRY)
OUTPUT_TOKENS = Counter("pdmesh_worker_output_tokens", "Tokens generated", ["model"], registry=REGISTRY)
PREFILL_DECISIONS = Counter("pdmesh_worker_prefill", "Where decode workers prefilled (local, remote, fallback)",
                            ["model", "where"], registry=REGISTRY)
TRANSFER_BYTES = Counter("pdmesh_kv_transfer_bytes", "KV bytes moved to decode workers", ["model", "transport"],
                         registry=REGISTRY)
TRANSFER_SECONDS = Histogram("pdmesh_kv_transfer_seconds", "Time to move one request's KV", ["model", "transport"],
                             buckets=LATENCY_BUCKETS, registry=REGISTRY)
PREFILL_COMPUTE = Histogram("pdmesh_prefill_compute_seconds", "Prefill worker: job start to first token",
                            ["model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)

# -- gateway ------------------------------------------------------------------------------
GATEWAY_TTFT = Histogram("pdmesh_gateway_ttft_seconds", "Request arrival to the first token out", ["model"],
                         buckets=LATENCY_BUCKETS, registry=REGISTRY)
GATEWAY_ITL = Histogram("pdmesh_gateway_itl_seconds", "Time between token batches to the client", ["model"],
                        buckets=LATENCY_BUCKETS, registry=REGISTRY)
GATEWAY_E2E = Histogram("pdmesh_gateway_e2e_seconds", "Request arrival to its last token", ["model"],
                        buckets=LATENCY_BUCKETS, registry=REGISTRY)
ROUTER_DECISIONS = Counter("pdmesh_router_decisions", "Routing decisions", ["model", "mode"], registry=REGISTRY)
ROUTER_OVERLAP = Histogram("pdmesh_router_overlap_ratio", "Share of the prompt cached on the chosen worker",
                           ["model", "mode"], buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=REGISTRY)
GATEWAY_REJECTED = Counter("pdmesh_gateway_rejected", "Requests refused before the API: a missing or invalid API "
                           "key, a key over its limits, a body over the cap", ["reason"], registry=REGISTRY)
GATEWAY_PRIORITY_CLAMPED = Counter("pdmesh_gateway_priority_clamped", "Requests whose priority was lowered to their "
                                   "API key's max_priority", registry=REGISTRY)
REFUSED_MESSAGES = Counter("pdmesh_refused_messages", "Bus messages refused (logged and dropped): a PrefillJob naming "
                           "a resource outside the worker's own, or out of bounds; a Cancel, PrefillDone or token "
                           "chunk from a peer the request is not bound to", ["role", "reason"], registry=REGISTRY)
BUS_DROPPED = Counter("pdmesh_bus_dropped_messages", "Bus messages dropped before any handler saw them: over "
                      "their type's size bound (never decoded), nested too deeply, or not a valid message of "
                      "the subject's type", ["message", "reason"], registry=REGISTRY)
FENCED_BLOCKS = Gauge("pdmesh_kv_fenced_blocks", "Decode KV blocks of timed-out prefill jobs kept out of the pool "
                      "until their writer is known to have stopped", ["model"], registry=REGISTRY)
ROUTER_FETCHES = Counter("pdmesh_router_fetches", "Decisions naming a peer to fetch prefix blocks from",
                         ["model"], registry=REGISTRY)
ROUTER_FETCH_BLOCKS = Counter("pdmesh_router_fetch_blocks", "Prefix blocks the router planned to fetch from peers",
                              ["model"], registry=REGISTRY)
PLANNER_REPLICAS = Gauge("pdmesh_planner_replicas", "The planner's pools: current and target size",
                         ["model", "pool", "kind"], registry=REGISTRY)


@dataclass(frozen=True)
class StepMetrics:
    """A decode worker's per-step metrics for its model: the labelled children, looked up once
    (``labels()`` costs a lock and a dict lookup per call)."""

    output_tokens: object
    ttft: object
    itl: object
    e2e: object
    prompt_tokens: object
    cached_tokens: object
    finished: object
    failed: object

    @classmethod
    def of(cls, model: str, role: str) -> StepMetrics:
        return cls(OUTPUT_TOKENS.labels(model), WORKER_TTFT.labels(model), WORKER_ITL.labels(model),
                   WORKER_E2E.labels(model), PROMPT_TOKENS.labels(model), CACHED_TOKENS.labels(model),
                   WORKER_REQUESTS.labels(model, role, "finished"), WORKER_REQUESTS.labels(model, role, "error"))


def observe_counts(hist, counts: dict[float, int]) -> None:
    """``count`` observations of each ``amount``, each bucket and the sum updated once (a window
    of decode steps' inter-token gaps: hundreds of amounts, a dozen buckets). prometheus_client
    has no weighted observe; this adds to the child's sum and buckets as ``observe`` does
    (tests/unit/test_metrics.py checks the exposition against ``observe`` called that often)."""
    bounds = hist._upper_bounds
    per_bucket = [0] * len(bounds)
    total = 0.0
    for amount, count in counts.items():
        per_bucket[bisect.bisect_left(bounds, amount)] += count
        total += amount * count
    if not any(per_bucket):
        return
    hist._sum.inc(total)
    for i, count in enumerate(per_bucket):
        if count:
            hist._buckets[i].inc(count)


class LoadCollector:
    """Scrape-time gauges from a worker's latest load report: KV blocks per tier, queues, running."""

    def __init__(self, latest: Callable[[], LoadReport | None]):
        self.latest = latest

    def collect(self) -> Iterator[GaugeMetricFamily]:
        r = self.latest()
        if r is None:
            return
        labels = [r.model, r.role]
        blocks = GaugeMetricFamily("pdmesh_kv_blocks", "KV blocks by tier and state",
                                   labels=["model", "role", "tier", "state"])
        blocks.add_metric([*labels, "device", "used"], r.kv_blocks_used)
        blocks.add_metric([*labels, "device", "free"], r.kv_blocks_total - r.kv_blocks_used)
        for tier in ("host", "disk"):
            if f"{tier}_blocks" in r.counters:
                blocks.add_metric([*labels, tier, "cached"], r.counters[f"{tier}_blocks"])
        hits = GaugeMetricFamily("pdmesh_kv_prefix_hit_blocks",
                                 "Prefix-cache hits by where the blocks came from (since start)",
                                 labels=["model", "role", "tier"])
        for tier in ("device", "host", "disk", "peer"):
            key = f"hit_blocks_{tier}"
            if key in r.counters:
                hits.add_metric([*labels, tier], r.counters[key])
        queue = GaugeMetricFamily("pdmesh_prefill_queue_depth",
                                  "Decode: requests waiting for remote KV; prefill: jobs held",
                                  labels=["model", "role"])
        queue.add_metric(labels, r.waiting_for_kv if r.role == "decode" else r.active_jobs)
        running = GaugeMetricFamily("pdmesh_worker_running", "Sequences running", labels=["model", "role"])
        running.add_metric(labels, r.running)
        waiting = GaugeMetricFamily("pdmesh_worker_waiting", "Sequences waiting to be scheduled",
                                    labels=["model", "role"])
        waiting.add_metric(labels, r.waiting)
        fetch = GaugeMetricFamily("pdmesh_kv_peer_fetch", "Peer fetches (since start): requested and served, "
                                  "in fetches and blocks", labels=["model", "role", "counter"])
        for key in PEER_FETCH_COUNTERS:
            if key in r.counters:
                fetch.add_metric([*labels, key], r.counters[key])
        yield from (blocks, hits, queue, running, waiting, fetch)
        yield from speculative_metrics(r)


def speculative_metrics(r: LoadReport) -> list[GaugeMetricFamily]:
    """Speculative decoding per method from the report's ``spec_{kind}:{method}`` counters (since start):
    tokens drafted, drafts accepted, tokens emitted by drafting rows; acceptance rate, and the mean
    tokens a drafting row emits per step (accepted drafts plus the target's own)."""
    per_method: dict[str, dict[str, int]] = {}
    for key, value in r.counters.items():
        if key.startswith("spec_") and ":" in key:
            kind, _, method = key[len("spec_"):].partition(":")
            per_method.setdefault(method, {})[kind] = value
    if not per_method:
        return []
    labels = [r.model, r.role]
    tokens = GaugeMetricFamily("pdmesh_spec_tokens", "Speculative decoding tokens (since start): drafted, "
                               "accepted, emitted (eagle3, mtp: rebuilt)", labels=["model", "role", "method", "kind"])
    rate = GaugeMetricFamily("pdmesh_spec_acceptance_rate", "Accepted / drafted tokens (since start)",
                             labels=["model", "role", "method"])
    length = GaugeMetricFamily("pdmesh_spec_mean_accepted_length", "Tokens a drafting row emits per step "
                               "(since start)", labels=["model", "role", "method"])
    for method, c in sorted(per_method.items()):
        for kind in ("drafted", "accepted", "emitted"):
            tokens.add_metric([*labels, method, kind], c.get(kind, 0))
        if "rebuilt" in c:  # eagle3, mtp: tokens whose target states the drafter recomputed
            tokens.add_metric([*labels, method, "rebuilt"], c["rebuilt"])
        rate.add_metric([*labels, method], c.get("accepted", 0) / c["drafted"] if c.get("drafted") else 0.0)
        length.add_metric([*labels, method], c.get("emitted", 0) / c["rows"] if c.get("rows") else 0.0)
    return [tokens, rate, length]


# load-report counters of peer fetch (decode/peerfetch.py, mocker/worker.py)
PEER_FETCH_COUNTERS = ("peer_fetch_requests", "peer_fetch_ok", "peer_fetch_empty", "peer_fetch_failed",
                       "peer_fetch_blocks", "peer_serve_requests", "peer_serve_blocks", "peer_serve_refused",
                       "peer_serve_failed")
