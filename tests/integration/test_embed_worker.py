"""The embed worker's lifecycle (``worker.core.WorkerCore``, the one every role shares) with a real
nats-server and a real worker process: its card (role embed, its vector size, no KV pool), an
``EmbedRequest`` answered on its subject, its load reports and /metrics counting it, and SIGTERM:
the worker drains, its card goes, it exits 0."""

from __future__ import annotations

import signal

import httpx
import numpy as np

from mesh.embed_messages import EmbedReply, EmbedRequest
from tests.helpers.cluster import Watcher

NS = "embedlife"


async def test_an_embed_worker_registers_serves_reports_and_leaves_cleanly(cluster, tiny_model):
    proc = cluster.worker("decode", "--task", "embed", "--ns", NS, "--model", str(tiny_model),
                          "--worker-id", "emb-0")
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        [card] = await w.wait_workers("embed", 1)
        assert (card.worker_id, card.status, card.kv_blocks, card.block_size, card.capacity) == ("emb-0", "ready", 0, 0, 1)
        assert card.embed_dim > 0 and card.metrics_port > 0 and not card.publishes_kv_events
        request = EmbedRequest("r-1", card.model, [[5, 6, 7], [8, 9]])
        reply = await w.bus.request(w.bus.subjects.embed(card.model, "emb-0"), request, EmbedReply, timeout=30)
        assert not reply.error and reply.worker == "emb-0" and reply.dim == card.embed_dim
        vectors = np.frombuffer(reply.vectors, dtype="<f4").reshape(2, card.embed_dim)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)

        report = await w.fresh_load("emb-0")
        assert report.role == "embed" and report.model == card.model and report.status == "ready"
        assert report.counters == {"requests": 1, "finished": 1, "errors": 0}
        async with httpx.AsyncClient(timeout=10) as client:
            page = (await client.get(f"http://127.0.0.1:{card.metrics_port}/metrics")).text
        assert f'pdmesh_worker_requests_total{{model="{card.model}",outcome="finished",role="embed"}} 1.0' in page

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        await w.wait_for(lambda: w.membership.get("emb-0") is None, 10, "the card to go")
    finally:
        await w.close()
