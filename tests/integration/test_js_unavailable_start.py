"""A worker that starts while its JetStream cannot answer yet (a host's roles up before its NATS
cluster has a leader again: JetStream says 503 "temporarily unavailable") waits for it instead of
exiting, then registers and serves.

One nats-server of a three-node JetStream cluster runs alone (no quorum, no JetStream leader);
a real prefill worker (mocker engine) starts on it with a 1 s ``--nats-connect-timeout`` (a
worker that gave up on the 503 would exit after it); it logs that it is retrying and stays up
past that timeout; the other two servers start; it registers, and a job published on the
prefill queue is pulled and answered.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

from mesh.natsserver import EmbeddedNatsCluster
from mesh.prefill_queue import PrefillQueue
from mesh.protocol import PrefillDone, PrefillJob
from tests.helpers.cluster import Watcher, wait_until
from tests.helpers.procs import stop_processes

CONNECT_TIMEOUT = 1.0


def start_prefill(url: str, log_path) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "cli", "worker", "prefill", "--mock", "--nats", url, "--ns", "jsu",
             "--worker-id", "pre-jsu", "--nats-connect-timeout", str(CONNECT_TIMEOUT)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


async def test_a_prefill_worker_waits_for_an_unavailable_jetstream(tmp_path):
    cluster = EmbeddedNatsCluster(3)
    log_path = tmp_path / "prefill.log"
    procs: list[subprocess.Popen] = []
    w = None
    try:
        await asyncio.to_thread(cluster.nodes[0].start)
        worker = start_prefill(cluster.nodes[0].url, log_path)
        procs.append(worker)
        await wait_until(lambda: b"temporarily unavailable" in log_path.read_bytes() or worker.poll() is not None,
                         60, "the worker to meet the unavailable JetStream")
        waited = time.monotonic()
        await wait_until(lambda: worker.poll() is not None or time.monotonic() - waited > CONNECT_TIMEOUT + 1,
                         30, "past the worker's connect timeout")
        assert worker.poll() is None, log_path.read_text(errors="replace")[-2000:]

        await asyncio.to_thread(cluster.nodes[1].start)
        await asyncio.to_thread(cluster.nodes[2].start)
        w = await Watcher.open(cluster.url, ns="jsu")
        card = await w.wait_for(lambda: w.membership.get("pre-jsu"), 60, "the prefill worker's card")
        assert worker.poll() is None

        done: list[PrefillDone] = []

        async def on_done(msg: PrefillDone, raw) -> None:
            done.append(msg)

        await w.bus.subscribe(w.bus.subjects.kv_ready(card.model, "ghost"), on_done, PrefillDone)
        await w.bus.flush(timeout=5)
        job = PrefillJob(request_id=f"jsu-{uuid.uuid4().hex[:8]}", model=card.model, token_ids=list(range(3, 35)),
                         decode_worker="ghost", num_cached_tokens=0, dest_block_ids=[0, 1], transports={},
                         deadline=time.time() + 30, block_size=16)
        await PrefillQueue(w.bus, card.model).publish(job, timeout=10)
        await w.wait_for(lambda: done, 30, "the job pulled and answered")
        assert done[0].request_id == job.request_id
    finally:
        if w is not None:
            await w.close()
        stop_processes(procs)
        await asyncio.to_thread(cluster.stop)
