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
import contextlib
import os
import random
import signal
import time
import uuid

import pytest
from nats.errors import NoRespondersError

from decode.peerfetch import lent_files
from mesh.bus import Bus
from mesh.protocol import (
    KvFetchDone,
    KvFetchRelease,
    KvFetchRequest,
    PeerFetchPlan,
    WorkerCard,
    encode,
)
from mesh.router.policy import RouterConfig
from mesh.router.router import KvRouter
from tests.helpers.cluster import Watcher
from tests.helpers.peer_fetch import (
    BS,
    PREFIX_BLOCKS,
    ask,
    decode_flags,
    plan_of,
    prefix_hashes,
    prefix_in_host_tier,
    prompt_of,
)

NS = "peerfetch"
A, B = "pf-a", "pf-b"


@pytest.fixture(scope="module")
def workers(cluster, tiny_model):
    flags = ["--ns", NS, *decode_flags(tiny_model, timeout=3)]
    return {wid: cluster.worker("decode", *flags, "--worker-id", wid) for wid in (A, B)}


async def test_a_prefix_in_one_workers_host_tier_is_fetched_by_another(cluster, workers):
    w = await Watcher.open(cluster.nats_url, ns=NS)
    router = KvRouter(w.bus, w.membership, RouterConfig(peer_fetch=True))
    await router.start()
    try:
        cards = await w.wait_workers("decode", 2, timeout=120)
        assert all(c.serves_kv_fetch and c.fetches_kv for c in cards)
        prompt, cold = await prefix_in_host_tier(w, router, A, random.Random(5))

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
        prompt = prompt_of(rng)
        await ask(w.bus, A, prompt)
        hashes = prefix_hashes(prompt)
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
            assert done.ok and done.num_blocks == PREFIX_BLOCKS and (done.lent is not None) == read, done
            got[read] = bytes(await ch.take(fid, done.transfer_bytes, done.lent.to_dict() if read else None))
            if read:
                await w.bus.publish(w.bus.subjects.kv_fetch_release("tiny", A),
                                    KvFetchRelease("t", fid, done.release_key))
            await ch.forget(fid)
        assert len(got[True]) == done.transfer_bytes and got[True] == got[False]
        a = (await w.fresh_load(A)).counters
        assert a["peer_serve_released"] == before + 1 and a["fetch_pinned_now"] == 0
    finally:
        await w.close()


async def lend(w, ch, hashes) -> tuple[str, KvFetchDone]:
    """Ask a to lend the run of ``hashes`` to a reader "t" (as a requester on its host does)."""
    fid = uuid.uuid4().hex[:16]
    params = await ch.params(fid, PREFIX_BLOCKS * (1 << 20))
    asked = time.time()  # for an hour: a holder pins for at most its --peer-pin-max-s (10 s by default)
    req = KvFetchRequest(uuid.uuid4().hex, "tiny", "t", hashes, asked + 3600, {"shm": params}, fetch_id=fid)
    done = await w.bus.request(w.bus.subjects.kv_fetch("tiny", A), req, KvFetchDone, 10)
    assert done.ok and done.lent is not None and done.num_blocks == PREFIX_BLOCKS and done.release_key, done
    assert asked < done.lent.until <= time.time() + 10.0
    return fid, done


async def held_prompt(w, seed: int) -> tuple[list[int], list[int]]:
    """A new prompt served by a (its prefix cached there) and its prefix's block hashes."""
    rng = random.Random(seed)
    prompt = prompt_of(rng)
    await ask(w.bus, A, prompt)
    return prompt, prefix_hashes(prompt)


async def test_a_release_without_the_fetch_key_changes_nothing(cluster, workers):
    """Anyone who saw a fetch id could unpin the run while its requester reads it; only the
    release key from the holder's reply (which only the requester sees) unpins it."""
    from kvstore.transfer.fetch import ShmChannel

    w = await Watcher.open(cluster.nats_url, ns=NS)
    ch = ShmChannel(worker_id="t")
    try:
        await w.wait_workers("decode", 2, timeout=120)
        _, hashes = await held_prompt(w, 11)
        before = (await w.fresh_load(A)).counters
        fid, done = await lend(w, ch, hashes)
        assert lent_files(w.membership.get(A)) == (done.lent.kv, done.lent.slots)  # a's card names its files
        release = w.bus.subjects.kv_fetch_release("tiny", A)
        for forged in ("", "not-the-key", done.release_key[:-1]):
            await w.bus.publish(release, KvFetchRelease("t", fid, forged))
        a = (await w.fresh_load(A)).counters
        assert a["fetch_pinned_now"] == PREFIX_BLOCKS  # still pinned for the reader
        assert a.get("peer_serve_released", 0) == before.get("peer_serve_released", 0)
        assert a["refused_messages"] == before.get("refused_messages", 0) + 3
        await w.bus.publish(release, KvFetchRelease("t", fid, done.release_key))
        a = (await w.fresh_load(A)).counters
        assert a["fetch_pinned_now"] == 0 and a["peer_serve_released"] == before.get("peer_serve_released", 0) + 1
        await ch.forget(fid)
    finally:
        await w.close()


async def test_a_forged_reply_lending_another_workers_pool_is_refused(cluster, workers):
    """A peer answers b's fetch with a lent run in a's files (a's blocks, as a lent them to someone
    else): b reads only files the answering holder's card names as its own, so it refuses, counts
    it and prefills. Without the check b would stage a's blocks as its request's prefix."""
    from kvstore.transfer.fetch import ShmChannel
    from kvstore.transfer.shm import host_id
    from mesh.registry import open_bucket

    evil = "pf-evil"
    w = await Watcher.open(cluster.nats_url, ns=NS)
    ch = ShmChannel(worker_id="t")
    try:
        await w.wait_workers("decode", 2, timeout=120)
        prompt, hashes = await held_prompt(w, 12)
        cold, _ = await ask(w.bus, A, prompt)
        fid, stolen = await lend(w, ch, hashes)  # a real lent run of a's
        now = time.time()
        card = WorkerCard(evil, "decode", "tiny", BS, 64, 2048, "h", 1, now, now, serves_kv_fetch=True,
                          transports={"shm": {"host": host_id(), "kv": "kv-1-evil", "slots": "kv-1-evil.host"}})
        await (await open_bucket(w.bus)).put(evil, encode(card))
        asked = []

        async def on_fetch(req: KvFetchRequest, raw) -> None:  # the forger replays a's run as its own
            asked.append(req)
            forged = KvFetchDone(req.request_id, evil, True, num_blocks=PREFIX_BLOCKS, transport="shm",
                                 transfer_bytes=stolen.transfer_bytes, lent=stolen.lent, release_key="k")
            await w.bus.respond(raw, forged)

        await w.bus.subscribe(w.bus.subjects.kv_fetch("tiny", evil), on_fetch, KvFetchRequest)
        await w.bus.flush(5)
        before = (await w.fresh_load(B)).counters
        await asyncio.sleep(0.5)  # b's registry view has the forger's card
        tokens, cached = await ask(w.bus, B, prompt, plan=PeerFetchPlan(evil, PREFIX_BLOCKS, 0))
        assert len(asked) == 1 and tokens == cold
        assert cached == 0  # prefilled: none of a's blocks became b's prefix
        b = (await w.fresh_load(B)).counters
        assert b["peer_fetch_failed"] == before.get("peer_fetch_failed", 0) + 1
        assert b["refused_messages"] == before.get("refused_messages", 0) + 1
        assert b.get("hit_blocks_peer", 0) == before.get("hit_blocks_peer", 0)
        await w.bus.publish(w.bus.subjects.kv_fetch_release("tiny", A), KvFetchRelease("t", fid, stolen.release_key))
        await ch.forget(fid)
    finally:
        with contextlib.suppress(Exception):
            await (await open_bucket(w.bus)).delete(evil)
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
        before = (await w.fresh_load(B)).counters
        rng = random.Random(6)
        prompt = prompt_of(rng)
        hashes = prefix_hashes(prompt)
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
        assert b["peer_fetch_failed"] == before.get("peer_fetch_failed", 0) + 1  # nothing fetched this time
        assert (b["peer_fetch_ok"], b["hit_blocks_peer"]) == (before["peer_fetch_ok"], before["hit_blocks_peer"])
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
