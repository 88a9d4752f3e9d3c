"""The disaggregated mesh with real processes: a nats-server, decode and prefill workers.

Every long prompt is prefilled by the prefill worker and its KV crosses a real
transport (shm, then nats) into the decode worker's blocks; the greedy output
must equal the single-process engine's (what ``mesh generate`` runs).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.helpers.cluster import Watcher, run_all
from tests.helpers.references import prompts_of

THRESHOLD = 64
LENGTHS = [5, 12, 20, 33, 48, 63, 64, 70, 90, 128, 150, 200, 256, 300, 333, 400, 450, 512, 600, 700]


def prompts(seed: int = 0):
    return prompts_of(LENGTHS, 4096, seed, low=3)


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=2048))
    ps = prompts()
    seqs = engine.generate(ps, SamplingParams(max_tokens=16, temperature=0.0))
    return {tuple(p): s.output_token_ids for p, s in zip(ps, seqs, strict=True)}, engine


TRANSPORTS = ("shm", "nats")


@pytest.fixture(scope="module")
def split_workers(cluster, tiny_model) -> None:
    """One decode worker per transport (``dec-shm``, ``dec-nats``: each offers only its own) and one
    prefill worker ``pre`` for both (it sends over the transport the job's decode worker offers), all
    registered, the decode workers having heard the prefill worker's load."""
    flags = ["--model", str(tiny_model), "--device-kv-blocks", "2048"]
    for transport in TRANSPORTS:
        cluster.worker("decode", *flags, "--transports", transport, "--disagg-threshold", str(THRESHOLD),
                       "--worker-id", f"dec-{transport}")
    # room for every long prompt at once, so none is prefilled locally for lack of capacity
    cluster.worker("prefill", *flags, "--transports", ",".join(TRANSPORTS), "--worker-id", "pre",
                   "--prefill-capacity", "16")

    async def ready():
        w = await Watcher.open(cluster.nats_url)
        try:
            names = ("pre", *(f"dec-{t}" for t in TRANSPORTS))
            await w.wait_for(lambda: all(w.membership.get(x) for x in names), 120, "the workers")
            await w.fresh_load("pre")  # the decode workers hear prefill load reports too
            await asyncio.sleep(1.2)
        finally:
            await w.close()

    asyncio.run(ready())


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_disaggregated_output_is_token_identical(cluster, reference, split_workers, transport):
    expected, _ = reference
    w = await Watcher.open(cluster.nats_url)
    try:
        results = await run_all(w.bus, f"dec-{transport}", prompts())
        for p, (toks, last) in zip(prompts(), results, strict=True):
            assert toks == expected[tuple(p)], f"prompt of {len(p)} tokens differs"
            assert last.finish_reason == "length" and last.usage.prompt_tokens == len(p)
        long_ones = sum(1 for n in LENGTHS if n >= THRESHOLD)
        dec = await w.fresh_load(f"dec-{transport}")
        pre = await w.fresh_load("pre")
        assert dec.counters.get("remote_prefill_done", 0) == long_ones, dec.counters
        assert dec.counters.get(f"transport_{transport}", 0) == long_ones
        assert dec.counters.get("local_prefill", 0) == len(LENGTHS) - long_ones
        assert pre.counters.get(f"transport_{transport}", 0) == long_ones, pre.counters  # this decode worker's only
        assert dec.kv_blocks_used == 0 and dec.running == 0  # every block came back
    finally:
        await w.close()


async def test_shared_prefix_is_served_from_the_decode_cache(cluster, reference, split_workers):
    _, engine = reference
    w = await Watcher.open(cluster.nats_url)
    try:
        await w.wait_for(lambda: w.membership.get("dec-shm"), what="the shm decode worker")
        rng = random.Random(7)
        prefix = [rng.randrange(3, 4096) for _ in range(400)]
        first = [*prefix, 11, 12, 13]
        second = [*prefix, 21, 22, 23, 24, 25]
        (t1, _l1), = await run_all(w.bus, "dec-shm", [first])
        (t2, l2), = await run_all(w.bus, "dec-shm", [second])
        assert l2.usage.cached_tokens >= 384  # the 24 full blocks of the shared prefix
        ref = engine.generate([first, second], SamplingParams(max_tokens=16, temperature=0.0))
        assert [t1, t2] == [s.output_token_ids for s in ref]
    finally:
        await w.close()


async def test_prefill_worker_killed_mid_job_loses_no_request(cluster, tiny_model, reference):
    _, engine = reference
    # a namespace of its own: no other prefill worker may take this job
    flags = ["--ns", "fault", "--model", str(tiny_model), "--device-kv-blocks", "1024", "--transports", "shm"]
    cluster.worker("decode", *flags, "--disagg-threshold", str(THRESHOLD), "--prefill-timeout", "3",
                   "--worker-id", "dec-fault")
    victim = cluster.worker("prefill", *flags, "--worker-id", "pre-fault", "--prefill-capacity", "1",
                            env={"MESH_FAULT_PREFILL_DELAY_S": "60"})
    w = await Watcher.open(cluster.nats_url, ns="fault")
    try:
        await w.wait_for(lambda: w.membership.get("dec-fault") and w.membership.get("pre-fault"), what="workers")
        await w.fresh_load("pre-fault")
        await asyncio.sleep(1.2)
        p = prompts(3)[-1]
        task = asyncio.create_task(run_all(w.bus, "dec-fault", [p]))
        # the prefill worker holds the job (computed, waiting to transfer): kill it now
        await w.wait_for(lambda: (r := w.loads.get("pre-fault")) and r.active_jobs == 1, 30, "the job to start")
        os.kill(victim.pid, signal.SIGKILL)
        ((toks, last),) = await asyncio.wait_for(task, 60)
        (ref,) = engine.generate([p], SamplingParams(max_tokens=16, temperature=0.0))
        assert toks == ref.output_token_ids and last.finish_reason == "length"
        dec = await w.fresh_load("dec-fault")
        assert dec.counters.get("remote_prefill_timeout", 0) == 1
        assert dec.counters.get("local_prefill_fallback", 0) == 1
        # and the dead worker's card leaves the registry within the TTL
        await w.wait_for(lambda: w.membership.get("pre-fault") is None, 15, "the card to expire")
    finally:
        await w.close()
