"""Which worker serves a request: a pure function of the request and the router's state.

``pick_worker`` decides; it sends nothing and reads no clock, so it is tested
without NATS. Modes:

- ``kv``: per worker, in *prefill-block units* (1.0 = the time to prefill one block)::

      cost = prefill_weight * (pending prefill blocks + own + fetch + new)
           + decode_weight * (blocks it holds for running requests)

  ``own``: the worker's leading run of the prompt's blocks, each costed at what it takes to
  make it usable there: 0 on device, its onboarding time on the worker's host or disk tier
  (``mesh.router.costs``: transfer time / prefill time, from the worker's card or the
  reference hardware: a host block ~0.09, a disk block ~0.44). ``new``: blocks nobody it can
  reach holds: prefilled. ``fetch`` (with ``peer_fetch``): when a peer holds a longer run
  than the worker, the blocks past the worker's run can come from that peer, at the predicted
  fetch time (fixed round trips + half the holder's current step + per-block network time; a
  block on the peer's disk at disk speed), taken only where it is cheaper than prefilling
  them; the decision then names the source and the number of blocks. So a cached prefix pulls
  a request to its holder only as much as it saves over fetching it, and load decides more.

  Temperature 0 takes the cheapest (ties broken at random); above 0 it samples from a softmax
  over the normalized costs, which spreads load when costs are close. A held block weighs a
  tenth of a block to prefill by default: prefill is what a new request waits for, while a
  running sequence's blocks cost each decode step little. A decode weight of 1 let ordinary
  differences in running requests outweigh a long cached prefix: in an A/B on the Mooncake
  trace replay it cut the hit rate from 29% to 20% and raised loaded TTFT p50 from 0.43x to
  0.82x of a round-robin run's. A LoRA request adds ``adapter_cost`` on a worker whose load
  report does not show its adapter in a device slot (only workers holding the adapter are
  candidates; its cached prefixes already count through the adapter-seeded hashes).
- ``round-robin``, ``random``: ignore caches and load.
- ``least-loaded``: the fewest active plus pending blocks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.hashing import DEFAULT_HASH_KEY, HashKey
from mesh.router.costs import DISK, HOST, KvCosts, default_costs
from mesh.router.index import PrefixMatch

MODES = ("kv", "round-robin", "random", "least-loaded")
FETCH_SOURCES_TRIED = 3  # the deepest holders considered as the source of a fetch


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "kv"
    prefill_weight: float = 1.0
    decode_weight: float = 0.1
    temperature: float = 0.0
    predict_ttl: float = 120.0  # approximate mode: how long a routed prefix is assumed cached
    pending_ttl: float = 10.0  # event mode: how long a routed prefix counts before its events arrive
    # A LoRA request on a worker without its adapter in a device slot: the swap-in (and the slot
    # it takes from another adapter), in blocks to prefill
    adapter_cost: float = 4.0
    peer_fetch: bool = False  # plan fetches of prefix blocks from peers (workers that can serve them)
    fetch_min_blocks: int = 2  # a shorter fetch is not worth a round trip
    hash_key: HashKey = DEFAULT_HASH_KEY  # the mesh's block-hash secret: the router hashes as the workers do

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown router mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.temperature < 0:
            raise ValueError("router temperature must be >= 0")
        if self.fetch_min_blocks < 1:
            raise ValueError("fetch_min_blocks must be >= 1")


@dataclass(frozen=True)
class WorkerLoad:
    """What the router knows of one candidate worker (in blocks)."""

    worker_id: str
    active_blocks: int = 0  # KV blocks held by its running requests (from its last load report)
    pending_prefill_blocks: int = 0  # prompt blocks queued or being prefilled there
    inflight_blocks: int = 0  # blocks of our own recent decisions its last report does not show yet
    total_blocks: int = 0
    adapter_cold: bool = False  # the request's LoRA adapter is not in a device slot there now
    costs: KvCosts | None = None  # its per-block costs (None: the reference hardware's)
    can_fetch: bool = True  # it fetches blocks from the peer a decision names (peer fetch)
    can_serve: bool = True  # it sends blocks to peers that ask


class PromptBlocks:
    """A request's prompt in blocks (for a dataclass with ``num_tokens`` and ``block_size``)."""

    num_tokens: int
    block_size: int

    @property
    def prompt_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def reusable_blocks(self) -> int:
        """Blocks an engine can take from a cache: never the one holding the last prompt token."""
        return max((self.num_tokens - 1) // self.block_size, 0)


@dataclass(frozen=True)
class RouteRequest(PromptBlocks):
    num_tokens: int
    block_size: int
    hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Decision:
    worker_id: str
    mode: str
    overlap_blocks: float  # credited cached blocks on the chosen worker (its own tiers)
    new_blocks: int  # blocks the chosen worker must prefill
    cost: float = 0.0
    hit_blocks: int = 0  # the chosen worker's own leading run (any tier)
    fetch_source: str = ""  # a peer to fetch blocks from ("" = none)
    fetch_blocks: int = 0  # blocks past ``hit_blocks`` to fetch from it


@dataclass(frozen=True)
class Plan:
    """How a request would be served on one worker, and what that costs."""

    worker_id: str
    cost: float
    hit_blocks: int
    credited: float
    new_blocks: int
    fetch_source: str = ""
    fetch_blocks: int = 0


@dataclass(frozen=True)
class _Source:
    worker_id: str
    match: PrefixMatch
    fetchable: int
    pending_blocks: int


def plan_worker(req: RouteRequest, w: WorkerLoad, match: PrefixMatch | None, sources: list[_Source],
                config: RouterConfig) -> Plan:
    """The cost of serving ``req`` on ``w``, fetching from one of ``sources`` (deepest first) where
    that is predicted cheaper than prefilling."""
    cost, depth, own, src, n_fetch = _terms(req, w, match, sources, config)
    return Plan(w.worker_id, cost, depth, depth - own, req.prompt_blocks - depth - n_fetch, src, n_fetch)


def _terms(req: RouteRequest, w: WorkerLoad, match: PrefixMatch | None, sources: list[_Source],
           config: RouterConfig) -> tuple[float, int, float, str, int]:
    """(cost, own run, its onboarding cost, fetch source, fetched blocks): the per-worker hot loop
    of a decision, so it builds no objects."""
    usable = req.reusable_blocks
    depth = own = 0
    costs = w.costs
    if match is not None:
        depth = match.depth if match.depth < usable else usable
        if match.below:
            costs = costs or default_costs(req.block_size)
            own = sum(costs.block_cost(bits) for pos, bits in match.below if pos < depth)
    src, n_fetch, fetch = "", 0, 0.0
    if sources and w.can_fetch and min(sources[0].fetchable, usable) - depth >= config.fetch_min_blocks:
        src, n_fetch, fetch = _best_fetch(costs or default_costs(req.block_size), w.worker_id, depth, usable,
                                          sources, config)
    prefill = w.pending_prefill_blocks + own + fetch + req.prompt_blocks - depth - n_fetch
    cost = config.prefill_weight * prefill + config.decode_weight * (w.active_blocks + w.inflight_blocks)
    if w.adapter_cold:
        cost += config.adapter_cost
    return cost, depth, own, src, n_fetch


def _best_fetch(costs: KvCosts, worker_id: str, depth: int, usable: int, sources: list[_Source],
                config: RouterConfig) -> tuple[str, int, float]:
    """The source (of the deepest few) whose blocks past ``depth`` save the most over prefilling them."""
    best, tried = ("", 0, 0.0), 0
    best_gain = 0.0
    for s in sources:
        end = min(s.fetchable, usable)
        if end - depth < config.fetch_min_blocks or tried >= FETCH_SOURCES_TRIED:
            break
        if s.worker_id == worker_id:
            continue
        tried += 1
        n = end - depth
        n_disk = sum(1 for pos, bits in s.match.below if depth <= pos < end and bits & DISK and not bits & HOST)
        c = costs.fetch_cost(n, n_disk, s.pending_blocks)
        if n - c > best_gain:
            best_gain, best = n - c, (s.worker_id, n, c)
    return best


def fetch_sources(workers: list[WorkerLoad], matches: Mapping[str, PrefixMatch]) -> list[_Source]:
    """The workers that could send blocks of the prompt, deepest run held for sure first."""
    load = {w.worker_id: w.pending_prefill_blocks for w in workers if w.can_serve}
    out = [_Source(wid, m, m.fetchable(), load[wid]) for wid, m in matches.items() if wid in load]
    out.sort(key=lambda s: (-s.fetchable, s.pending_blocks, s.worker_id))
    return [s for s in out if s.fetchable > 0]


def _sources(workers: list[WorkerLoad], matches: Mapping[str, PrefixMatch], config: RouterConfig,
             sources: list[WorkerLoad] | None) -> list[_Source]:
    if not config.peer_fetch or not matches:
        return []
    return fetch_sources(sources if sources is not None else workers, matches)


def plan_all(req: RouteRequest, workers: list[WorkerLoad], matches: Mapping[str, PrefixMatch],
             config: RouterConfig, sources: list[WorkerLoad] | None = None) -> dict[str, Plan]:
    """Every candidate's plan. ``sources``: the workers that may send blocks (default: the candidates)."""
    srcs = _sources(workers, matches, config, sources)
    return {w.worker_id: plan_worker(req, w, matches.get(w.worker_id), srcs, config) for w in workers}


def kv_costs(req: RouteRequest, workers: list[WorkerLoad], matches: Mapping[str, PrefixMatch],
             config: RouterConfig, sources: list[WorkerLoad] | None = None) -> dict[str, float]:
    srcs = _sources(workers, matches, config, sources)
    return {w.worker_id: _terms(req, w, matches.get(w.worker_id), srcs, config)[0] for w in workers}


def pick_worker(req: RouteRequest, workers: list[WorkerLoad], matches: Mapping[str, PrefixMatch],
                config: RouterConfig, rng: random.Random, rr_counter: int = 0,
                sources: list[WorkerLoad] | None = None) -> Decision:
    """Choose the worker for ``req``. ``matches``: each worker's run of the prompt's blocks
    (``KvIndex.match``); ``sources``: workers that may send blocks to the chosen one (peer fetch;
    default the candidates themselves: a worker excluded from serving may still be a source)."""
    if not workers:
        raise LookupError("no candidate workers")
    workers = sorted(workers, key=lambda w: w.worker_id)  # deterministic order for ties and round-robin
    mode = config.mode
    if mode == "round-robin":
        chosen = workers[rr_counter % len(workers)]
    elif mode == "random":
        chosen = rng.choice(workers)
    elif mode == "least-loaded":
        load = {w.worker_id: w.active_blocks + w.inflight_blocks + w.pending_prefill_blocks for w in workers}
        best = min(load.values())
        chosen = rng.choice([w for w in workers if load[w.worker_id] == best])
    else:
        srcs = _sources(workers, matches, config, sources)
        costs = {w.worker_id: _terms(req, w, matches.get(w.worker_id), srcs, config)[0] for w in workers}
        chosen = _choose(workers, costs, config.temperature, rng)
        p = plan_worker(req, chosen, matches.get(chosen.worker_id), srcs, config)
        return Decision(chosen.worker_id, mode, p.credited, p.new_blocks, p.cost, p.hit_blocks,
                        p.fetch_source, p.fetch_blocks)
    m = matches.get(chosen.worker_id)
    hit = min(m.depth, req.reusable_blocks) if m is not None else 0
    return Decision(chosen.worker_id, mode, float(hit), req.prompt_blocks - hit, hit_blocks=hit)


def _choose(workers: list[WorkerLoad], costs: dict[str, float], temperature: float,
            rng: random.Random) -> WorkerLoad:
    if temperature <= 0:
        best = min(costs.values())
        return rng.choice([w for w in workers if costs[w.worker_id] == best])
    top = max(costs.values()) or 1.0
    logits = [-costs[w.worker_id] / top / temperature for w in workers]
    m = max(logits)
    weights = [math.exp(x - m) for x in logits]
    return rng.choices(workers, weights=weights, k=1)[0]
