"""The mocker: cheap enough that 32 of them run on two cores, speaking the real protocol."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from mesh.client import generate
from mesh.protocol import GenerateRequest, SamplingOptions
from tests.helpers.cluster import Watcher

N = 32


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def test_32_mocker_workers_register_and_serve(cluster):
    procs = [cluster.worker("mock", "--ns", "mock32", "--worker-id", f"mock-{i:02d}", "--mock-speedup", "100",
                            "--device-kv-blocks", "512") for i in range(N)]
    w = await Watcher.open(cluster.nats_url, ns="mock32")
    try:
        cards = await w.wait_workers("decode", N, timeout=120)
        assert {c.engine for c in cards} == {"mock"}
        prompt = list(range(100, 180))

        async def ask(worker_id):
            req = GenerateRequest(uuid.uuid4().hex, "mock", prompt, SamplingOptions(max_tokens=8))
            return [t async for chunk in generate(w.bus, worker_id, req) for t in chunk.token_ids]

        outputs = await asyncio.gather(*(ask(c.worker_id) for c in cards))
        # deterministic tokens: every worker gives the same answer to the same prompt
        assert all(o == outputs[0] for o in outputs) and len(outputs[0]) == 8
        for p in procs:
            maps = Path(f"/proc/{p.pid}/maps").read_text()
            assert "libtorch" not in maps  # a mocker never loads torch
            assert rss_kib(p.pid) < 120_000
    finally:
        await w.close()
        for p in procs:
            p.terminate()


# -- peer fetch between mock workers (issue 20, phase A: simulated transfers, real messages) ----------

FETCH_NS = "fetch"


async def ask(bus, worker_id, tokens, request_id, router=None, max_tokens=4):
    """Serve a request on ``worker_id``: (its tokens, its last chunk); tells the router when it ends."""
    req = GenerateRequest(request_id, "mock", tokens, SamplingOptions(max_tokens=max_tokens, temperature=0.0))
    chunks = [c async for c in generate(bus, worker_id, req)]
    if router is not None:
        router.finished(worker_id, request_id)
    return [t for c in chunks for t in c.token_ids], chunks[-1]


async def test_a_prefix_in_one_workers_host_tier_is_fetched_by_another(cluster):
    import random

    from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
    from mesh.router.policy import RouterConfig
    from mesh.router.router import KvRouter

    flags = ["--ns", FETCH_NS, "--mock-speedup", "10", "--device-kv-blocks", "128", "--host-kv-blocks", "1024",
             "--peer-fetch"]
    for wid in ("fetch-a", "fetch-b"):
        cluster.worker("mock", *flags, "--worker-id", wid)
    w = await Watcher.open(cluster.nats_url, ns=FETCH_NS)
    router = KvRouter(w.bus, w.membership, RouterConfig(peer_fetch=True))
    await router.start()
    try:
        await w.wait_workers("decode", 2)
        rng = random.Random(3)
        prefix = [rng.randrange(1, 32000) for _ in range(640)]  # 40 blocks
        hashes = block_hashes(prefix, 16, hash_seed(DEFAULT_HASH_KEY, "mock"))
        cold, _ = await ask(w.bus, "fetch-a", prefix + [7], "cold")
        # other prompts push the prefix out of a's 128-block device pool into its host tier
        for i in range(4):
            await ask(w.bus, "fetch-a", [rng.randrange(1, 32000) for _ in range(640)], f"other-{i}")
        idx = router.index("mock")
        await w.wait_for(lambda: all(idx.tiers_of("fetch-a", h) == {"host"} for h in hashes), 10,
                         "the prefix to sit only in a's host tier")
        before = (await w.fresh_load("fetch-a")).counters

        # a cannot take the request (say it is overloaded): the router sends it to b, which fetches
        d = router.route("mock", prefix + [7], "moved", exclude={"fetch-a"})
        assert (d.worker_id, d.fetch_source, d.fetch_blocks, d.hit_blocks) == ("fetch-b", "fetch-a", 40, 0)
        tokens, last = await ask(w.bus, "fetch-b", prefix + [7], "moved", router)
        assert tokens == cold  # the same greedy tokens as the cold run
        assert last.usage.cached_tokens == 640  # all 40 blocks reused, none computed

        b = (await w.fresh_load("fetch-b")).counters
        a = (await w.fresh_load("fetch-a")).counters
        assert b["hit_blocks_peer"] == 40 and b["peer_fetch_ok"] == 1 and b["peer_fetch_blocks"] == 40
        assert b["hit_blocks_device"] == 0 and b["hit_blocks_host"] == 0
        assert a["peer_serve_blocks"] - before.get("peer_serve_blocks", 0) == 40
        assert a["fetch_pinned_now"] == 0  # the pins were released
        # b now holds the prefix itself (its KV events say so): the next request needs no fetch
        await w.wait_for(lambda: all("device" in idx.tiers_of("fetch-b", h) for h in hashes), 10, "b's events")
        d = router.route("mock", prefix + [8], "again", exclude={"fetch-a"})
        assert (d.worker_id, d.fetch_source, d.hit_blocks) == ("fetch-b", "", 40)
    finally:
        await router.stop()
        await w.close()


async def test_a_holder_killed_mid_fetch_costs_a_prefill_not_the_request(cluster):
    import os
    import random
    import signal

    from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
    from mesh.router.policy import RouterConfig
    from mesh.router.router import KvRouter

    ns = "fetchkill"
    base = ["--ns", ns, "--device-kv-blocks", "256", "--peer-fetch"]
    # the holder's NIC is slow (40 blocks take ~4 s to send); the requester expects the default
    holder = cluster.worker("mock", *base, "--worker-id", "kill-a", "--mock-timing", "network_gb_per_s=0.02")
    cluster.worker("mock", *base, "--worker-id", "kill-b")
    w = await Watcher.open(cluster.nats_url, ns=ns)
    router = KvRouter(w.bus, w.membership, RouterConfig(peer_fetch=True))
    await router.start()
    try:
        await w.wait_workers("decode", 2)
        rng = random.Random(4)
        prefix = [rng.randrange(1, 32000) for _ in range(640)]
        hashes = block_hashes(prefix, 16, hash_seed(DEFAULT_HASH_KEY, "mock"))
        cold, _ = await ask(w.bus, "kill-a", prefix + [7], "cold")
        idx = router.index("mock")
        await w.wait_for(lambda: all("device" in idx.tiers_of("kill-a", h) for h in hashes), 10, "a's events")
        d = router.route("mock", prefix + [7], "moved", exclude={"kill-a"})
        assert (d.worker_id, d.fetch_source, d.fetch_blocks) == ("kill-b", "kill-a", 40)
        served = asyncio.create_task(ask(w.bus, "kill-b", prefix + [7], "moved", router))
        await w.wait_for(lambda: (r := w.loads.get("kill-a")) and r.counters.get("fetch_pinned_now", 0) == 40, 10,
                         "a to pin the blocks it sends")
        os.kill(holder.pid, signal.SIGKILL)
        tokens, last = await asyncio.wait_for(served, 30)
        assert tokens == cold and last.usage.cached_tokens == 0  # prefilled instead, same tokens
        b = (await w.fresh_load("kill-b")).counters
        assert b["peer_fetch_failed"] == 1 and b.get("peer_fetch_ok", 0) == 0 and b["hit_blocks_peer"] == 0
    finally:
        await router.stop()
        await w.close()


# -- a full prefill pool: one overflow prefill at a time on a decode worker, the rest queue ---------

async def test_with_the_prefill_pool_full_one_long_prompt_at_a_time_is_prefilled_on_the_decode_worker(cluster):
    """Overflow prompts stay on the decode worker that admitted them, each a long step for its
    streams: past one at a time they queue for the prefill pool instead (python -m bench planner)."""
    ns = "overflow"
    slow = ["--ns", ns, "--mock-speedup", "0.05", "--device-kv-blocks", "1024"]  # 1,024 tokens: ~1.3 s of prefill
    cluster.worker("prefill", "--mock", *slow, "--worker-id", "ovf-prefill", "--prefill-capacity", "1")
    cluster.worker("mock", *slow, "--worker-id", "ovf-decode", "--disagg-threshold", "256",
                   "--prefill-timeout", "60")
    w = await Watcher.open(cluster.nats_url, ns=ns)
    try:
        await w.wait_workers("prefill", 1, timeout=60)
        await w.wait_workers("decode", 1, timeout=60)
        await asyncio.sleep(1.5)  # the decode worker's view of the prefill pool (cards, load reports)

        async def one(i: int) -> list[int]:
            req = GenerateRequest(uuid.uuid4().hex, "mock", [1000 + i] * 1024, SamplingOptions(max_tokens=2))
            return [t async for chunk in generate(w.bus, "ovf-decode", req, first_timeout=60.0)
                    for t in chunk.token_ids]

        first = asyncio.create_task(one(0))  # takes the pool's one place
        await asyncio.sleep(0.3)
        rest = []
        for i in range(1, 6):  # all decided while the first (and the overflow) still prefill
            rest.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.02)
        outputs = await asyncio.wait_for(asyncio.gather(first, *rest), 60)
        assert all(len(o) == 2 for o in outputs)
        c = (await w.fresh_load("ovf-decode")).counters
        assert c.get("overflow_prefill_tokens") == 1024, c  # one prompt prefilled here, not five
        assert c.get("remote_prefill_sent") == 5 and c.get("queued_for_prefill_pool") == 4, c
        assert c.get("local_prefill_fallback", 0) == 0, c
    finally:
        await w.close()
