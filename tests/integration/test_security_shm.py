"""No bus message names a local resource: forged ``PrefillJob``s against a real prefill worker.

Whoever can publish on ``{ns}.{model}.prefill.jobs`` used to be able to make a prefill worker
map any file it could write and fill it with KV bytes (the shm transport's params carried a
path). Now the decode worker's KV file lives in the mesh's own directory and jobs name it only
by a plain file name. Forged jobs point at a file outside that directory in every way we can
think of (an absolute path, ``..``, a symlink planted in the directory, blocks out of range);
the prefill worker refuses each at once (logged, counted, ``PrefillDone(ok=false)`` so the
decode worker would prefill locally), the file is untouched, and the mesh still serves a
disaggregated request through the same prefill worker.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from kvstore.transfer import host_id
from kvstore.transfer.shm import shm_dir
from mesh.prefill_queue import PrefillQueue
from mesh.protocol import PrefillDone, PrefillJob
from tests.helpers.cluster import Watcher, run_all

PREFILL, DECODE, GHOST = "pre-forged", "dec-forged", "ghost-decode"


def digest(path) -> tuple[str, float]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime


@pytest.fixture(scope="module")
def spec(tiny_model):
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=8))
    return engine.kv_cache.spec


def forged(params: dict, blocks: list[int] | None = None) -> PrefillJob:
    return PrefillJob(request_id=f"forged-{uuid.uuid4().hex[:8]}", model="tiny", token_ids=list(range(3, 35)),
                      decode_worker=GHOST, num_cached_tokens=0, dest_block_ids=blocks or [0, 1],
                      transports={"shm": params}, deadline=time.time() + 30, block_size=16)


async def test_forged_jobs_leave_outside_files_untouched(cluster, tiny_model, spec, tmp_path):
    flags = ["--model", str(tiny_model), "--device-kv-blocks", "256", "--transports", "shm"]
    cluster.worker("prefill", *flags, "--worker-id", PREFILL)
    cluster.worker("decode", *flags, "--worker-id", DECODE, "--disagg-threshold", "16")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(os.urandom(spec.total_bytes))  # large enough to take every forged block
    before = digest(victim)
    link = shm_dir() / f"kv-evil-{uuid.uuid4().hex[:6]}"
    link.symlink_to(victim)
    base = {"host": host_id(), "spec": spec.to_dict()}
    jobs = [
        forged({**base, "path": str(victim)}),  # a path, as older decode workers sent
        forged({**base, "name": f"../../../..{victim}"}),  # out of the directory by name
        forged({**base, "name": link.name}),  # a symlink planted in the directory
        forged({**base, "path": str(shm_dir() / ".." / ".." / victim.relative_to("/"))}),
    ]
    w = await Watcher.open(cluster.nats_url)
    done: list[PrefillDone] = []

    async def on_done(msg: PrefillDone, raw) -> None:
        done.append(msg)

    try:
        await w.bus.subscribe(w.bus.subjects.kv_ready("tiny", GHOST), on_done, PrefillDone)
        await w.wait_for(lambda: w.membership.get(PREFILL) and w.membership.get(DECODE), 120, "workers")
        queue = PrefillQueue(w.bus, "tiny")
        for job in jobs:
            await queue.publish(job)
        await w.wait_for(lambda: len(done) == len(jobs), 30, "an answer to every forged job")
        assert {d.request_id for d in done} == {j.request_id for j in jobs}
        assert all(not d.ok and d.error.startswith("refused: shm") for d in done), done
        # one out of range block in the real decode worker's own file: refused at the transfer
        card = w.membership.get(DECODE)
        legit = {**base, "name": card.transports["shm"].get("name") or os.path.basename(card.transports["shm"]["path"])}
        out_of_range = forged({**legit, "spec": {**spec.to_dict(), "num_blocks": 256}}, blocks=[0, 10**6])
        await queue.publish(out_of_range)
        await w.wait_for(lambda: len(done) == len(jobs) + 1, 60, "the out of range job's answer")
        assert not done[-1].ok and "out of range" in done[-1].error
        assert digest(victim) == before
        report = await w.fresh_load(PREFILL)
        assert report.counters.get("refused_jobs") == len(jobs) + 1, report.counters
        # the same prefill worker still serves: a long prompt is prefilled remotely over shm
        await w.fresh_load(DECODE)
        await asyncio.sleep(1.2)
        (toks, last), = await run_all(w.bus, DECODE, [list(range(100, 180))], max_tokens=4)
        assert len(toks) == 4 and last.finish_reason == "length"
        dec = await w.fresh_load(DECODE)
        assert dec.counters.get("remote_prefill_done", 0) == 1, dec.counters
        assert digest(victim) == before
    finally:
        link.unlink(missing_ok=True)
        await w.close()

