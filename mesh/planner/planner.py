"""The planner on the bus: observe each pool for a window, decide, scale, publish why.

Signals come from the workers' load reports only (so it works with any
gateway): per window, the prompt tokens prefilled (by prefill workers and by
decode workers prefilling locally) plus the prompt tokens still queued give
the prefill demand; running plus waiting sequences the decode demand (batch work, below priority 0,
counted apart as deferrable: ``policy.py``); TTFT and
ITL p90 the decode workers measured (TTFT includes any remote prefill).
Per-replica capacity is learned from windows in which a worker was busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from mesh.bus import Bus
from mesh.loads import subscribe_loads
from mesh.planner.connectors import POOLS, Connector
from mesh.planner.policy import PlannerConfig, PoolPlanner, PoolWindow, ScaleDecision
from mesh.procutil import cancel_and_wait
from mesh.protocol import LoadReport, PlannerDecision, WorkerCard
from mesh.registry import Membership

log = logging.getLogger(__name__)

EMA = 0.3  # weight of a new capacity observation
PEAK_DECAY = 0.02  # prefill capacity: a peak-hold that forgets this share per window


@dataclass
class _Rate:
    t: float
    value: int


class Planner:
    def __init__(self, bus: Bus, membership: Membership, connector: Connector, config: PlannerConfig,
                 model: str | None = None):
        self.bus = bus
        self.membership = membership
        self.connector = connector
        self.config = config
        self.model = model  # None: the one model the workers serve
        self.pools = {p: PoolPlanner(p, config) for p in POOLS}
        self.loads: dict[str, LoadReport] = {}
        self._last: dict[tuple[str, str], _Rate] = {}  # (worker, counter) -> last value seen
        self.prefill_capacity = 0.0  # prompt tokens/s one prefill worker sustains
        self.decode_capacity = 0.0  # sequences one decode worker runs at the ITL target
        self.decode_base_ms = 0.0  # ITL p90 of a worker with next to no load (the step's fixed cost)
        self._prefilling_until: dict[str, float] = {}  # decode worker -> until when its ITL p90s show overflow
        self.decisions: list[PlannerDecision] = []
        self._task: asyncio.Task | None = None
        self._subs: list = []

    async def start(self) -> None:
        self._subs = await subscribe_loads(self.bus, self._on_load)
        self._task = asyncio.create_task(self._run(), name="planner")

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait([self._task])
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_load(self, report: LoadReport, raw) -> None:
        # only from members (anyone may claim an id); what a worker that left reported goes at the
        # next window (``tick``), not on every report: a pass over all workers per report was
        # N x N a second at N workers
        if (self.model is None or report.model == self.model) and \
                self.membership.vouches(report.worker_id, report.role, report.model):
            self.loads[report.worker_id] = report

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.window_s)
            try:
                await self.tick(time.monotonic())
            except Exception:
                log.exception("planner window failed")

    # -- one window ---------------------------------------------------------------------
    def _cards(self, role: str) -> list[WorkerCard]:
        return [c for c in self.membership.cards(self.model, role) if c.status == "ready"]

    def _rate(self, report: LoadReport, key: str, now: float) -> float:
        """Per-second rate of a worker's counter since the previous window."""
        value = report.counters.get(key, 0)
        prev = self._last.get((report.worker_id, key))
        self._last[(report.worker_id, key)] = _Rate(now, value)
        if prev is None or now <= prev.t or value < prev.value:
            return 0.0
        return (value - prev.value) / (now - prev.t)

    async def tick(self, now: float) -> list[ScaleDecision]:
        live = {c.worker_id for c in self.membership.cards(self.model)}
        for wid in [w for w in self.loads if w not in live]:
            self.loads.pop(wid)
        prefill = [r for r in self.loads.values() if r.role == "prefill"]
        decode = [r for r in self.loads.values() if r.role == "decode"]
        windows = {"decode": await self._decode_window(now, decode)}
        if self.config.max_prefill > 0:  # no prefill pool at all (aggregated serving): nothing to size
            windows["prefill"] = await self._prefill_window(now, prefill, decode)
        out = []
        for pool, w in windows.items():
            d = self.pools[pool].observe(w)
            out.append(d)
            if d.changes:
                victims = self._least_loaded(prefill if pool == "prefill" else decode)
                log.info("planner: %s %d -> %d (%s)", pool, d.current, d.target, d.reason)
                await self.connector.scale(pool, d.target, victims)
            msg = PlannerDecision(pool, self.model or "", d.current, d.target, d.reason, time.time(),
                                  w.demand, w.capacity, w.latency_ms, self.connector.name)
            self.decisions.append(msg)
            with contextlib.suppress(Exception):
                await self.bus.publish(self.bus.subjects.planner_decisions(), msg)
        return out

    async def _prefill_window(self, now, prefill: list[LoadReport], decode: list[LoadReport]) -> PoolWindow:
        rates = {r.worker_id: self._rate(r, "prefill_tokens", now) for r in prefill}
        local = sum(self._rate(r, "local_prefill_tokens", now) for r in decode)
        backlog = sum(r.pending_prefill_tokens for r in decode + prefill)
        demand = sum(rates.values()) + local + backlog / self.config.window_s
        deferrable = sum(self._rate(r, "deferrable_prefill_tokens", now) for r in decode + prefill)
        for r in prefill:  # a busy worker shows what one worker sustains
            if r.capacity and r.active_jobs >= max(1, r.capacity // 2) and rates[r.worker_id] > 0:
                # A peak-hold, not an average: a worker busy for part of the window shows less than it
                # can do, and averaging those shrinks the capacity, and grows the pool, with every replica.
                self.prefill_capacity = max(rates[r.worker_id], (1 - PEAK_DECAY) * self.prefill_capacity)
        latency = max((r.ttft_p90_ms for r in decode), default=0.0)
        return PoolWindow(now, await self.connector.replicas("prefill"), demand, self.prefill_capacity, latency,
                          deferrable=min(deferrable, demand))

    async def _decode_window(self, now, decode: list[LoadReport]) -> PoolWindow:
        demand = float(sum(r.running + r.waiting + r.waiting_for_kv for r in decode))
        deferrable = float(sum(r.deferrable for r in decode))  # batch work: sized apart (policy.py)
        target = self.config.itl_ms
        clean = []  # workers whose ITL p90 is about decoding, not about long prompts they prefilled
        for r in decode:
            if self._rate(r, "overflow_prefill_tokens", now) > 0:  # the prefill pool had no room
                self._prefilling_until[r.worker_id] = now + self.config.latency_horizon_s
            if now >= self._prefilling_until.get(r.worker_id, 0.0):
                clean.append(r)
        for r in clean:
            if r.running and r.itl_p90_ms > 0:
                base = self.decode_base_ms
                self.decode_base_ms = r.itl_p90_ms if base <= 0 else min(base, r.itl_p90_ms)
        base = min(self.decode_base_ms, 0.9 * target)
        for r in clean:
            # only loaded windows say much: the batch must fill a fair share of the room above the base
            if r.running and r.itl_p90_ms >= base + 0.25 * (target - base):
                # ITL is a fixed step cost plus a part that grows with the load: scale that part
                at_target = r.running * (target - base) / (r.itl_p90_ms - base)
                if r.capacity:
                    at_target = min(at_target, r.capacity)
                self.decode_capacity = _ema(self.decode_capacity, at_target)
        cards = self._cards("decode")
        per = max((c.kv_blocks for c in cards), default=0)
        latency = max((r.itl_p90_ms for r in clean), default=0.0)
        used = sum(r.kv_blocks_used for r in decode)
        return PoolWindow(now, await self.connector.replicas("decode"), demand, self.decode_capacity, latency,
                          used, per, self.decode_base_ms, min(deferrable, demand))

    @staticmethod
    def _least_loaded(reports: list[LoadReport]) -> list[str]:
        return [r.worker_id for r in sorted(reports, key=lambda r: (r.running + r.waiting + r.active_jobs))]


def _ema(old: float, new: float) -> float:
    return new if old <= 0 else (1 - EMA) * old + EMA * new
