"""How many prefill and how many decode workers: a pure function of observed windows.

Each pool is sized on its own, once per window (default 5 s):

    prefill: demand = prompt tokens/s to prefill; capacity = tokens/s one worker sustains
             needed = ceil(forecast demand / (capacity x target utilization));
             TTFT p90 over target -> at least one more than now
    decode:  demand = concurrent sequences; capacity = sequences one worker runs at the ITL
             target (learned: running x ITL target / ITL observed); also KV blocks in use vs
             what one worker holds; ITL p90 over target -> at least one more

The forecast is the larger of the last window and a linear trend over the last
few (load that is climbing is met before it arrives). Batch work (requests below priority 0,
``deferrable`` in a window) is left out of all of it, demand, KV and latency: it runs on what
interactive traffic leaves free, and may add at most ``batch_replicas`` replicas (default 0) above
what the interactive load needs, never past the pool's maximum. Scaling up takes effect
after ``up_cooldown`` since the last change; scaling down only when one replica
fewer would still run below ``down_utilization`` (a band under the sizing
target, so a load near a boundary does not flap), for ``down_windows`` windows
in a row, with latency comfortably under target, after ``down_cooldown``, one
replica at a time. So a steady load holds
steady, a rising one is met quickly, and a falling one walks down to the
minimum instead of sticking.
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlannerConfig:
    ttft_ms: float = 2000.0
    itl_ms: float = 100.0
    min_prefill: int = 0
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    window_s: float = 5.0
    target_utilization: float = 0.75  # size pools so each runs at most this busy...
    down_utilization: float = 0.55  # ...and shrink only if one fewer would run at most this busy
    up_cooldown_s: float | None = None  # default: 2 windows
    down_cooldown_s: float | None = None  # default: 6 windows
    down_windows: int = 3
    down_latency_fraction: float = 0.6  # scale down only while latency is below this share of target
    trend_windows: int = 4
    kv_headroom: float = 0.85  # plan decode pools to fill at most this share of their KV blocks
    latency_horizon_s: float = 6.0  # workers report p90s over this long: after a change, older sizes show
    batch_replicas: int = 0  # replicas batch (deferrable) demand may add above the interactive need

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError("need 0 <= min_prefill <= max_prefill")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError("need 1 <= min_decode <= max_decode")
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError("latency targets must be positive")
        if self.window_s <= 0:
            raise ValueError("the planner window must be positive")
        if self.batch_replicas < 0:
            raise ValueError("--planner-batch-replicas must be >= 0")
        if self.up_cooldown_s is None:
            object.__setattr__(self, "up_cooldown_s", 2 * self.window_s)
        if self.down_cooldown_s is None:
            object.__setattr__(self, "down_cooldown_s", 3 * self.window_s)

    @staticmethod
    def add_args(p: argparse.ArgumentParser) -> None:
        """The targets and bounds a command line sets (``mesh planner``, ``mesh up``)."""
        p.add_argument("--ttft-ms", type=float, default=2000.0, help="planner: TTFT p90 target")
        p.add_argument("--itl-ms", type=float, default=100.0, help="planner: ITL p90 target")
        p.add_argument("--min-prefill", type=int, default=None,
                       help="default: 1 (mesh up: 0 when started with --prefill 0, i.e. aggregated)")
        p.add_argument("--max-prefill", type=int, default=4)
        p.add_argument("--min-decode", type=int, default=1)
        p.add_argument("--max-decode", type=int, default=4)
        p.add_argument("--planner-window", type=float, default=5.0, help="planner: seconds per decision")
        p.add_argument("--planner-batch-replicas", type=int, default=0,
                       help="planner: replicas batch work (priority < 0) may add above the interactive need (default 0)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlannerConfig:
        return cls(
            ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
            min_prefill=1 if args.min_prefill is None else args.min_prefill, max_prefill=args.max_prefill,
            min_decode=args.min_decode, max_decode=args.max_decode, window_s=args.planner_window,
            batch_replicas=args.planner_batch_replicas,
        )


@dataclass(frozen=True)
class PoolWindow:
    """One window of one pool, as the planner observed it."""

    t: float  # end of the window (seconds, any clock)
    replicas: int  # ready workers now
    demand: float  # prefill: prompt tokens/s to prefill; decode: concurrent sequences
    capacity: float  # per replica, learned (0: unknown yet)
    latency_ms: float  # prefill pool: TTFT p90; decode pool: ITL p90 (0: no traffic)
    kv_blocks_used: int = 0  # decode: blocks in use across the pool
    kv_blocks_per_replica: int = 0
    base_latency_ms: float = 0.0  # the latency with next to no load (decode: one sequence's step)
    deferrable: float = 0.0  # of ``demand``, batch work (priority < 0): sized for only up to batch_replicas

    @property
    def interactive(self) -> float:
        return max(0.0, self.demand - self.deferrable)

    @property
    def interactive_kv(self) -> int:
        """KV blocks in use less the batch's share (by sequences: what a preemption would free)."""
        if self.demand <= 0 or self.deferrable <= 0:
            return self.kv_blocks_used
        return round(self.kv_blocks_used * self.interactive / self.demand)


@dataclass(frozen=True)
class ScaleDecision:
    pool: str
    current: int
    target: int
    reason: str

    @property
    def changes(self) -> bool:
        return self.target != self.current


@dataclass
class PoolPlanner:
    pool: str  # prefill | decode
    config: PlannerConfig
    history: deque[PoolWindow] = field(default_factory=lambda: deque(maxlen=16))
    last_change_t: float = -math.inf
    below_count: int = 0

    @property
    def bounds(self) -> tuple[int, int]:
        c = self.config
        return (c.min_prefill, c.max_prefill) if self.pool == "prefill" else (c.min_decode, c.max_decode)

    @property
    def target_ms(self) -> float:
        return self.config.ttft_ms if self.pool == "prefill" else self.config.itl_ms

    def observe(self, w: PoolWindow) -> ScaleDecision:
        self.history.append(w)
        lo, hi = self.bounds
        current = w.replicas
        needed, why = self._needed(w)
        needed = min(max(needed, lo), hi)
        if current < lo or current > hi:
            return self._change(w, current, min(max(current, lo), hi), f"outside [{lo}, {hi}]")
        if needed > current:
            self.below_count = 0
            if w.t - self.last_change_t < self.config.up_cooldown_s:
                return ScaleDecision(self.pool, current, current, f"hold (cooldown): {why}")
            return self._change(w, current, needed, why)
        if needed < current and self._fits(current - 1, w):
            self.below_count += 1
            # calm: the load-dependent part of the latency is well under its room (the base is the floor)
            base = min(w.base_latency_ms, self.target_ms)
            calm = w.latency_ms <= base + self.config.down_latency_fraction * (self.target_ms - base)
            if (
                self.below_count >= self.config.down_windows
                and calm
                and w.t - self.last_change_t >= self.config.down_cooldown_s
            ):
                return self._change(w, current, current - 1, f"{why}; stable for {self.below_count} windows")
            return ScaleDecision(self.pool, current, current, f"hold: {why}")
        self.below_count = 0
        return ScaleDecision(self.pool, current, current, f"steady: {why}")

    def _fits(self, replicas: int, w: PoolWindow) -> bool:
        """Would ``replicas`` carry the load at the lower (hysteresis) utilization?"""
        kv_room = replicas * w.kv_blocks_per_replica * self.config.kv_headroom
        if self.pool == "decode" and w.kv_blocks_per_replica and w.interactive_kv > kv_room:
            return False
        demand = self._forecast()
        if demand <= 0:
            return True
        if w.capacity <= 0:
            return False
        return demand <= replicas * w.capacity * self.config.down_utilization

    def _change(self, w: PoolWindow, current: int, target: int, why: str) -> ScaleDecision:
        self.last_change_t = w.t
        self.below_count = 0
        return ScaleDecision(self.pool, current, target, why)

    def _forecast(self) -> float:
        """The interactive demand to plan for (batch work left out)."""
        recent = list(self.history)[-self.config.trend_windows :]
        last = recent[-1].interactive
        if len(recent) < 2:
            return last
        dt = recent[-1].t - recent[0].t
        slope = (recent[-1].interactive - recent[0].interactive) / dt if dt > 0 else 0.0
        return max(last, last + slope * self.config.window_s)

    def _needed(self, w: PoolWindow) -> tuple[int, str]:
        demand = self._forecast()
        capacity = w.capacity * self.config.target_utilization
        by_load = math.ceil(demand / capacity) if capacity > 0 and demand > 0 else 0
        if capacity <= 0:
            by_load = w.replicas if demand > 0 else 0  # no capacity learned yet: keep what serves
        why = f"demand {demand:.1f} vs {w.capacity:.1f}/replica -> {by_load}"
        needed = by_load
        if self.pool == "decode" and w.kv_blocks_per_replica:
            by_kv = math.ceil(w.interactive_kv / (w.kv_blocks_per_replica * self.config.kv_headroom))
            if by_kv > needed:
                needed, why = by_kv, f"KV {w.interactive_kv} blocks -> {by_kv}"
        fresh = w.t - self.last_change_t >= self.config.latency_horizon_s  # p90s that describe this size
        # batch work alone (nothing interactive) is allowed to be slow: its latency adds nobody
        if w.latency_ms > self.target_ms and needed <= w.replicas and fresh and w.interactive > 0:
            needed = w.replicas + 1
            why = f"p90 {w.latency_ms:.0f} ms > target {self.target_ms:.0f} ms"
        if w.deferrable > 0 and self.config.batch_replicas and capacity > 0:
            extra = min(math.ceil((demand + w.deferrable) / capacity) - needed, self.config.batch_replicas)
            if extra > 0:
                needed += extra
                why += f"; batch {w.deferrable:.0f} -> +{extra}"
        return needed, why
