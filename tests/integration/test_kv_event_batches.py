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
from mocker.engine import MockConfig, MockEngine


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
