"""Peer fetch over the ``nixl`` channel: two real decode worker processes acting as two hosts
(``MESH_HOST_ID``, ``--transports nixl,nats``), the kv router in the test process deciding as the
gateway's does; and the channel on its own (a real nats-server, two agents in this process):
bytes intact, forged slices refused, a late write keeps its slice out of use until it lands.
"""

from __future__ import annotations

import random

import pytest

from kvstore.transfer import Refused
from mesh.bus import Bus
from mesh.router.policy import RouterConfig
from mesh.router.router import KvRouter
from tests.helpers.cluster import Watcher, wait_until
from tests.helpers.peer_fetch import (
    BS,
    PREFIX_BLOCKS,
    ask,
    decode_flags,
    plan_of,
    prefix_in_host_tier,
)

pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")

NS = "nxfetch"
A, B = "nxf-a", "nxf-b"


async def test_a_prefix_on_another_host_is_fetched_over_nixl(cluster, tiny_model):
    flags = ["--ns", NS, *decode_flags(tiny_model, timeout=5), "--transports", "nixl,nats"]
    for wid in (A, B):
        cluster.worker("decode", *flags, "--worker-id", wid, env={"MESH_HOST_ID": f"host-{wid}"})
    w = await Watcher.open(cluster.nats_url, ns=NS)
    router = KvRouter(w.bus, w.membership, RouterConfig(peer_fetch=True))
    await router.start()
    try:
        await w.wait_workers("decode", 2, timeout=120)
        prompt, cold = await prefix_in_host_tier(w, router, A, random.Random(11))
        d = router.route("tiny", prompt, "moved", exclude={A})
        assert (d.worker_id, d.fetch_source) == (B, A)
        tokens, cached = await ask(w.bus, B, prompt, router, plan_of(d), "moved")
        assert tokens == cold  # the same greedy tokens as a's cold run
        assert cached == PREFIX_BLOCKS * BS  # the fetched blocks were a prefix hit
        b = (await w.fresh_load(B)).counters
        assert b.get("peer_fetch_via_nixl") == 1 and b.get("peer_fetch_blocks") == PREFIX_BLOCKS, b
        assert not b.get("peer_fetch_via_nats") and not b.get("peer_fetch_failed"), b
    finally:
        await router.stop()
        await w.close()


async def test_the_nixl_channel_moves_bytes_refuses_forgeries_and_fences_late_writes(nats_server):
    from kvstore.transfer.nixl_fetch import NixlChannel

    bus = await Bus.connect(nats_server.url, "test-nixl-channel", ns="nxchan")
    try:
        req = NixlChannel(bus=bus, model="m", worker_id="nx-req", buffer_bytes=1 << 20)
        holder = NixlChannel(bus=bus, model="m", worker_id="nx-holder")
        payload = memoryview(bytes(range(256)) * 1000)
        params = await req.params("f1", 2 * len(payload))
        assert holder.usable(params) and params["offset"] == 0
        assert await holder.send("f1", params, payload) == len(payload)
        assert bytes(await req.take("f1", len(payload))) == bytes(payload)
        await req.forget("f1")
        assert not req.slices and not req.fenced  # landed: the slice is free again

        p2 = await req.params("f2", len(payload))
        with pytest.raises(Refused):  # outside the region the requester registered
            await holder.send("f2", {**p2, "offset": (1 << 20) - 10}, payload)
        with pytest.raises(Refused):  # memory it never registered
            await holder.send("f2", {**p2, "addr": p2["addr"] + 4096}, payload)
        with pytest.raises(RuntimeError, match="no write grant"):  # a fetch it never armed
            await holder.send("f2", {**p2, "fetch": "forged"}, payload)
        assert not holder.usable({**p2, "addr": str(p2["addr"])})  # params stay flat and typed
        big = await req.params("big", 2 << 20)  # more than the buffer holds: not usable, the holder
        assert big["bytes"] == 0 and not holder.usable(big)  # takes the next channel (nats)

        # The requester gives up on f2 while a granted write is under way: its slice stays out of
        # use until the write's notification, then comes back.
        await holder.node.ask_grant(bus, p2["begin"], "fetch", "f2", p2["gen"])  # as the holder does
        await req.forget("f2")
        assert "f2" in req.fenced
        p3 = await req.params("f3", len(payload))
        assert p3["offset"] >= p2["offset"] + p2["bytes"]  # not handed out again meanwhile
        peer = await holder.node.peer(bus, p2["md"], p2["agent"], p2["rev"])
        src = holder.node.register("payload", *_addr_len(payload))
        dst = next(r for r in peer.regions if r.kind == "fetch")
        await holder.node.write(peer, src, [(src.addr, src.size)], dst, [(p2["addr"] + p2["offset"], src.size)],
                                f"fetch:f2:{p2['gen']}".encode())
        await req.forget("f3")
        await wait_until(lambda: req._unfence() or not req.fenced, 5, "the late write's notification")
        assert (await req.params("f4", len(payload)))["offset"] == 0  # landed: the slice is reused
    finally:
        await bus.close()


def _addr_len(payload: memoryview) -> tuple[int, int]:
    import numpy as np

    return int(np.frombuffer(payload, dtype=np.uint8).ctypes.data), len(payload)
