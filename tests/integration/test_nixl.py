"""The ``nixl`` KV transport between two workers that act as two hosts (``MESH_HOST_ID``): real
nats-server, real decode and prefill worker processes, ``--transports nixl,nats``.

- Greedy output through a prefill -> decode pair over nixl equals the single-process engine's,
  every long prompt crossed nixl (counters of both sides, the transfer metric by transport).
- Forged descriptors through real jobs (memory the decode worker never registered, a block out
  of range, an agent that is not the worker's) are refused, logged and counted, and the same
  prefill worker goes on serving over nixl.
- A write that ends after the job's deadline (``MESH_FAULT_KV_COPY_DELAY_S``): the request
  prefills locally at the deadline, the written blocks stay fenced until the write's
  notification or its PrefillDone, then come back; tokens stay the engine's.
- The fence contract on its own (two agents in this process): a job never granted revokes at
  once and its writer is refused; a granted one only after its notification.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import uuid

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.prefill_queue import PrefillQueue
from mesh.protocol import PrefillDone, PrefillJob
from tests.helpers.cluster import Watcher, run_all

pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")

THRESHOLD = 64
LENGTHS = [20, 70, 130, 200, 333]
MAX_TOKENS = 8


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineConfig(tiny_model, num_kv_blocks=256))


def expected(engine, p: list[int], n: int = MAX_TOKENS) -> list[int]:
    return engine.generate([p], SamplingParams(max_tokens=n, temperature=0.0))[0].output_token_ids


def pair(cluster, tiny_model, tag: str, blocks: int, prefill_env: dict | None = None, *decode_flags: str):
    """A decode and a prefill worker on two simulated hosts, in namespace ``tag``."""
    flags = ["--model", str(tiny_model), "--device-kv-blocks", str(blocks), "--transports", "nixl,nats",
             "--ns", tag]
    cluster.worker("decode", *flags, "--worker-id", f"dec-{tag}", "--disagg-threshold", str(THRESHOLD),
                   *decode_flags, env={"MESH_HOST_ID": f"host-a-{tag}"})
    cluster.worker("prefill", *flags, "--worker-id", f"pre-{tag}", "--prefill-capacity", "8",
                   env={"MESH_HOST_ID": f"host-b-{tag}", **(prefill_env or {})})


async def ready(cluster, tag: str) -> Watcher:
    w = await Watcher.open(cluster.nats_url, ns=tag)
    await w.wait_for(lambda: w.membership.get(f"dec-{tag}") and w.membership.get(f"pre-{tag}"), 120, "both workers")
    await w.fresh_load(f"pre-{tag}")  # the decode worker hears the prefill worker's load too
    await asyncio.sleep(1.2)
    return w


def forged_job(params: dict, blocks: list[int]) -> PrefillJob:
    return PrefillJob(request_id=f"forged-{uuid.uuid4().hex[:8]}", model="tiny", token_ids=list(range(3, 35)),
                      decode_worker="ghost", num_cached_tokens=0, dest_block_ids=blocks,
                      transports={"nixl": params}, deadline=time.time() + 30, block_size=16)


async def test_greedy_output_over_nixl_and_forged_descriptors_refused(cluster, tiny_model, engine):
    pair(cluster, tiny_model, "nx", 512)
    w = await ready(cluster, "nx")
    try:
        card = w.membership.get("dec-nx")
        assert card.transports["nixl"]["agent"].startswith("dec-nx-")
        assert card.transports["nixl"]["host"] == "host-a-nx"
        prompts = [prompt(n, i) for i, n in enumerate(LENGTHS)]
        results = await run_all(w.bus, "dec-nx", prompts, max_tokens=MAX_TOKENS)
        for p, (toks, last) in zip(prompts, results, strict=True):
            assert toks == expected(engine, p), f"prompt of {len(p)} tokens differs"
            assert last.finish_reason == "length"
        long_ones = sum(1 for n in LENGTHS if n >= THRESHOLD)
        dec, pre = await w.fresh_load("dec-nx"), await w.fresh_load("pre-nx")
        assert dec.counters.get("transport_nixl") == long_ones, dec.counters
        # each PrefillDone came in the write's notification (the one over NATS came second)
        assert dec.counters.get("carried_prefill_done") == long_ones, dec.counters
        assert pre.counters.get("transport_nixl") == long_ones and not pre.counters.get("transport_nats"), pre.counters
        assert dec.kv_blocks_used == 0 and dec.running == 0

        # Forged jobs against the real decode worker's agent.
        done: list[PrefillDone] = []

        async def on_done(msg: PrefillDone, raw) -> None:
            done.append(msg)

        await w.bus.subscribe(w.bus.subjects.kv_ready("tiny", "ghost"), on_done, PrefillDone)
        s = w.bus.subjects
        real = {"agent": card.transports["nixl"]["agent"], "host": "host-a-nx", "rev": 1,
                "md": s.nixl("tiny", "dec-nx", "md"), "begin": s.nixl("tiny", "dec-nx", "begin"),
                "num_blocks": 512, "layers": engine.kv_cache.spec.num_layers, "block_size": 16,
                "heads": engine.kv_cache.spec.num_kv_heads, "head_dim": engine.kv_cache.spec.head_dim,
                "dtype": "float32", "gen": 1, "addr": 0x10000, "size": 512 * engine.kv_cache.spec.block_bytes}
        jobs = [
            forged_job(real, [0, 1]),  # memory it never registered
            forged_job({**real, "agent": "ghost-agent"}, [0, 1]),  # an agent it does not know
            forged_job({**real, "addr": "0x10000"}, [0, 1]),  # not flat/typed
        ]
        queue = PrefillQueue(w.bus, "tiny")
        for job in jobs:
            await queue.publish(job)
        await w.wait_for(lambda: len(done) == len(jobs), 30, "an answer to every forged job")
        errors = {d.request_id: d.error for d in done}
        assert all(not d.ok for d in done)
        assert "never registered" in errors[jobs[0].request_id], errors
        assert "ghost-agent" in errors[jobs[1].request_id], errors
        assert "refused: nixl" in errors[jobs[2].request_id], errors
        pre = await w.fresh_load("pre-nx")
        assert pre.counters.get("refused_jobs") == len(jobs), pre.counters
        # the same prefill worker still serves over nixl
        p = prompt(150, 99)
        ((toks, _),) = await run_all(w.bus, "dec-nx", [p], max_tokens=MAX_TOKENS)
        assert toks == expected(engine, p)
        dec = await w.fresh_load("dec-nx")
        assert dec.counters.get("transport_nixl") == long_ones + 1, dec.counters
    finally:
        await w.close()


DELAY = 4.0  # the late write waits this long after its grant, seconds
TIMEOUT = 1.5  # the decode worker's --prefill-timeout


async def test_a_late_nixl_write_is_fenced_until_it_lands(cluster, tiny_model, engine):
    pair(cluster, tiny_model, "nxf", 64, {"MESH_FAULT_KV_COPY_DELAY_S": str(DELAY)},
         "--prefill-timeout", str(TIMEOUT))
    w = await ready(cluster, "nxf")
    try:
        p = prompt(150, 7)  # 10 blocks for the prefill worker to write
        ((toks, last),) = await run_all(w.bus, "dec-nxf", [p], max_tokens=MAX_TOKENS)
        assert toks == expected(engine, p) and last.finish_reason == "length"
        c = (await w.fresh_load("dec-nxf")).counters
        assert c.get("local_prefill_fallback") == 1 and c.get("fenced_jobs") == 1, c
        # the late write had not landed yet: it fell back at the deadline, not after the write
        assert not c.get("unfenced_jobs"), c
        report = await w.wait_for(lambda: (r := w.loads.get("dec-nxf")) and r.counters.get("unfenced_jobs") and r,
                                  DELAY + 10, "the fenced blocks back in the pool")
        assert report.kv_blocks_used == 0
        ((toks, _),) = await run_all(w.bus, "dec-nxf", [p], max_tokens=MAX_TOKENS)
        assert toks == expected(engine, p)  # from its cached blocks: the late write landed in none of them
    finally:
        await w.close()


@contextlib.asynccontextmanager
async def agents_in_one_process(url: str, tag: str):
    """Two nixl agents in this process on a real nats-server: ``(bus, spec, dst, src, rx, tx)``,
    ``rx`` receiving into ``dst`` as worker ``<tag>-dec``, ``tx`` sending from ``src`` (random
    bytes) as ``<tag>-pre``."""
    import torch

    from kvstore.cache import KVCache, KVCacheSpec
    from kvstore.transfer import make_receiver, make_sender
    from mesh.bus import Bus

    bus = await Bus.connect(url, f"test-nixl-{tag}", ns=f"nx{tag}")
    try:
        spec = KVCacheSpec(2, 16, 4, 2, 8, torch.float32)
        dst, src = KVCache(spec, torch.device("cpu")), KVCache(spec, torch.device("cpu"))
        src.tensor.normal_()
        rx = make_receiver("nixl", kv=dst, bus=bus, model="m", worker_id=f"{tag}-dec")
        await rx.start()
        yield bus, spec, dst, src, rx, make_sender("nixl", bus=bus, worker_id=f"{tag}-pre")
    finally:
        await bus.close()


async def test_revoke_waits_for_a_granted_write_and_refuses_one_not_yet_granted(nats_server):
    """The fence contract in one process (two agents, a real nats-server): blocks of a job never
    granted are free at once and its writer is refused; a granted job's blocks are not, until
    the write's notification has come; the bytes land intact in the named blocks only."""
    import torch

    from kvstore.transfer import Refused, TransferTarget
    from tests.helpers.cluster import wait_until

    async with agents_in_one_process(nats_server.url, "fence") as (bus, spec, dst, src, rx, tx):
        params = rx.params("r1", [5, 6, 7, 2])
        result = await tx.send(TransferTarget("r1", "fence-dec", [5, 6, 7, 2], 4), params, src, [0, 1, 2, 9])
        assert result.chunks == 2 * 2 * 2  # (layer, K|V) planes x runs [5,6,7] and [2]
        assert await rx.finish("r1") and rx.revoke("r1")
        for s, d in zip([0, 1, 2, 9], [5, 6, 7, 2], strict=True):
            assert torch.equal(dst.tensor[:, :, d], src.tensor[:, :, s])
        assert dst.tensor[:, :, [0, 1, 3, 4, 8]].abs().sum() == 0  # nothing else written

        params = rx.params("r2", [1])
        assert rx.revoke("r2")  # never granted: free at once, and no write will start
        with pytest.raises(RuntimeError, match="no write grant"):
            await tx.send(TransferTarget("r2", "fence-dec", [1], 4), params, src, [3])
        assert dst.tensor[:, :, 1].abs().sum() == 0

        params = rx.params("r3", [4])
        await tx.node.ask_grant(bus, params["begin"], "kv", "r3", params["gen"])  # granted, not yet written
        assert not rx.revoke("r3")  # a write may still land
        target = TransferTarget("r3", "fence-dec", [4], 4)
        dest = await tx._destination(target, params, spec)
        ((_, peer, dst_region),) = dest
        agents = await tx._source(src)
        (pair,) = tx._plan(target, src, [3], agents, dest, params["num_blocks"])
        await tx.node.write(peer, agents[0].region, pair.local, dst_region, pair.remote,
                            f"kv:r3:{params['gen']}".encode())
        await wait_until(lambda: rx.revoke("r3"), 5, "the write's notification")
        with pytest.raises(Refused):  # a block past the pool
            await tx._destination(TransferTarget("r4", "fence-dec", [16], 4), rx.params("r4", [16]), spec)


async def test_the_prefill_done_rides_in_the_notification_after_the_bytes(nats_server):
    """``send(..., done=)``: the receiver's ``on_done`` gets the payload, byte for byte (NULs and
    colons in the job id and the payload included), once the bytes are in its blocks and the job
    is done; a carried payload for a job that is not ours, or one too large, is dropped (the
    NATS PrefillDone still counts); a plain notification calls nothing."""
    import torch

    from kvstore.transfer import TransferTarget
    from kvstore.transfer.nixl_agent import CARRY_MAX, REFUSED, carried, carrying, notif_key
    from tests.helpers.cluster import wait_until

    async with agents_in_one_process(nats_server.url, "carry") as (_, _s, dst, src, rx, tx):
        got: list[tuple[str, bytes, bool]] = []
        rx.on_done = lambda rid, payload: got.append((rid, payload, torch.equal(dst.tensor[:, :, [2, 3]],
                                                                                  src.tensor[:, :, [5, 6]])))
        rid, payload = "c:1\0x", b"\0done:" + bytes(range(256))
        target = TransferTarget(rid, "carry-dec", [2, 3], 4)
        params = rx.params(rid, [2, 3])
        await tx.send(target, params, src, [5, 6], done=payload)
        await wait_until(lambda: got, 5, "the carried PrefillDone")
        assert got == [(rid, payload, True)]  # the bytes were in the blocks when it came
        assert rx.revoke(rid) and await rx.finish(rid)  # done: the job is over on both counts

        params = rx.params("c2", [7])
        await tx.send(TransferTarget("c2", "carry-dec", [7], 4), params, src, [1])  # no payload
        assert await rx.finish("c2") and len(got) == 1

        key = notif_key("kv", "nobody", 1)  # not a job of ours: nothing is called
        assert carried(carrying(key, b"x")) == (key, b"x") and carried(key) == (key, b"")
        rx.node._deliver({tx.node.name: [carrying(key, b"x")]})
        before = REFUSED.labels("oversized")._value.get()
        params = rx.params("c3", [8])
        rx.grants.jobs["c3"].state = rx.grants.jobs["c3"].state.WRITING
        rx.grants.jobs["c3"].writer = tx.node.name
        rx.node._deliver({tx.node.name: [carrying(notif_key("kv", "c3", params["gen"]), b"y" * (CARRY_MAX + 1))]})
        assert len(got) == 1 and REFUSED.labels("oversized")._value.get() == before + 1
        before = REFUSED.labels("unknown_agent")._value.get()
        params = rx.params("c4", [9])  # granted to another agent: a payload from us ends nothing
        rx.grants.jobs["c4"].state = rx.grants.jobs["c4"].state.WRITING
        rx.grants.jobs["c4"].writer = "carry-other-1234"
        rx.node._deliver({tx.node.name: [carrying(notif_key("kv", "c4", params["gen"]), b"z")]})
        assert len(got) == 1 and REFUSED.labels("unknown_agent")._value.get() == before + 1
        assert not rx.revoke("c4")  # still writing: its own writer's word is awaited


async def test_a_grant_asked_ahead_holds_the_blocks_until_its_write_or_its_writer_leaving(nats_server):
    """Grant ahead (``prepare``, as the prefill worker asks it when it takes a job): the bytes land
    as before, and the job's blocks are held from the grant on, not from the write; a writer that
    leaves the registry (``writer_left``) lets its granted jobs go, another worker leaving does
    not, and an orphaned job is granted to nobody again. A job ``prepare`` refuses is never granted."""
    import torch

    from kvstore.transfer import Refused, TransferTarget

    async with agents_in_one_process(nats_server.url, "ahead") as (bus, _, dst, src, rx, tx):
        target = TransferTarget("a1", "ahead-dec", [3, 4], 4)
        params = rx.params("a1", [3, 4])
        tx.prepare(target, params, src)
        await asyncio.wait_for(asyncio.shield(tx.grants[("a1", params["gen"])]), 5)  # granted
        assert not rx.revoke("a1")  # the blocks are held from the grant on, before any byte
        await tx.send(target, params, src, [7, 8])
        assert await rx.finish("a1") and rx.revoke("a1")
        assert torch.equal(dst.tensor[:, :, [3, 4]], src.tensor[:, :, [7, 8]])

        target = TransferTarget("a2", "ahead-dec", [9], 4)
        params = rx.params("a2", [9])
        tx.prepare(target, params, src)
        await asyncio.wait_for(asyncio.shield(tx.grants[("a2", params["gen"])]), 5)
        assert not rx.revoke("a2")
        assert rx.writer_left("someone-else") == 0 and not rx.revoke("a2")
        assert rx.writer_left("ahead-pre") == 1 and rx.revoke("a2")  # its writer left: the blocks are free
        with pytest.raises(RuntimeError, match="orphaned"):  # and nobody gets the job granted again
            await tx.node.ask_grant(bus, params["begin"], "kv", "a2", params["gen"])

        target = TransferTarget("a3", "ahead-dec", [16], 4)  # a block past the pool
        params = rx.params("a3", [16])
        tx.prepare(target, params, src)
        with pytest.raises(Refused):
            await tx.send(target, params, src, [1])
        assert rx.revoke("a3")  # never granted


async def test_a_prefill_worker_killed_holding_a_grant_frees_the_blocks_when_it_leaves(cluster, tiny_model, engine):
    """The prefill worker takes the job (its write grant asked at once), then hangs before writing
    (``MESH_FAULT_PREFILL_DELAY_S``) and is killed: the request prefills locally at its deadline,
    its blocks stay fenced (a granted write may land) until the registry says the worker left,
    then come back."""
    import signal

    flags = ["--model", str(tiny_model), "--device-kv-blocks", "64", "--transports", "nixl,nats", "--ns", "nxk"]
    cluster.worker("decode", *flags, "--worker-id", "dec-nxk", "--disagg-threshold", str(THRESHOLD),
                   "--prefill-timeout", str(TIMEOUT), env={"MESH_HOST_ID": "host-a-nxk"})
    pre = cluster.worker("prefill", *flags, "--worker-id", "pre-nxk", "--prefill-capacity", "8",
                         env={"MESH_HOST_ID": "host-b-nxk", "MESH_FAULT_PREFILL_DELAY_S": "120"})
    w = await ready(cluster, "nxk")
    try:
        p = prompt(150, 11)
        ((toks, _),) = await run_all(w.bus, "dec-nxk", [p], max_tokens=MAX_TOKENS)
        assert toks == expected(engine, p)  # prefilled locally at the deadline
        c = (await w.fresh_load("dec-nxk")).counters
        assert c.get("fenced_jobs") == 1 and not c.get("unfenced_jobs"), c
        pre.send_signal(signal.SIGKILL)
        report = await w.wait_for(lambda: (r := w.loads.get("dec-nxk")) and r.counters.get("unfenced_jobs") and r,
                                  30, "the fenced blocks back once the prefill worker left")
        assert report.kv_blocks_used == 0
    finally:
        await w.close()


def _drops(ages: list[float]) -> int:
    """How often the card's age fell back: a put that reached the registry."""
    return sum(b < a for a, b in itertools.pairwise(ages))


async def _card_ages(cards, until, timeout: float = 20.0) -> list[float]:
    """The card's age, read every 20 ms until ``until(ages)`` (or ``timeout``, then an error)."""
    ages = [cards.age()]
    async with asyncio.timeout(timeout):
        while not until(ages):
            await asyncio.sleep(0.02)
            ages.append(cards.age())
    return ages


async def test_a_workers_card_ages_once_the_registry_is_out_of_reach():
    """The writer's half of ``writer_left``: a prefill worker writes only while its card is fresh
    (``CARD_FRESH`` of the TTL), since at the TTL decode workers count it gone and free the blocks
    of its grants. The card's age stays under a refresh period while the registry answers, and
    grows past that share once the server is gone (a partition looks the same from inside)."""
    from mesh.bus import Bus
    from mesh.natsserver import EmbeddedNats
    from mesh.protocol import WorkerCard
    from mesh.registry import CardPublisher
    from prefill.worker import CARD_FRESH

    ttl = 0.9
    nats = EmbeddedNats().start()
    bus = await Bus.connect(nats.url, "test-card-age")
    card = WorkerCard(worker_id="aging", role="prefill", model="tiny", block_size=16, kv_blocks=64,
                      max_model_len=512, host="h", pid=1, started=time.time(), updated=time.time())
    cards = CardPublisher(bus, lambda: card, ttl=ttl)
    try:
        await cards.start()
        # refreshed while the registry answers: the age falls back (a put landed) again and again
        ages = await _card_ages(cards, until=lambda ages: _drops(ages) >= 4)
        assert _drops(ages) >= 4
        nats.stop()
        # once it is gone, no put lands: the age only grows, past the share of the TTL a writer needs
        ages = await _card_ages(cards, until=lambda ages: ages[-1] > ttl)
        assert ages[-1] > ttl * CARD_FRESH and _drops(ages) == 0, ages
    finally:
        with contextlib.suppress(Exception):  # the server is gone: nothing to delete the card from
            await cards.stop()
        with contextlib.suppress(Exception):
            await bus.close()
        nats.stop()
