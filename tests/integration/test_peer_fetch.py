"""Peer fetch between two real decode worker processes (issue 20): the tiny model, a real
nats-server, and the kv router in the test process deciding as the gateway's does.

A prompt's prefix sits only in worker a's host tier; the router sends the request to b
(a is excluded, as when it is overloaded) and plans a fetch from a; b fetches the blocks,
its engine counts them as a prefix hit, and the greedy tokens equal a's cold run. Then a
is killed (kill -9) while b's fetch of another prefix is outstanding: b falls back to
prefilling, with the same tokens. The channels (shm, nats) are also checked on their own,
with a late write after the requester gave up.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid

import pytest
from nats.errors import NoRespondersError

from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from mesh.bus import Bus
from mesh.client import generate
from mesh.protocol import (
    GenerateRequest,
    KvFetchDone,
    KvFetchRelease,
    KvFetchRequest,
    PeerFetchPlan,
    SamplingOptions,
)
from mesh.router.policy import RouterConfig
from mesh.router.router import KvRouter
from tests.helpers.cluster import Watcher

NS = "peerfetch"
A, B = "pf-a", "pf-b"
BS, PREFIX_BLOCKS = 16, 10


@pytest.fixture(scope="module")
def workers(cluster, tiny_model):
    flags = ["--ns", NS, "--model", str(tiny_model), "--device-kv-blocks", "24", "--host-kv-blocks", "64",
             "--peer-fetch", "--peer-fetch-timeout", "3", "--max-num-seqs", "4"]
    return {wid: cluster.worker("decode", *flags, "--worker-id", wid) for wid in (A, B)}


async def ask(bus, worker, tokens, router=None, plan=None, request_id=None):
    """(greedy tokens, cached tokens) of one request on ``worker``, as the gateway sends it."""
    rid = request_id or uuid.uuid4().hex
    req = GenerateRequest(rid, "tiny", tokens, SamplingOptions(max_tokens=6, temperature=0.0), peer_fetch=plan)
    toks, last = [], None
    async for chunk in generate(bus, worker, req, first_timeout=60, idle_timeout=30):
        assert chunk.error is None, chunk.error
        toks += chunk.token_ids
        last = chunk
    if router is not None:
        router.finished(worker, rid)
    return toks, last.usage.cached_tokens


def plan_of(d) -> PeerFetchPlan | None:
    """What the gateway puts in the request (gateway/service.py ``_send``)."""
    return PeerFetchPlan(d.fetch_source, d.fetch_blocks, d.hit_blocks) if d.fetch_source else None


async def test_a_prefix_in_one_workers_host_tier_is_fetched_by_another(cluster, workers):
    w = await Watcher.open(cluster.nats_url, ns=NS)
    router = KvRouter(w.bus, w.membership, RouterConfig(peer_fetch=True))
    await router.start()
    try:
        cards = await w.wait_workers("decode", 2, timeout=120)
        assert all(c.serves_kv_fetch and c.fetches_kv for c in cards)
        rng = random.Random(5)
        prompt = [rng.randrange(3, 4000) for _ in range(PREFIX_BLOCKS * BS + 1)]
        hashes = block_hashes(prompt[: PREFIX_BLOCKS * BS], BS, hash_seed(DEFAULT_HASH_KEY, "tiny"))
        cold, cached = await ask(w.bus, A, prompt)
        assert cached == 0
        for _ in range(3):  # other prompts push the prefix out of a's 24-block device pool into its host tier
            await ask(w.bus, A, [rng.randrange(3, 4000) for _ in range(PREFIX_BLOCKS * BS + 1)])
        idx = router.index("tiny")
        await w.wait_for(lambda: all(idx.tiers_of(A, h) == {"host"} for h in hashes), 10,
                         "the prefix to sit only in a's host tier")

        d = router.route("tiny", prompt, "moved", exclude={A})  # a is busy, say: b serves, fetching from a
        assert (d.worker_id, d.fetch_source, d.fetch_blocks, d.hit_blocks) == (B, A, PREFIX_BLOCKS, 0)
        tokens, cached = await ask(w.bus, B, prompt, router, plan_of(d), "moved")
        assert tokens == cold  # the same greedy tokens as a's cold run
        assert cached == PREFIX_BLOCKS * BS  # the fetched blocks were a prefix hit: none recomputed

        b = (await w.fresh_load(B)).counters
        a = (await w.fresh_load(A)).counters
        assert (b["peer_fetch_ok"], b["peer_fetch_blocks"], b["hit_blocks_peer"]) == (1, PREFIX_BLOCKS, PREFIX_BLOCKS)
        assert b.get("hit_blocks_host", 0) == 0 and b.get("peer_fetch_failed", 0) == 0
        assert b["peer_fetch_via_shm"] == 1  # same host: the shm channel
        assert a["peer_serve_blocks"] == a["peer_serve_host_blocks"] == PREFIX_BLOCKS  # read from a's host tier
        assert a["peer_serve_released"] == 1  # a lent its blocks (same host, shared memory): b read and released them
        assert a["fetch_pinned_now"] == 0  # pins released
    finally:
        await router.stop()
        await w.close()


async def test_a_lent_run_and_a_copied_one_carry_the_same_bytes(cluster, workers):
    """A requester that reads gets the run lent (nothing copied by the holder); one that does not
    (no ``read`` in its shm params) gets it copied into its buffer: the same bytes either way."""
    from kvstore.transfer.fetch import ShmChannel

    w = await Watcher.open(cluster.nats_url, ns=NS)
    ch = ShmChannel(worker_id="t")
    try:
        await w.wait_workers("decode", 2, timeout=120)
        rng = random.Random(7)
        prompt = [rng.randrange(3, 4000) for _ in range(PREFIX_BLOCKS * BS + 1)]
        await ask(w.bus, A, prompt)
        hashes = block_hashes(prompt[: PREFIX_BLOCKS * BS], BS, hash_seed(DEFAULT_HASH_KEY, "tiny"))
        before = (await w.fresh_load(A)).counters.get("peer_serve_released", 0)
        got, room = {}, PREFIX_BLOCKS * (1 << 20)
        for read in (True, False):
            fid = uuid.uuid4().hex[:16]
            params = await ch.params(fid, room)
            if not read:
                del params["read"]
            req = KvFetchRequest(uuid.uuid4().hex, "tiny", "t", hashes, time.time() + 10, {"shm": params},
                                 fetch_id=fid)
            done = await w.bus.request(w.bus.subjects.kv_fetch("tiny", A), req, KvFetchDone, 10)
            assert done.ok and done.num_blocks == PREFIX_BLOCKS and bool(done.lent) == read, done
            got[read] = bytes(await ch.take(fid, done.transfer_bytes, done.lent or None))
            if read:
                await w.bus.publish(w.bus.subjects.kv_fetch_release("tiny", A), KvFetchRelease("t", fid))
            await ch.forget(fid)
        assert len(got[True]) == done.transfer_bytes and got[True] == got[False]
        a = (await w.fresh_load(A)).counters
        assert a["peer_serve_released"] == before + 1 and a["fetch_pinned_now"] == 0
    finally:
        await w.close()


async def test_a_holder_killed_mid_fetch_costs_a_prefill_not_the_request(cluster, workers):
    w = await Watcher.open(cluster.nats_url, ns=NS)
    router = KvRouter(w.bus, w.membership, RouterConfig(peer_fetch=True))
    await router.start()
    asked = asyncio.Event()

    async def on_fetch(req: KvFetchRequest, raw) -> None:  # sees b's request as a does (no reply)
        if req.request_id == "orphaned":
            asked.set()

    try:
        await w.wait_workers("decode", 2, timeout=120)
        await w.bus.subscribe(w.bus.subjects.kv_fetch("tiny", A), on_fetch, KvFetchRequest)
        rng = random.Random(6)
        prompt = [rng.randrange(3, 4000) for _ in range(PREFIX_BLOCKS * BS + 1)]
        hashes = block_hashes(prompt[: PREFIX_BLOCKS * BS], BS, hash_seed(DEFAULT_HASH_KEY, "tiny"))
        cold, _ = await ask(w.bus, A, prompt)
        idx = router.index("tiny")
        await w.wait_for(lambda: all(idx.tiers_of(A, h) for h in hashes), 10, "a's events")
        d = router.route("tiny", prompt, "orphaned", exclude={A})
        assert (d.worker_id, d.fetch_source) == (B, A)

        os.kill(workers[A].pid, signal.SIGSTOP)  # a takes b's request off the wire but never answers it
        served = asyncio.create_task(ask(w.bus, B, prompt, router, plan_of(d), "orphaned"))
        await asyncio.wait_for(asked.wait(), 10)
        os.kill(workers[A].pid, signal.SIGKILL)
        tokens, cached = await asyncio.wait_for(served, 60)
        assert tokens == cold and cached == 0  # prefilled instead after the fetch timed out: same tokens
        b = (await w.fresh_load(B)).counters
        assert b["peer_fetch_failed"] == 1 and b["peer_fetch_ok"] == 1 and b["hit_blocks_peer"] == PREFIX_BLOCKS
    finally:
        await router.stop()
        await w.close()


async def test_channels_move_the_bytes_and_a_late_write_lands_nowhere(nats_server):
    from kvstore.transfer.fetch import NatsChannel, ShmChannel

    bus = await Bus.connect(nats_server.url, "test-channels", ns="chan")
    try:
        payload = memoryview(bytes(range(256)) * 1000)
        for ch in (ShmChannel(worker_id="req"), NatsChannel(bus=bus, model="m", worker_id="req")):
            params = await ch.params("f1", 2 * len(payload))  # room for more than the holder sends
            assert ch.usable(params)
            if ch.name == "shm":  # a requester names no file but a fetch buffer in /dev/shm
                assert not ch.usable({**params, "name": "../" + params["name"]})
                assert not ch.usable({**params, "name": params["name"].replace("-fetch-", "-")})
                assert not ch.usable({**params, "path": "/tmp/x", "name": None})
            assert await ch.send("f1", params, payload) == len(payload)
            assert bytes(await ch.take("f1", len(payload))) == bytes(payload)
            if ch.name == "nats":  # (shm: the holder's KvFetchDone says how much it wrote)
                assert await ch.take("f1", len(payload) + 1) is None  # a short transfer is no transfer
            await ch.forget("f1")
            with pytest.raises(ValueError):  # a holder cannot write past the buffer
                await ch.send("f1", params, memoryview(bytes(2 * len(payload) + 1)))
            # the requester gave up and dropped the buffer: a late writer reaches nothing
            if ch.name == "shm":
                assert not ch.usable(params)
                with pytest.raises(FileNotFoundError):
                    await ch.send("f1", params, payload)
            else:
                with pytest.raises((NoRespondersError, TimeoutError)):  # its last chunk is acked by nobody
                    await ch.send("f1", params, payload)
    finally:
        await bus.close()
