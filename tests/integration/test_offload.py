"""KV offload through a real decode worker process: a 48-block device pool, a host tier, and
multi-turn conversations that do not fit the device. Every later turn's history comes back
from the host tier: the usage reports it as cached tokens, the greedy output equals an
unlimited in-process engine's, the worker's KV events carry the host tier, its load report
counts host hits, and its snapshot lists its host blocks.

The load-report and snapshot checks need the two hooks in worker/base.py (``load()``:
``**engine.kv_counters()``) and mesh/kvevents.py (``take_snapshot``: ``engine.kv_snapshot()``).
"""

from __future__ import annotations

import random

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.protocol import (
    KvEventBatch,
    KvSnapshot,
    KvSnapshotRequest,
)
from tests.helpers.cluster import Watcher, stream_tokens

WORKER = "dec-offload"
CONVS, FIRST, USER, ANSWER, TURNS = 6, 150, 30, 8, 3


def conversation_parts(seed: int = 11):
    rng = random.Random(seed)
    firsts = [[rng.randrange(3, 4096) for _ in range(FIRST)] for _ in range(CONVS)]
    users = [[[rng.randrange(3, 4096) for _ in range(USER)] for _ in range(CONVS)] for _ in range(TURNS)]
    return firsts, users


def reference(tiny_model):
    """(outputs, cached tokens) per request, in order, on an unlimited pool."""
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=2048))
    firsts, users = conversation_parts()
    histories, outs, cached = [list(f) for f in firsts], [], []
    for t in range(TURNS):
        for i in range(CONVS):
            (s,) = engine.generate([histories[i]], SamplingParams(max_tokens=ANSWER, temperature=0.0))
            outs.append(s.output_token_ids)
            cached.append(s.num_cached_tokens)
            histories[i] = [*histories[i], *s.output_token_ids, *users[t][i]]
    return outs, cached


async def ask(bus, tokens):
    toks, last = await stream_tokens(bus, WORKER, tokens, ANSWER)
    return toks, last.usage.cached_tokens


async def test_multi_turn_history_comes_back_from_the_host_tier(cluster, tiny_model):
    expected_outs, expected_cached = reference(tiny_model)
    cluster.worker("decode", "--model", str(tiny_model), "--device-kv-blocks", "48", "--host-kv-gb", "0.01",
                   "--transports", "shm", "--worker-id", WORKER)
    w = await Watcher.open(cluster.nats_url)
    tiers_seen: dict[tuple[str, str], int] = {}

    async def on_events(batch: KvEventBatch, raw) -> None:
        for ev in batch.events:
            key = (ev.kind, ev.tier)
            tiers_seen[key] = tiers_seen.get(key, 0) + len(ev.hashes)

    try:
        await w.wait_workers("decode", 1)
        await w.bus.subscribe(w.bus.subjects.kv_events("tiny", WORKER), on_events, KvEventBatch)
        firsts, users = conversation_parts()
        histories, outs, cached = [list(f) for f in firsts], [], []
        for t in range(TURNS):
            for i in range(CONVS):
                toks, n_cached = await ask(w.bus, histories[i])
                outs.append(toks)
                cached.append(n_cached)
                histories[i] = [*histories[i], *toks, *users[t][i]]
        assert outs == expected_outs
        assert cached == expected_cached and sum(cached[CONVS:]) > 0
        # six histories of ~10-14 blocks each cycle through 48 device blocks: the hits came from the host
        report = await w.fresh_load(WORKER)
        c = report.counters
        assert c.get("hit_blocks_host", 0) > 0 and c.get("host_blocks", 0) > 0, c
        assert c["hit_blocks_host"] + c.get("hit_blocks_device", 0) == sum(cached) // 16
        await w.wait_for(lambda: tiers_seen.get(("stored", "host"), 0) > 0, 10, "host-tier KV events")
        assert tiers_seen.get(("removed", "device"), 0) > 0
        snap = await w.bus.request(w.bus.subjects.kv_snapshot("tiny", WORKER), KvSnapshotRequest(0), KvSnapshot, 10)
        assert len(snap.blocks.get("host", [])) == c["host_blocks"]
        assert len(snap.blocks.get("device", [])) == c["device_blocks"]
    finally:
        await w.close()
