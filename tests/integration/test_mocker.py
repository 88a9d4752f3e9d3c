"""The mocker: cheap enough that 32 of them run on two cores, speaking the real protocol."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from mesh.client import generate
from mesh.protocol import GenerateRequest, SamplingOptions
from tests.integration.conftest import Watcher

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
