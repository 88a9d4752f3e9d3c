"""A worker's KV events on a real nats-server: at most one batch per interval, none lost.

The mocker engine steps on the event loop (``InlineEngineLoop``, as ``mesh worker mock`` runs
it), and in a thread of its own (``EngineLoop``, as a model worker's engine), with the publisher
as its after-work hook, as ``WorkerBase`` wires them. Many steps that
touch the cache within one interval go out as few batches, numbered without gaps, and a router
index fed those batches holds exactly the engine's cached blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from engine.loop import EngineLoop, InlineEngineLoop
from engine.sampling import SamplingParams
from mesh import kvevents
from mesh.bus import Bus
from mesh.kvevents import KvEventPublisher
from mesh.protocol import KvEventBatch
from mesh.router.index import KvIndex
from mocker.engine import MockConfig, MockEngine, TimingModel


@pytest.mark.parametrize("loop_type", [InlineEngineLoop, EngineLoop])  # the mocker's, a model worker's
async def test_batches_are_coalesced_per_interval_and_lose_nothing(nats_server, loop_type, monkeypatch):
    # when the publisher numbers each batch, on its own clock: arrival times carry the bus's and
    # the scheduler's delays (on a loaded machine two batches arrived 29 ms apart), numbering does not
    numbered_at: list[float] = []

    def numbered(*args):
        numbered_at.append(time.monotonic())
        return KvEventBatch(*args)

    monkeypatch.setattr(kvevents, "KvEventBatch", numbered)
    bus = await Bus.connect(nats_server.url, "kv-events-test")
    listener = await Bus.connect(nats_server.url, "kv-events-listener")
    engine = MockEngine(MockConfig(model_name="kvb", speedup=1000, num_blocks=512, block_size=16))
    batches: list[tuple[float, KvEventBatch]] = []

    async def on_batch(batch: KvEventBatch, raw) -> None:
        batches.append((time.monotonic(), batch))

    sub = await listener.subscribe(listener.subjects.kv_events("kvb", "w1"), on_batch, KvEventBatch)
    await listener.nc.flush()
    interval = 0.05
    publisher = KvEventPublisher(bus, "w1", "kvb", interval)
    loop = loop_type(engine, asyncio.get_running_loop(), after_work=publisher.flush)
    await publisher.start(loop)
    loop.start()
    try:
        def add(e: MockEngine, i: int) -> None:
            prompt = [(31 * i + j) % 30000 + 1 for j in range(100)]
            e.add(e.new_sequence(prompt, SamplingParams(max_tokens=60, ignore_eos=True), request_id=f"r{i}"))

        t0 = time.monotonic()
        for i in range(24):
            await loop.call(lambda e, i=i: add(e, i))
        while await loop.call(lambda e: e.has_work):
            await asyncio.sleep(0.01)
        elapsed = time.monotonic() - t0
        snapshot = await loop.call(lambda e: e.kv_snapshot())
        await asyncio.sleep(3 * interval)  # the last batch
        await listener.nc.flush()
        for _ in range(100):
            if batches and sum(len(b.events) for _, b in batches) and batches[-1][1].seq == publisher.seq:
                break
            await asyncio.sleep(0.02)
    finally:
        loop.stop()
        await publisher.stop()
        await sub.unsubscribe()
        await bus.close()
        await listener.close()

    assert engine.num_steps > 50
    seqs = [b.seq for _, b in batches]
    assert seqs == list(range(1, len(seqs) + 1))  # numbered without gaps: nothing skipped
    # one batch per interval at most (the first goes at once), far fewer than the steps
    assert len(batches) <= elapsed / interval + 3 < engine.num_steps
    assert len(numbered_at) == len(batches)
    gaps = [b - a for a, b in itertools.pairwise(numbered_at)]
    assert all(g >= interval - 0.001 for g in gaps), gaps  # the recorded time trails the decision by microseconds
    index = KvIndex()
    index.load_snapshot("w1", 0, {})  # a router that knew the worker from its start
    for _, b in batches:
        assert index.apply(b)
    cached = {h for hashes in snapshot.values() for h in hashes}
    assert cached and index.num_blocks("w1") == len(cached)


async def test_a_process_workers_batches_of_one_turn_go_as_one_message_and_each_is_applied(nats_server):
    """Three mock workers of one process (one loop, one KvBatcher, as ``worker.host`` wires them):
    their batches arrive only on the process's ``kv.batches`` subject, fewer messages than batches,
    each worker's numbered without gaps, and a router index fed them holds each engine's cache."""
    from mesh.kvevents import KvBatcher
    from mesh.protocol import KvEventBatches

    bus = await Bus.connect(nats_server.url, "kv-batches-test")
    listener = await Bus.connect(nats_server.url, "kv-batches-listener")
    got: list[KvEventBatches] = []
    alone: list[KvEventBatch] = []

    async def on_together(msg: KvEventBatches, raw) -> None:
        got.append(msg)

    async def on_alone(batch: KvEventBatch, raw) -> None:
        alone.append(batch)

    subs = [await listener.subscribe(listener.subjects.kv_batches("kvb", "proc"), on_together, KvEventBatches),
            await listener.subscribe(listener.subjects.kv_events_all("kvb"), on_alone, KvEventBatch)]
    await listener.nc.flush()
    together = KvBatcher(bus, "proc")
    workers = [f"w{i}" for i in range(3)]
    # every step 10 ms, on the process's step grid (--mock-step-grid-ms), as the bench's: each step's
    # batches are numbered in one turn (the interval, 1 ms, is shorter than a step)
    timing = TimingModel(decode_base_ms=10, decode_ms_per_seq=0, decode_ms_per_kv_token=0, prefill_base_ms=10,
                         prefill_ms_per_token=0, prefill_ms_per_token_ctx=0)
    engines = {w: MockEngine(MockConfig(model_name="kvb", num_blocks=512, block_size=16, timing=timing,
                                        step_grid_ms=10)) for w in workers}
    publishers = {w: KvEventPublisher(bus, w, "kvb", 0.001, together=together) for w in workers}
    loops = {w: InlineEngineLoop(engines[w], asyncio.get_running_loop(), after_work=publishers[w].flush)
             for w in workers}
    for w in workers:
        await publishers[w].start(loops[w])
        loops[w].start()
    try:
        for i in range(12):
            for k, w in enumerate(workers):
                prompt = [(31 * i + 7 * k + j) % 30000 + 1 for j in range(80)]
                await loops[w].call(lambda e, p=prompt, i=i: e.add(e.new_sequence(
                    p, SamplingParams(max_tokens=20, ignore_eos=True), request_id=f"r{i}")))
        for w in workers:
            while await loops[w].call(lambda e: e.has_work):
                await asyncio.sleep(0.01)
        snapshots = {w: await loops[w].call(lambda e: e.kv_snapshot()) for w in workers}
        await asyncio.sleep(0.1)  # the last events wait out the interval, then are numbered
        for _ in range(100):
            await listener.nc.flush()
            last = {b.worker_id: b.seq for m in got for b in m.batches}
            if all(last.get(w) == publishers[w].seq for w in workers):
                break
            await asyncio.sleep(0.05)
    finally:
        for w in workers:
            loops[w].stop()
            await publishers[w].stop()
        for sub in subs:
            await sub.unsubscribe()
        await bus.close()
        await listener.close()

    batches = [b for m in got for b in m.batches]
    assert not alone and len(got) < len(batches) and together.sent == len(got)
    index = KvIndex()
    for w in workers:
        seqs = [b.seq for b in batches if b.worker_id == w]
        assert seqs == list(range(1, publishers[w].seq + 1))  # each worker's own numbers, no gap
        index.load_snapshot(w, 0, {})
    for b in batches:
        assert index.apply(b)
    for w in workers:
        cached = {h for hashes in snapshots[w].values() for h in hashes}
        assert cached and index.num_blocks(w) == len(cached)
