"""Faults of whole hosts (issue 31), on three simulated hosts (``tests.helpers.hostbed``): the
gateway on host 1, decode workers of the tiny model on hosts 2 and 3, every process with
``--js-replicas 3`` (the registry bucket lives on all three servers).

- Host 3 killed whole (its nats-server included) while streams run on it: every stream ends
  with the engine's tokens (the gateway migrates them to host 2).
- Host 2 cut off under load for 8.5 s (past the gateway's 8 s timeouts), or until its worker has
  left the routing if later (a JetStream leader election on the cut host delays the registry),
  then healed: no request hangs, errors are clear 5xx, host 2's worker leaves the routing within
  its lease, comes back and serves again.
- After a partition of host 2 (shorter than the lease, and until its worker left the routing), during which a client on
  host 2 changed its worker's cache, the router's view of that worker equals the worker's own
  snapshot. Nothing needed fixing for it: KV events published during a short cut stay in TCP's
  retransmission and arrive after the heal (in order; the sequence numbers show no gap), and a
  cut longer than the lease removes the worker from the routing (its index dropped), so its
  return starts a resync from a snapshot (``KvRouter._on_member``).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import httpx
import pytest

from bench.mesh.chaos import Outcome
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from mesh.protocol import KvSnapshot, KvSnapshotRequest
from mesh.router.policy import RouterConfig
from mesh.router.router import KvRouter
from tests.helpers.cluster import completion_events, router_choices
from tests.helpers.multihost import (
    BUS_FLAGS,
    checked_request,
    clear_errors_only,
    gateway_counter,
    open_watcher,
    wait_gateway,
)
from tests.helpers.references import prompts_of

GW_FLAGS = (*BUS_FLAGS, "--first-token-timeout", "8", "--idle-timeout", "8")


@pytest.fixture(scope="module")
def engine(tiny_model) -> Engine:
    return Engine(EngineConfig(tiny_model, num_kv_blocks=1024))


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    seqs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [s.output_token_ids for s in seqs]


async def start_two_decode_hosts(bed, tiny_model) -> tuple[str, object]:
    """Gateway on host 1, decode workers ``dec-2`` and ``dec-3`` on hosts 2 and 3: (url, watcher)."""
    flags = [*BUS_FLAGS, "--model", str(tiny_model), "--device-kv-blocks", "1024"]
    for i in (2, 3):
        bed.worker(i, "decode", *flags, "--worker-id", f"dec-{i}")
    url = bed.gateway(1, "--model", str(tiny_model), *GW_FLAGS)
    w = await open_watcher(bed.hosts[1].nats_url)
    await w.wait_for(lambda: w.membership.get("dec-2") and w.membership.get("dec-3"), 120, "both decode workers")
    await wait_gateway(url)
    return url, w


async def stream_ids(client: httpx.AsyncClient, url: str, prompt: list[int], n: int, got: list[int]) -> None:
    """A greedy streamed completion of ``n`` tokens; its token ids go into ``got`` as they come."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for event in completion_events(r):  # an error event fails it
            got += event["choices"][0].get("token_ids") or []


async def test_a_decode_host_killed_mid_stream_loses_no_token(hostbed, tiny_model, engine):
    prompts = prompts_of([30, 41, 52, 63, 35, 47], 4096, 11, low=3)
    # The kill follows every stream's first tokens (the router's decisions say which run on host 3),
    # so the streams need only outlast the test's next poll, not a load report.
    n = 240
    expected = greedy(engine, prompts, n)
    url, w = await start_two_decode_hosts(hostbed, tiny_model)
    try:
        chosen = await router_choices(w)
        got: list[list[int]] = [[] for _ in prompts]
        async with httpx.AsyncClient(timeout=120) as client:
            runs = [asyncio.create_task(stream_ids(client, url, p, n, g)) for p, g in zip(prompts, got, strict=True)]
            await w.wait_for(lambda: len(chosen) >= len(prompts) and all(got), 60, "every stream's first tokens")
            assert "dec-3" in chosen, chosen  # streams run on host 3
            assert not any(r.done() for r in runs), "a stream ended before the kill: it would not test a migration"
            hostbed.kill_host(3)
            await asyncio.wait_for(asyncio.gather(*runs), 120)  # none hangs, none fails
        assert got == expected  # no token lost, none repeated
        assert (await gateway_counter(url, "pdmesh_gateway_migrations")) >= 1  # streams moved off host 3
    finally:
        await w.close()


async def _load(url: str, pool: list[tuple[list[int], list[int]]], out: Outcome, stop: asyncio.Event,
                clients: int = 3, timeout: float = 30.0) -> None:
    async def user(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(timeout=timeout) as client:
            while not stop.is_set():
                prompt, expected = rng.choice(pool)
                await checked_request(client, url, prompt, expected, out, timeout)

    await asyncio.gather(*(user(i) for i in range(clients)))


async def test_a_partitioned_host_leaves_routing_and_comes_back(hostbed, tiny_model, engine):
    prompts = prompts_of([20 + 3 * i for i in range(24)], 4096, 12, low=3)
    pool = list(zip(prompts, greedy(engine, prompts, 12), strict=True))
    fresh = prompts_of([33] * 12, 4096, 13, low=3)  # never seen before: no cache pulls them to host 3
    url, w = await start_two_decode_hosts(hostbed, tiny_model)
    try:
        out, stop = Outcome(), asyncio.Event()
        load = asyncio.create_task(_load(url, pool, out, stop))
        await asyncio.sleep(1.5)  # requests in flight on both hosts
        cut = time.monotonic()
        with hostbed.partition(2):  # heals on leaving the block, the wait failed or not
            left = await w.wait_for(lambda: w.membership.get("dec-2") is None, 30, "host 2's worker to leave")
            # past the gateway's 8 s timeouts: the streams cut off time out and move (a 10 s cut
            # under chaos load: python -m bench multihost)
            await asyncio.sleep(max(0.0, 8.5 - (time.monotonic() - cut)))
        back = await w.wait_for(lambda: w.membership.get("dec-2"), 60, "host 2's worker to come back")
        await asyncio.sleep(1.5)  # requests while host 2 rejoins
        stop.set()
        await load
        assert left and back
        assert out.hung == 0 and out.incorrect == 0, (out.hung, out.incorrect_samples)
        assert clear_errors_only(out), out.error_kinds
        assert out.correct >= 10
        # host 2 serves again: fresh prompts, until its worker has finished some
        before = (await w.fresh_load("dec-2", timeout=20)).counters.get("finished", 0)
        fresh_out = Outcome()
        async with httpx.AsyncClient(timeout=30) as client:
            expected = greedy(engine, fresh, 8)
            await asyncio.gather(*(checked_request(client, url, p, e, fresh_out, 30.0)
                                   for p, e in zip(fresh, expected, strict=True)))
        assert fresh_out.correct == len(fresh), (fresh_out.error_kinds, fresh_out.incorrect_samples)
        after = (await w.fresh_load("dec-2", timeout=20)).counters.get("finished", 0)
        assert after > before
    finally:
        await w.close()


async def worker_blocks(bus, worker: str) -> dict[str, set[int]]:
    """A worker's cached blocks by tier, from its own snapshot (one page: a small pool)."""
    snap = await bus.request(bus.subjects.kv_snapshot("tiny", worker), KvSnapshotRequest(0), KvSnapshot, 10)
    assert snap.pages == 1
    return {tier: set(hashes) for tier, hashes in snap.blocks.items()}


def view_of(idx, worker: str, truth: dict[str, set[int]]) -> dict[str, set[int]]:
    """What the router's index says of ``worker``: the tiers of the blocks in ``truth``, and nothing more."""
    view: dict[str, set[int]] = {}
    for hashes in truth.values():
        for h in hashes:
            for tier in idx.tiers_of(worker, h):
                view.setdefault(tier, set()).add(h)
    extra = idx.num_blocks(worker) - len(set().union(*truth.values()) if truth else set())
    return view if extra == 0 else {**view, "unknown to the worker": {extra}}


class HostClient:
    """``tests.helpers.hostclient`` on host ``i``: requests to a worker over that host's own server."""

    def __init__(self, bed, i: int, worker: str):
        self.proc = bed.spawn(i, [sys.executable, "-m", "tests.helpers.hostclient", bed.hosts[i].nats_url, worker],
                              remember=False, pipes=True)

    async def line(self) -> str:
        return (await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 90)).strip()

    async def ask(self, prompt: list[int]) -> list[int]:
        self.proc.stdin.write(json.dumps(prompt) + "\n")
        self.proc.stdin.flush()
        answer = await self.line()
        assert not answer.startswith("error"), answer
        return json.loads(answer)


async def test_the_routers_view_of_a_partitioned_host_is_rebuilt_after_it_heals(hostbed, tiny_model):
    """While host 2 is cut off, a client on host 2 fills its worker's small cache: the blocks the
    router knew are evicted, others stored, and none of those KV events reach host 1 then. After
    the heal the router (in the test process, on host 1's server, as the gateway's is) has host
    2's blocks as they are: the new ones, not the evicted ones. Two cuts on one bed: the first
    within the worker's lease (3 s), the second beyond it (until the worker has left the routing),
    each evicting what the router knew before it.

    A mock worker on host 3 keeps refreshing its card: were host 2's the only card, its silence
    would look like a stalled registry to host 1's membership view, which then expires no card
    (``Membership._check_stall``), and host 2's worker would never leave the routing."""
    bs, blocks = 16, 8
    flags = [*BUS_FLAGS, "--model", str(tiny_model), "--device-kv-blocks", "20"]
    hostbed.worker(2, "decode", *flags, "--worker-id", "dec-2")
    hostbed.worker(3, "mock", *BUS_FLAGS, "--mock-speedup", "20", "--worker-id", "keep-3")
    w = await open_watcher(hostbed.hosts[1].nats_url)
    router = KvRouter(w.bus, w.membership, RouterConfig())
    await router.start()
    try:
        await w.wait_for(lambda: w.membership.get("dec-2") and w.membership.get("keep-3"), 120, "the workers")
        idx = router.index("tiny")
        old, *new = prompts_of([blocks * bs + 1] * 5, 4096, 21, low=3)
        old_hashes = block_hashes(old[: blocks * bs], bs, hash_seed(DEFAULT_HASH_KEY, "tiny"))
        client = HostClient(hostbed, 2, "dec-2")
        assert await client.line() == "connected"
        await client.ask(old)
        await w.wait_for(lambda: all(idx.tiers_of("dec-2", h) for h in old_hashes), 20, "the first prompt's blocks")
        for seconds, cut in ((3.0, new[:2]), (None, new[2:])):  # within the lease, then beyond it
            new_hashes = block_hashes(cut[-1][: blocks * bs], bs, hash_seed(DEFAULT_HASH_KEY, "tiny"))
            with hostbed.partition(2):
                for p in cut:  # 2 x 8 blocks into a pool of 20: the blocks the router knew are evicted
                    await client.ask(p)
                if seconds is None:
                    await w.wait_for(lambda: w.membership.get("dec-2") is None, 40, "host 2's worker to leave")
                else:
                    await asyncio.sleep(seconds)
                assert not any(idx.tiers_of("dec-2", h) for h in new_hashes), seconds  # nothing reached host 1
            await w.wait_for(lambda: w.membership.get("dec-2"), 60, "host 2's worker back in the routing")
            truth = await worker_blocks(w.bus, "dec-2")
            assert set(new_hashes) <= truth["device"], seconds  # what host 2 stored while cut off
            await w.wait_for(lambda truth=truth: view_of(idx, "dec-2", truth) == truth, 30,
                             "the router's view of host 2 to equal its worker's cache")
    finally:
        await router.stop()
        await w.close()


async def test_losing_the_registrys_leader_host_drops_no_live_worker(hostbed):
    """The host of the registry bucket's stream leader is killed: while the survivors elect another
    (no card can be refreshed meanwhile), a membership view on a surviving host keeps every worker
    of the surviving hosts (before the fix every card expired and the gateway answered 503 "no live
    worker" to everything for seconds), and drops the dead host's worker."""
    flags = [*BUS_FLAGS, "--mock-speedup", "20"]
    for i in (1, 2, 3):
        hostbed.worker(i, "mock", *flags, "--worker-id", f"reg-{i}")
    w = await open_watcher(hostbed.hosts[1].nats_url)
    await w.wait_workers("decode", 3, model="mock", timeout=120)
    info = await w.bus.js.stream_info("KV_mesh_workers")
    leader = int(info.cluster.leader.rsplit("-h", 1)[1])
    await w.close()
    survivors = [i for i in (1, 2, 3) if i != leader]
    w = await open_watcher(hostbed.hosts[survivors[0]].nats_url)
    try:
        await w.wait_workers("decode", 3, model="mock", timeout=30)
        hostbed.kill_host(leader)
        killed = time.time()

        def over() -> bool:
            """The election is over (every survivor's card was refreshed after the kill: before the
            fix they had expired by then) and the dead host's worker has left."""
            refreshed = all((c := w.membership.get(f"reg-{i}")) and c.updated > killed for i in survivors)
            return refreshed and w.membership.get(f"reg-{leader}") is None

        missing: set[str] = set()
        end = time.monotonic() + 40
        while time.monotonic() < end and not over():
            missing |= {f"reg-{i}" for i in survivors if w.membership.get(f"reg-{i}") is None}
            await asyncio.sleep(0.1)
        assert not missing, f"live workers dropped: {missing}"
        assert over(), "no new registry leader, or the dead host's worker did not leave, within 40 s"
    finally:
        await w.close()
