"""The planner's policy on recorded load series: each pool follows its own load."""

from __future__ import annotations

import itertools
import random

import pytest

from mesh.planner.policy import PlannerConfig, PoolPlanner, PoolWindow

CFG = PlannerConfig(ttft_ms=1000, itl_ms=50, min_prefill=1, max_prefill=8, min_decode=1, max_decode=8,
                    window_s=5, up_cooldown_s=10, down_cooldown_s=20, down_windows=3)


def run(pool: str, series, capacity, latency_of, start: int = 1, kv=None):
    """Feed windows; the replica count follows the planner's decisions (instantly, like a fast pool)."""
    planner = PoolPlanner(pool, CFG)
    replicas = start
    trace = []
    for i, demand in enumerate(series):
        lat = latency_of(demand, replicas)
        used, per = kv(demand) if kv else (0, 0)
        d = planner.observe(PoolWindow(i * 5.0, replicas, demand, capacity, lat, used, per))
        replicas = d.target
        trace.append(replicas)
    return trace


def prefill_latency(demand, replicas):  # TTFT p90 grows as the pool saturates (capacity 5k tok/s each)
    util = demand / (5000 * max(replicas, 1))
    return 200 + 1500 * max(0.0, util - 0.5)


def decode_latency(demand, replicas):  # ITL p90: 20 ms base, more sequences per worker is slower
    return 20 + 0.5 * demand / max(replicas, 1)


def test_prompt_heavy_phase_grows_prefill_only():
    prompt_heavy = [2000] * 4 + [8000, 14000, 20000] + [20000] * 8
    steady_decode = [40] * len(prompt_heavy)
    pre = run("prefill", prompt_heavy, 5000, prefill_latency)
    dec = run("decode", steady_decode, 60, decode_latency)
    assert pre[0] == 1 and pre[-1] >= 5  # 20k tok/s at 75% of 5k per worker needs 6
    assert max(pre) <= 8
    assert set(dec) == {1}


def test_generation_heavy_phase_grows_decode_only():
    gen_heavy = [20] * 4 + [80, 160, 240] + [240] * 8
    pre = run("prefill", [2000] * len(gen_heavy), 5000, prefill_latency)
    dec = run("decode", gen_heavy, 60, decode_latency)
    assert set(pre) == {1}
    assert dec[-1] >= 5 and dec[0] == 1


def test_kv_capacity_drives_decode_too():
    # few sequences but long contexts: the KV pool, not ITL, is what needs more workers
    dec = run("decode", [10] * 10, 60, decode_latency, kv=lambda d: (3000, 1000))
    assert dec[-1] == 4  # 3000 / (1000 x 0.85) -> 4


def test_steady_noisy_load_does_not_flap():
    rng = random.Random(0)
    series = [10000 * (1 + 0.15 * rng.uniform(-1, 1)) for _ in range(60)]
    pre = run("prefill", series, 5000, prefill_latency, start=3)
    changes = sum(1 for a, b in itertools.pairwise(pre) if a != b)
    assert changes <= 2, pre  # settles once, then holds
    assert len(set(pre[10:])) == 1


def test_falling_load_walks_down_to_the_minimum():
    falling = [20000] * 3 + [10000] * 5 + [1000] * 12 + [0] * 30
    pre = run("prefill", falling, 5000, prefill_latency, start=6)
    assert pre[-1] == CFG.min_prefill
    steps = [a - b for a, b in itertools.pairwise(pre) if a > b]
    assert all(s == 1 for s in steps)  # one replica at a time
    dec = run("decode", [200] * 3 + [0] * 40, 60, decode_latency, start=4)
    assert dec[-1] == CFG.min_decode


def test_latency_over_target_adds_a_replica_even_when_capacity_says_enough():
    planner = PoolPlanner("decode", CFG)
    d = planner.observe(PoolWindow(0.0, 2, demand=10, capacity=60, latency_ms=80))
    assert d.target == 3 and "p90" in d.reason
    # 5 s later the p90 still describes the old size (workers report over the last 6 s): hold
    d = planner.observe(PoolWindow(5.0, 3, demand=10, capacity=60, latency_ms=80))
    assert d.target == 3 and "p90" not in d.reason
    # past the horizon and the cooldown, a p90 still over target adds another
    d = planner.observe(PoolWindow(12.0, 3, demand=10, capacity=60, latency_ms=80))
    assert d.target == 4 and "p90" in d.reason


def test_bounds_are_enforced_and_config_is_validated():
    planner = PoolPlanner("prefill", CFG)
    assert planner.observe(PoolWindow(0.0, 12, 0, 5000, 0)).target == 8
    with pytest.raises(ValueError):
        PlannerConfig(min_decode=0)
    with pytest.raises(ValueError):
        PlannerConfig(min_prefill=3, max_prefill=2)
