"""The planner with the local connector: `mesh up --mock`, a load ramp up then down.

Prompt-heavy traffic must grow the prefill pool, generation-heavy traffic the
decode pool, and when the load goes away both walk back to their minimum, with
every request completing through the scale-downs (drained workers finish what
they hold; a request that reaches a draining worker is retried elsewhere).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from mesh.protocol import PlannerDecision
from tests.helpers.cluster import Watcher, start_up

FLAGS = ["--mock", "--mock-speedup", "1", "--prefill", "1", "--decode", "1",
         "--min-prefill", "1", "--max-prefill", "3", "--min-decode", "1", "--max-decode", "3",
         "--planner-window", "0.5", "--ttft-ms", "400", "--itl-ms", "10", "--disagg-threshold", "256"]


async def drive(client: httpx.AsyncClient, url: str, concurrency: int, seconds: float, prompt_len: int,
                max_tokens: int, results: list) -> None:
    end = time.monotonic() + seconds
    rng = random.Random(concurrency * 1000 + prompt_len)

    async def user():
        while time.monotonic() < end:
            prompt = [rng.randrange(1, 32000) for _ in range(prompt_len)]
            r = await client.post(f"{url}/v1/completions", json={
                "model": "mock", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
            ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
            results.append((r.status_code, ok, r.text[:200] if not ok else ""))

    await asyncio.gather(*(user() for _ in range(concurrency)))


async def test_pools_follow_a_ramp_and_nothing_is_lost():
    proc, url = start_up(*FLAGS)
    try:
        nats_url = proc.up_line.split("NATS ", 1)[1].split(")", 1)[0]
        w = await Watcher.open(nats_url)
        decisions: list[PlannerDecision] = []

        async def on_decision(d: PlannerDecision, raw) -> None:
            decisions.append(d)

        await w.bus.subscribe(w.bus.subjects.planner_decisions(), on_decision, PlannerDecision)
        peak = {"prefill": 1, "decode": 1}

        async def watch():
            while True:
                for pool, role in (("prefill", "prefill"), ("decode", "decode")):
                    n = len([c for c in w.membership.cards(role=role) if c.status == "ready"])
                    peak[pool] = max(peak[pool], n)
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch())
        results: list = []
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            # prompt-heavy: long prompts, short answers -> the prefill pool must grow (its first
            # decision comes ~2 s in; new workers count toward the peak whenever they are ready)
            await drive(client, url, 24, 7, 1024, 2, results)
            # generation-heavy: short prompts, long answers, many at once -> the decode pool must grow
            # (its decision came 6.7-7.5 s in: the planner ignores a decode worker's ITL for 6 s after
            # it prefilled long prompts the prefill pool had no room for); the prefill pool shrinks
            # meanwhile, with requests in flight
            await drive(client, url, 96, 12, 16, 48, results)
            # a trickle (the decode pool shrinks once the ITL p90s, over 6 s, are calm: after it ends)
            await drive(client, url, 2, 4, 16, 8, results)
        # idle: both pools walk back to their minimum
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sizes = {role: len([c for c in w.membership.cards(role=role) if c.status == "ready"])
                     for role in ("prefill", "decode")}
            if sizes == {"prefill": 1, "decode": 1}:
                break
            await asyncio.sleep(0.5)
        watcher.cancel()
        errors = [r for r in results if not r[1]]
        assert not errors, errors[:5]
        assert len(results) > 100
        grew = {d.pool for d in decisions if d.target > d.current}
        shrank = {d.pool for d in decisions if d.target < d.current}
        changes = [(d.pool, d.current, d.target, d.reason) for d in decisions if d.target != d.current]
        assert grew == {"prefill", "decode"}, changes
        assert peak["prefill"] >= 2 and peak["decode"] >= 2, peak
        assert shrank == {"prefill", "decode"}
        assert sizes == {"prefill": 1, "decode": 1}, sizes
        await w.close()
    finally:
        proc.send_signal(2)
        proc.wait(90)
