"""Batch work is deferrable: a batch backlog never scales a pool past what interactive traffic
needs plus ``batch_replicas`` (default none at all), and never holds a pool up on its own."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mesh.planner.planner import Planner
from mesh.planner.policy import PlannerConfig, PoolPlanner, PoolWindow
from mesh.protocol import LoadReport

CFG = PlannerConfig(ttft_ms=1000, itl_ms=50, min_prefill=1, max_prefill=8, min_decode=1, max_decode=8,
                    window_s=5, up_cooldown_s=10, down_cooldown_s=20, down_windows=3)


def run(pool: str, interactive, batch, capacity: float, config: PlannerConfig = CFG, kv=None, latency=None):
    """Windows of ``interactive`` plus ``batch`` demand; the pool follows the decisions at once."""
    planner = PoolPlanner(pool, config)
    replicas, trace = 1, []
    for i, (a, b) in enumerate(zip(interactive, batch, strict=True)):
        used, per = kv(a + b) if kv else (0, 0)
        lat = latency(a + b, replicas) if latency else 20.0
        replicas = planner.observe(PoolWindow(i * 5.0, replicas, a + b, capacity, lat, used, per,
                                              deferrable=b)).target
        trace.append(replicas)
    return trace


def slow(demand, replicas):  # the ITL a batch-filled worker shows: far over the 50 ms target
    return 20 + 2.0 * demand / max(replicas, 1)


@pytest.mark.parametrize("pool", ["decode", "prefill"])
def test_a_batch_backlog_alone_never_grows_the_pool(pool):
    backlog = [0] + [5000] * 20  # many times what one replica carries
    trace = run(pool, [0] * 21, backlog, capacity=60, latency=slow,
                kv=(lambda d: (min(d * 10, 950), 1000)) if pool == "decode" else None)
    assert set(trace) == {1}


def test_interactive_load_still_scales_beside_a_batch():
    interactive = [20] * 3 + [160] * 12
    trace = run("decode", interactive, [3000] * 15, capacity=60)
    assert trace[-1] >= 4  # 160 / (60 x 0.75) at least
    assert trace == run("decode", interactive, [0] * 15, capacity=60)  # not a replica more for the batch


def test_batch_replicas_is_the_most_a_batch_adds():
    config = PlannerConfig(**{**CFG.__dict__, "batch_replicas": 2})
    trace = run("decode", [20] * 12, [3000] * 12, capacity=60, config=config)
    assert max(trace) == 1 + 2  # 1 for the interactive 20, and at most 2 for the batch
    assert run("decode", [400] * 12, [3000] * 12, capacity=60, config=config)[-1] == 8  # never past max_decode
    with pytest.raises(ValueError):
        PlannerConfig(batch_replicas=-1)


def test_a_pool_walks_down_while_a_batch_still_runs():
    interactive = [160] * 4 + [10] * 20
    trace = run("decode", interactive, [0] * 4 + [3000] * 20, capacity=60)
    assert trace[3] == 4 and trace[-1] == 1


class _Connector:
    name = "test"

    async def replicas(self, pool: str) -> int:
        return 1

    async def scale(self, pool: str, target: int, victims=()) -> None:
        raise AssertionError(f"scaled {pool} to {target} for a batch")


class _Members:
    def cards(self, model=None, role=None):
        card = SimpleNamespace(worker_id="d1", role="decode", status="ready", kv_blocks=1000)
        return [card] if role in (None, "decode") else []


class _Bus:
    class subjects:
        @staticmethod
        def planner_decisions() -> str:
            return "mesh.planner"

    async def publish(self, subject, msg) -> None:
        pass


def test_the_planner_reads_batch_work_from_the_load_reports():
    """Decode workers full of batch sequences (``deferrable``) and their prefills
    (``deferrable_prefill_tokens``): windows whose demand is all deferrable, and no scaling."""
    planner = Planner(_Bus(), _Members(), _Connector(), CFG, model="m")

    def report(t: float, tokens: int) -> LoadReport:
        return LoadReport("d1", "m", "decode", t, running=200, waiting=50, capacity=256, itl_p90_ms=400.0,
                          kv_blocks_used=990,
                          deferrable=250, counters={"local_prefill_tokens": tokens,
                                                    "deferrable_prefill_tokens": tokens})

    async def windows():
        out = []
        for i in range(6):
            planner.loads["d1"] = report(i * 5.0, 100_000 * i)
            out += await planner.tick(i * 5.0)
        return out

    decisions = asyncio.run(windows())
    assert decisions and not any(d.changes for d in decisions)
    decode = [d for d in planner.decisions if d.pool == "decode"]
    assert decode[-1].demand == 250.0
