"""The KV-aware router against real decode workers of the tiny model.

The router runs in the test process as it runs in the gateway: fed by the
workers' KV events, load reports and the registry over a real nats-server.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import uuid

import pytest

from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from mesh.client import generate
from mesh.protocol import GenerateRequest, SamplingOptions
from mesh.router.policy import RouterConfig
from mesh.router.router import KvRouter
from tests.helpers.cluster import Watcher

NS = "routing"


@pytest.fixture(scope="module")
def workers(cluster, tiny_model):
    procs = {}
    for i in range(3):
        wid = f"r-dec-{i}"
        procs[wid] = cluster.worker(
            "decode", "--ns", NS, "--model", str(tiny_model), "--worker-id", wid,
            "--device-kv-blocks", "96",  # small: a few long prompts evict older ones
        )
    return procs


async def ask(bus, worker, tokens, max_tokens=4, router=None, request_id=None):
    """Serve a request on ``worker`` and tell the router when it ends, as the gateway does."""
    rid = request_id or uuid.uuid4().hex
    req = GenerateRequest(rid, "tiny", tokens, SamplingOptions(max_tokens=max_tokens, temperature=0.0))
    last = None
    async for chunk in generate(bus, worker, req):
        last = chunk
    if router is not None:
        router.finished(worker, rid)
    return last


async def test_router_follows_the_prefix_forgets_evictions_and_dead_workers(cluster, workers):
    w = await Watcher.open(cluster.nats_url, ns=NS)
    router = KvRouter(w.bus, w.membership, RouterConfig(mode="kv"))
    await router.start()
    try:
        await w.wait_workers("decode", 3)
        rng = random.Random(5)
        prefix = [rng.randrange(3, 4096) for _ in range(640)]  # 40 blocks
        hashes = block_hashes(prefix, 16, hash_seed(DEFAULT_HASH_KEY, "tiny"))

        # 1. the first request goes somewhere; the ones sharing its prefix follow it there
        first = router.route("tiny", prefix + [1, 2, 3], "first")
        done = await ask(w.bus, first.worker_id, prefix + [1, 2, 3], router=router, request_id="first")
        assert done.usage.cached_tokens == 0
        holder = first.worker_id
        idx = router.index("tiny")
        assert idx.overlap(hashes).get(holder, 0) >= 40  # predicted from the decision until the events come
        await w.wait_for(lambda: all("device" in idx.tiers_of(holder, h) and "predicted" not in idx.tiers_of(holder, h)
                                     for h in hashes), 10, "events")
        for k in range(3):
            d = router.route("tiny", prefix + [10 + k], f"again-{k}")
            assert d.worker_id == holder and d.overlap_blocks >= 40
            done = await ask(w.bus, d.worker_id, prefix + [10 + k], router=router, request_id=f"again-{k}")
            assert done.usage.cached_tokens >= 640 - 16  # served from the decode worker's cache

        # 2. the holder evicts the prefix (its 96-block pool fills with other prompts, each asked
        # twice: blocks that served a hit outlive blocks seen once, so they must be hits too):
        # no more credit
        for _ in range(3):
            other = [rng.randrange(3, 4096) for _ in range(700)]
            await ask(w.bus, holder, other)
            await ask(w.bus, holder, other)
        # (the removals may come in more than one batch, one per --kv-event-interval-ms)
        await w.wait_for(lambda: router.index("tiny").overlap(hashes).get(holder, 0) == 0, 10,
                         "the removal events")

        # 3. a killed worker is never chosen again
        victim = next(x for x in workers if x != holder)
        os.kill(workers[victim].pid, signal.SIGKILL)
        # its load reports stop at once: within 4.5 s it gets no new work (its card may outlive it to 10 s)
        await w.wait_for(lambda: victim not in {c.worker_id for c in router.candidates("tiny")}, 8,
                         "the router to stop choosing the silent worker")
        await w.wait_for(lambda: w.membership.get(victim) is None, 15, "the card to expire")
        chosen = {router.route("tiny", [rng.randrange(3, 4096) for _ in range(40)]).worker_id for _ in range(30)}
        assert victim not in chosen and chosen <= set(workers)
        assert victim not in router.index("tiny").workers()
    finally:
        await router.stop()
        await w.close()


async def test_a_new_router_resyncs_from_snapshots(cluster, workers):
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        await w.wait_workers("decode", 2)
        live = [c.worker_id for c in w.membership.cards(role="decode")]
        rng = random.Random(9)
        prompt = [rng.randrange(3, 4096) for _ in range(320)]
        await ask(w.bus, live[0], prompt)
        await asyncio.sleep(0.5)
        # started after the blocks were stored: it can only know them from a snapshot
        router = KvRouter(w.bus, w.membership, RouterConfig(mode="kv"))
        await router.start()
        hashes = block_hashes(prompt, 16, hash_seed(DEFAULT_HASH_KEY, "tiny"))
        await w.wait_for(lambda: router.index("tiny").overlap(hashes).get(live[0], 0) >= 19, 10, "a snapshot")
        assert router.resyncs >= len(live)
        await router.stop()
    finally:
        await w.close()
