"""Many simulated workers in one process (``mesh worker mock --num-workers N``): each a whole worker
on the bus, behind a real gateway on a real nats-server."""

from __future__ import annotations

import asyncio

import openai

from tests.helpers.cluster import Watcher, wait_http_ok

NS = "host"
N = 24


async def test_many_workers_in_one_process_go_live_and_serve(cluster, tiny_model):
    proc = cluster.worker("mock", "--ns", NS, "--model", str(tiny_model), "--num-workers", str(N),
                          "--worker-id", "hostA", "--device-kv-blocks", "256", "--mock-speedup", "10")
    url = cluster.gateway(tiny_model, None, "--ns", NS)
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        cards = await w.wait_workers("decode", N, timeout=60)
        # each its own worker: its own id and card, all in the one process
        assert sorted(c.worker_id for c in cards) == [f"hostA-{i:04d}" for i in range(N)]
        assert {c.pid for c in cards} == {proc.pid} and {c.engine for c in cards} == {"mock"}
        await w.wait_for(lambda: len(w.loads) >= N, 10, "a load report from every worker")
        await asyncio.to_thread(wait_http_ok, url + "/health")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def ask(i: int) -> int:
            r = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"question {i} " * (1 + i % 7)}],
                max_tokens=8, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        assert await asyncio.gather(*(ask(i) for i in range(3 * N))) == [8] * (3 * N)
        # the gateway's router spread them over the process's workers, each answering for itself
        served = await w.wait_for(
            lambda: (s := [wid for wid, r in w.loads.items() if r.counters.get("finished", 0)]) and len(s) >= 4 and s,
            10, "load reports of the workers that served")
        assert set(served) <= {c.worker_id for c in cards}
    finally:
        await w.close()
        proc.terminate()
