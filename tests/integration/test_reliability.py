"""Faults with real processes: a decode worker killed mid-stream, a NATS restart, a flood,
graceful shutdown. The outcome is asserted: identical output after migration, no hung
request, block usage back to idle."""

from __future__ import annotations

import json
import os
import random
import signal

import httpx
import pytest

from mesh.engine import Engine, EngineConfig, SamplingParams
from mesh.natsserver import free_port
from tests.integration.conftest import Watcher, wait_http_ok

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
    n = 3000
    try:
        await w.wait_workers("decode", 2)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        got: list[int] = []
        killed = None
        async with httpx.AsyncClient(timeout=120) as client, client.stream("POST", f"{url}/v1/completions",
                                                                           json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                got += event["choices"][0].get("token_ids") or []
                if killed is None and len(got) >= 50:
                    busy = await w.wait_for(
                        lambda: [wid for wid in workers if (rep := w.loads.get(wid)) and rep.running], 10,
                        "the serving worker's load report")
                    assert len(busy) == 1, busy
                    killed = busy[0]
                    os.kill(workers[killed].pid, signal.SIGKILL)
        assert killed is not None
        reference = Engine(EngineConfig(tiny_model, num_kv_blocks=512)).generate(
            [prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        assert got == reference.output_token_ids  # no token lost, none repeated
        metrics = (await httpx.AsyncClient().get(f"{url}/metrics")).text
        assert "pdmesh_gateway_migrations_total 1" in metrics
    finally:
        await w.close()
