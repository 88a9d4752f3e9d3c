"""The mesh on a 3-node NATS cluster (lean: mocker workers), and the loss of a server.

Every process gets the three URLs and ``--js-replicas 3``: the registry bucket and the prefill
stream are replicated on the three servers. The mesh serves (a long prompt goes through the
prefill queue); then the server the gateway is connected to is killed -9: requests keep being
answered with the right tokens (or, while clients fail over, a clear 5xx), none hangs, and
after the server is back the mesh still serves.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from nats.js.errors import NotFoundError

from bench.mesh.chaos import Outcome, one_request
from bench.mesh.nats_cluster import gateway_server
from mesh.bus import Bus
from mesh.natsauth import NatsConfig
from mesh.natsserver import EmbeddedNatsCluster, free_port
from tests.helpers.cluster import Cluster


@pytest.fixture(scope="module")
def nats_cluster():
    with EmbeddedNatsCluster(3) as c:
        yield c


async def requests_for(seconds: float, client, url: str, out: Outcome, clients: int = 3) -> None:
    end = time.monotonic() + seconds

    async def user(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < end:
            await one_request(client, url, rng, out, timeout=30.0)

    await asyncio.gather(*(user(i) for i in range(clients)))


async def test_mesh_rides_through_the_loss_of_a_server(nats_cluster):
    c = nats_cluster
    procs = Cluster(c.url)
    bus_flags = ["--js-replicas", "3", "--nats-connect-timeout", "30"]
    common = [*bus_flags, "--mock-speedup", "20", "--prefill-timeout", "4"]
    port = free_port()
    try:
        procs.worker("mock", *common, "--worker-id", "cl-dec", "--disagg-threshold", "512")
        procs.worker("prefill", "--mock", *common, "--worker-id", "cl-pre")
        procs.spawn("gateway", "--nats", c.url, *bus_flags, "--host", "127.0.0.1", "--port", str(port),
                    "--first-token-timeout", "8", "--idle-timeout", "8")
        url = f"http://127.0.0.1:{port}"
        bus = await Bus.connect(c.url, "cluster-test", config=NatsConfig.build(c.url, connect_timeout=30))
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(360):
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
            for stream in ("KV_mesh_workers", "mesh_mock_prefill"):  # created by the workers, R3
                for _ in range(240):  # the prefill worker may create its stream after /health is green
                    try:
                        info = await bus.js.stream_info(stream)
                        break
                    except NotFoundError:
                        await asyncio.sleep(0.25)
                else:
                    info = await bus.js.stream_info(stream)
                assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2, stream
            before = Outcome()
            await requests_for(2.0, client, url, before)
            assert before.correct >= 10 and before.correct == before.total, before.error_kinds
            victim = await gateway_server(c, client)
            c.kill(victim)
            during = Outcome()
            await requests_for(6.0, client, url, during)
            await asyncio.to_thread(c.restart, victim)
            after = Outcome()
            await requests_for(2.0, client, url, after)
        await bus.close()
        print({name: (o.correct, o.total, o.error_kinds) for name, o in
               (("before", before), ("during", during), ("after", after))})
        for out in (during, after):
            assert out.hung == 0 and out.incorrect == 0, out.incorrect_samples
            assert all(k.startswith(("http 5", "stream")) for k in out.error_kinds), out.error_kinds
        assert during.correct >= 10 and after.correct >= 10
    finally:
        procs.stop()
