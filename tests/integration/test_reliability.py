"""Faults with real processes: a decode worker killed mid-stream, a NATS restart, a flood,
graceful shutdown. The outcome is asserted: identical output after migration, no hung
request, block usage back to idle."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.natsserver import free_port
from tests.helpers.cluster import (
    Watcher,
    completion_events,
    router_choices,
    stream_killing_its_worker,
    wait_http_ok,
)

NS = "faults"


@pytest.fixture(scope="module")
def mesh(cluster, tiny_model):
    flags = ["--ns", NS, "--model", str(tiny_model), "--device-kv-blocks", "2048"]
    workers = {f"f-dec-{i}": cluster.worker("decode", *flags, "--worker-id", f"f-dec-{i}") for i in range(2)}
    port = free_port()
    cluster.spawn("gateway", "--nats", cluster.nats_url, "--ns", NS, "--model", str(tiny_model),
                  "--host", "127.0.0.1", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/health")
    return url, workers


async def test_a_decode_worker_killed_mid_stream_is_invisible_to_the_client(cluster, tiny_model, mesh):
    url, workers = mesh
    w = await Watcher.open(cluster.nats_url, ns=NS)
    rng = random.Random(4)
    prompt = [rng.randrange(3, 4000) for _ in range(40)]
    n = 300  # the kill lands mid-stream: the router's decision says where it runs before any token comes
    try:
        await w.wait_workers("decode", 2)
        chosen = await router_choices(w)
        got, _ = await stream_killing_its_worker(url, "tiny", prompt, n, w, workers, after=50, chosen=chosen)
        reference = Engine(EngineConfig(tiny_model, num_kv_blocks=512)).generate(
            [prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        assert got == reference.output_token_ids  # no token lost, none repeated
        metrics = (await httpx.AsyncClient().get(f"{url}/metrics")).text
        assert "pdmesh_gateway_migrations_total 1" in metrics
        # the migrated choice ended FINISHED: nothing is left routing, waiting or streaming
        assert "pdmesh_gateway_live_choices 0" in metrics
        assert 'pdmesh_gateway_choices_total{state="FINISHED"} 1' in metrics
    finally:
        await w.close()


async def test_a_nats_restart_is_survived(tmp_path, tiny_model):
    """Every component reconnects; the registry and the router come back; requests in flight
    finish or fail clearly; new requests work."""
    from mesh.natsserver import EmbeddedNats
    from tests.helpers.cluster import Cluster

    port = free_port()
    store = str(tmp_path / "js")
    nats = EmbeddedNats(port=port, store_dir=store).start()
    cluster = Cluster(nats.url)
    try:
        flags = ["--model", str(tiny_model), "--device-kv-blocks", "1024"]
        for i in range(2):
            cluster.worker("decode", *flags, "--worker-id", f"nr-dec-{i}")
        gw_port = free_port()
        cluster.spawn("gateway", "--nats", nats.url, "--model", str(tiny_model), "--host", "127.0.0.1",
                      "--port", str(gw_port), "--first-token-timeout", "20", "--idle-timeout", "20")
        url = f"http://127.0.0.1:{gw_port}"
        wait_http_ok(f"{url}/health")
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "temperature": 0}
        async with httpx.AsyncClient(timeout=60) as client:
            before = (await client.post(f"{url}/v1/completions", json=body)).json()["choices"][0]["text"]
            # NATS stops on a long stream's first tokens: that request is in flight through the restart
            long_body = {**body, "max_tokens": 1000, "ignore_eos": True, "stream": True}
            running = asyncio.Event()

            async def in_flight_stream() -> list[dict]:
                events = []
                async with client.stream("POST", f"{url}/v1/completions", json=long_body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            events.append(json.loads(line[6:]))
                            running.set()
                return events

            in_flight = asyncio.create_task(in_flight_stream())
            await asyncio.wait_for(running.wait(), 60)
            nats.stop()
            await asyncio.sleep(2.0)
            nats = EmbeddedNats(port=port, store_dir=store).start()
            t0 = time.monotonic()
            events = await asyncio.wait_for(in_flight, 60)  # finished, or a clear error: never a hang
            finished = [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")]
            assert finished or "error" in events[-1], events[-3:]
            # the mesh comes back: workers re-register, the gateway routes again
            deadline = time.monotonic() + 45
            while True:
                r = await client.post(f"{url}/v1/completions", json=body)
                if r.status_code == 200:
                    break
                assert time.monotonic() < deadline, r.text
                await asyncio.sleep(0.5)
            assert r.json()["choices"][0]["text"] == before
            # longer than a card's TTL: the gateway's registry watch must be live again, not a stale view
            await asyncio.sleep(8)
            r = await client.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            health = (await client.get(f"{url}/health")).json()
            assert health["status"] == "ok"
            models = (await client.get(f"{url}/v1/models")).json()["data"]
            assert [m["id"] for m in models] == ["tiny"]
        w = await Watcher.open(nats.url)
        try:
            await w.wait_workers("decode", 2, timeout=30)
        finally:
            await w.close()
        print(f"back {time.monotonic() - t0:.1f}s after the restart")
    finally:
        cluster.stop()
        nats.stop()


async def test_a_flood_gets_429s_not_unbounded_queues(cluster):
    """A slow worker that may queue 2 requests and a gateway that admits 6: a flood of 30 gets
    clear 429s with Retry-After, the rest are served, and the worker ends idle."""
    ns = "flood"
    cluster.worker("mock", "--ns", ns, "--worker-id", "flood-0", "--mock-speedup", "0.2", "--max-queued", "2",
                   "--max-num-seqs", "2")
    port = free_port()
    cluster.spawn("gateway", "--nats", cluster.nats_url, "--ns", ns, "--host", "127.0.0.1", "--port", str(port),
                  "--max-inflight", "6")
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/health")
    body = {"model": "mock", "prompt": list(range(1, 40)), "max_tokens": 4}
    async with httpx.AsyncClient(timeout=120) as client:
        rs = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for _ in range(30)))
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 2 and codes.count(429) >= 10, codes  # the worker queues 2 at once
    for r in rs:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
    w = await Watcher.open(cluster.nats_url, ns=ns)
    try:
        report = await w.fresh_load("flood-0")
        assert report.running == 0 and report.waiting == 0 and report.kv_blocks_used == 0
    finally:
        await w.close()


async def test_sigterm_drains_a_decode_worker_without_losing_its_request(cluster, mesh):
    """On the module's mesh (last: its worker leaves): SIGTERM to the decode worker serving a stream,
    on its first tokens; the worker finishes the request itself (the gateway moved nothing), then
    exits cleanly and its card goes."""
    url, workers = mesh
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        # the router picks only live workers (the first test's killed one: its card gone within the TTL)
        await w.wait_for(lambda: all(p.poll() is None for x, p in workers.items() if w.membership.get(x)), 15,
                         "only live workers' cards")
        chosen = await router_choices(w)
        migrations = (await gateway_metric(url, "pdmesh_gateway_migrations_total"))
        # SIGTERM on the stream's first tokens: the request runs (a load report would say so a second later)
        body = {"model": "tiny", "prompt": "drain me", "max_tokens": 600, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        proc, usage = None, None
        async with asyncio.timeout(90), httpx.AsyncClient(timeout=120) as client, \
                client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for event in completion_events(r):
                if event["choices"] and proc is None:
                    serving = (await w.wait_for(lambda: chosen, 10, "the router's decision"))[-1]
                    proc = workers[serving]
                    proc.send_signal(signal.SIGTERM)
                usage = event.get("usage") or usage
        assert proc is not None and usage["completion_tokens"] == 600  # it finished its request...
        assert await gateway_metric(url, "pdmesh_gateway_migrations_total") == migrations  # ...itself
        assert proc.wait(30) == 0  # ...then exited cleanly
        await w.wait_for(lambda: w.membership.get(serving) is None, 10, "the card to go")
    finally:
        await w.close()


async def gateway_metric(url: str, sample: str) -> float:
    """One unlabelled sample of the gateway's /metrics (0 while it has none)."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{url}/metrics")).text
    return next((float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == sample), 0.0)
