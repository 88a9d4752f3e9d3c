"""The router's view of every decode worker's load, one row per slot (``mesh.router.index.Slots``),
in arrays: ``LoadTable``. And ``pick_kv``, the ``kv`` decision over all of them at once.

Why arrays: ``pick_worker`` (``mesh.router.policy``) takes a ``WorkerLoad`` per candidate and costs
each in Python; at 1,000 workers building and costing those objects took milliseconds per request
(issue 51). The common decision (mode ``kv``, temperature 0, no LoRA adapter, no peer fetch) is
the same formula over every worker, so it is a few vector operations here, and only the workers
that hold part of the prompt off the device (their onboarding cost) are looked at one by one.
Everything else goes through ``pick_worker`` as before; ``tests/unit/test_router_table.py`` checks
that both choose alike, ties and their random break included.

    row (slot)   active   pending_blocks   others   open   inflight_new   inflight_prompt   heard   block_size   max_seqs
                 from its load report             this router's own decisions        (monotonic)   its card

A worker's sequences now: ``open``, the requests this router sent it that have not ended (exact,
whether or not they reached it yet), plus ``others``, what its last report showed beyond the ones
of ours it could have shown (other routers' requests: ``running + waiting + waiting_for_kv`` less
our open ones then, at least 0). Counting from the report alone and adding what was routed since
(the first version of this) lost every request still on its way when the report was made: at C=512
about 150 ms of requests, ~20 per worker, so a full worker looked roomy. A worker at its sequence
limit (``others + open >= max_seqs``) queues a new request until one of its sequences ends, a
whole generation's wait: while another candidate has a free slot, a full one is not a candidate;
when every one is full, only those with the fewest queued are (``has_room``; both decision paths
apply it). While workers have room, slots do not enter the cost: a cached prefix still decides.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from mesh.router.costs import KvCosts
from mesh.router.policy import Decision, PromptBlocks, RouterConfig
from mesh.router.slots import Slots, slot_array


class LoadSummary(msgspec.Struct, tag_field="type", tag="LoadReport", omit_defaults=True):
    """What a router reads of a ``LoadReport``, decoded from the same bytes: the counters and latency
    windows are skipped unread (a fifth of the decode; every gateway process decodes every worker's
    report each second). Not a message of its own: it is never sent."""

    worker_id: str
    model: str
    role: str
    timestamp: float
    kv_blocks_used: int = 0
    pending_prefill_tokens: int = 0
    waiting: int = 0
    running: int = 0
    waiting_for_kv: int = 0
    hot_adapters: list[str] = msgspec.field(default_factory=list)


class LoadSummaries(msgspec.Struct, tag_field="type", tag="LoadReports"):
    """A ``LoadReports`` (a process's reports together, ``mesh.loads``) read as ``LoadSummary``s."""

    reports: list[LoadSummary] = msgspec.field(default_factory=list)


_COLUMNS = ("active", "pending_tokens", "pending_blocks", "others", "open", "inflight_new", "inflight_prompt",
            "max_seqs", "block_size")


class LoadTable:
    def __init__(self, slots: Slots, capacity: int = 64):
        self.slots = slots
        self.capacity = 0
        self.active = self.pending_tokens = self.pending_blocks = self.inflight_new = self.inflight_prompt = np.zeros(0)
        self.others = self.open = self.max_seqs = np.zeros(0)
        self.block_size = np.zeros(0)
        self.heard = np.zeros(0)
        self._grow(capacity)

    def _grow(self, need: int) -> None:
        cap = max(64, self.capacity)
        while cap < need:
            cap *= 2
        if cap == self.capacity:
            return
        for name in _COLUMNS:
            col = np.zeros(cap)
            col[: self.capacity] = getattr(self, name)[: self.capacity]
            setattr(self, name, col)
        heard = np.full(cap, np.inf)  # never heard from: not silent (a worker that just joined)
        heard[: self.capacity] = self.heard[: self.capacity]
        self.heard = heard
        self.block_size[self.capacity:] = 16
        self.capacity = cap

    def row(self, worker: str) -> int:
        s = self.slots.slot(worker)
        if s >= self.capacity:
            self._grow(s + 1)
        return s

    def report(self, worker: str, active_blocks: int, pending_tokens: int, heard: float, seqs: int = 0) -> None:
        """``seqs``: the sequences the report shows (running, waiting, waiting for their KV)."""
        s = self.row(worker)
        self.others[s] = max(seqs - self.open[s], 0)
        self.active[s] = active_blocks
        self.pending_tokens[s] = pending_tokens
        self.pending_blocks[s] = -(-pending_tokens // int(self.block_size[s]))
        self.heard[s] = heard

    def set_heard(self, worker: str, heard: float) -> None:
        s = self.slots.get(worker)
        if s is not None and s < self.capacity:
            self.heard[s] = heard

    def set_block_size(self, worker: str, block_size: int) -> None:
        s = self.row(worker)  # first: it may grow the arrays
        if self.block_size[s] != block_size:
            self.block_size[s] = block_size
            self.pending_blocks[s] = -(-int(self.pending_tokens[s]) // block_size)

    def set_max_seqs(self, worker: str, max_seqs: int) -> None:
        """The most sequences the worker runs at once (its card's capacity; 0: not said)."""
        self.max_seqs[self.row(worker)] = max_seqs

    def set_open(self, worker: str, n: int) -> None:
        """The requests this router sent the worker that have not ended."""
        s = self.slots.get(worker)
        if s is not None and s < self.capacity:
            self.open[s] = n

    def has_room(self, candidates: np.ndarray) -> np.ndarray:
        """``candidates`` less those at their sequence limit; when all are, those with the fewest
        queued (a worker that did not say its limit always has room)."""
        over = np.where(self.max_seqs > 0, self.others + self.open - self.max_seqs, -1.0)
        roomy = candidates & (over < 0)
        if roomy.any():
            return roomy
        if not candidates.any():
            return candidates
        return candidates & (over == over[candidates].min())

    def set_inflight(self, worker: str, new_blocks: int, prompt_blocks: int) -> None:
        s = self.row(worker)
        self.inflight_new[s] = new_blocks
        self.inflight_prompt[s] = prompt_blocks

    def clear(self, worker: str) -> None:
        """A worker that left: its row back to empty (the slot goes back to the pool after)."""
        s = self.slots.get(worker)
        if s is None or s >= self.capacity:
            return
        for name in _COLUMNS[:-1]:  # all but block_size
            getattr(self, name)[s] = 0.0
        self.block_size[s] = 16
        self.heard[s] = np.inf


@dataclass(frozen=True)
class KvRequest(PromptBlocks):
    num_tokens: int
    block_size: int
    runs: list[tuple[int, int]]  # KvIndex.match_slots: (depth, mask of slots)
    below: dict[int, list[tuple[int, int]]]


def pick_kv(req: KvRequest, table: LoadTable, candidates: np.ndarray, config: RouterConfig, rng: random.Random,
            costs_of: Callable[[str], KvCosts]) -> Decision:
    """``pick_worker`` in mode ``kv`` at temperature 0 without fetches or adapters, over the slots set
    in ``candidates`` (a bool array as long as the table): the same costs, the same cheapest worker,
    ties broken by ``rng`` among the tied workers sorted by id, as ``pick_worker`` breaks them."""
    n = table.capacity
    usable = req.reusable_blocks
    depth = np.zeros(n)
    for d, mask in req.runs:
        depth[slot_array(mask)] = d if d < usable else usable
    own = None
    ids = table.slots.ids
    if req.below:
        own = np.zeros(n)
        for slot, held in req.below.items():
            if candidates[slot]:
                run = depth[slot]
                costs = costs_of(ids[slot])
                own[slot] = sum(costs.block_cost(bits) for pos, bits in held if pos < run)
    # the order of pick_worker's sums, so that equal costs are equal here too
    prefill = table.pending_blocks + table.inflight_new
    if own is not None:
        prefill = prefill + own
    prefill = prefill + req.prompt_blocks - depth
    cost = config.prefill_weight * prefill + config.decode_weight * (table.active + table.inflight_prompt)
    cost[~candidates] = np.inf
    best = cost.min()
    if best == np.inf:
        raise LookupError("no candidate workers")
    tied = np.flatnonzero(cost == best)
    chosen = rng.choice(sorted(ids[s] for s in tied))  # even of one: pick_worker's draws, one for one
    s = table.slots.get(chosen)
    hit = int(depth[s])
    credited = hit - (float(own[s]) if own is not None and s in req.below else 0)
    return Decision(chosen, "kv", credited, req.prompt_blocks - hit, float(cost[s]), hit)
