"""The router of ``python -m bench scale`` alone: ``KvRouter`` as the gateway runs it, at 1,000 workers
with 1M blocks indexed, fed as the bus feeds it (wire batches, decoded), then timed decision by
decision (wall and this thread's CPU: on a shared machine the wall p99 is the scheduler's)."""

from __future__ import annotations

import os
import random
import statistics
import time


def router_at_scale(workers: int, blocks: int):
    """``KvRouter`` as the gateway runs it, fed ``workers`` x ``blocks`` blocks as wire batches: each
    worker a 64-block system prompt all share and conversations of its own. Returns the router,
    the system prompt, each worker's first conversation, and the seconds the batches took to index."""
    import gc

    from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
    from mesh.protocol import KvEvent, KvEventBatch, LoadReport, WorkerCard, decode, encode
    from mesh.registry import Membership
    from mesh.router.policy import RouterConfig
    from mesh.router.router import KvRouter

    class Members(Membership):
        def __init__(self, cards):
            super().__init__(bus=None)
            self._cards = {c.worker_id: c for c in cards}
            self.version = 1

    now = time.time()
    ids = [f"w{i:04d}" for i in range(workers)]
    router = KvRouter(None, Members([WorkerCard(w, "decode", "m", 16, 16384, 1 << 17, "h", 1, now, now)
                                     for w in ids]), RouterConfig())
    router._spawn = lambda coro: coro.close()  # decisions are not published: no bus
    rng = random.Random(0)
    seed = hash_seed(DEFAULT_HASH_KEY, "m")
    system = [rng.randrange(32000) for _ in range(64 * 16)]
    shared = block_hashes(system, 16, seed)
    convs: dict[str, list[int]] = {}
    wire = []
    for w in ids:
        conv = system + [rng.randrange(32000) for _ in range(16 * 60)]
        convs[w] = conv
        own = block_hashes(conv, 16, seed)[64:]
        own += [rng.getrandbits(63) for _ in range(blocks - 64 - len(own))]  # older conversations' blocks
        wire.append(encode(KvEventBatch(w, "m", 1, [KvEvent("stored", shared), KvEvent("stored", own)])))
    idx = router.index("m")
    for w in ids:
        idx.load_snapshot(w, 0, {})
    gc.collect()
    t0 = time.perf_counter()
    for raw in wire:
        assert idx.apply(decode(raw, KvEventBatch))
    ingest = time.perf_counter() - t0
    for w in ids:
        router._heard[w] = time.monotonic()
        router.table.report(w, rng.randrange(0, 2000), 0, time.monotonic())
        router.loads[w] = LoadReport(w, "m", "decode", now)
    return router, system, convs, ingest


def router_figures(workers: int, blocks: int, decisions: int) -> dict:
    """Decisions of ``router_at_scale``'s router on prompts that share the system prompt, half of
    them continuing a worker's conversation; the index's bytes per block; the ingest rate."""
    router, system, convs, ingest = router_at_scale(workers, blocks)
    rng = random.Random(1)
    indexed = workers * blocks
    nbytes = router.index("m").nbytes()
    lat, cpu = [], []  # wall and this thread's CPU: on a shared machine the wall p99 is the scheduler's
    conv_list = list(convs.values())
    for i in range(decisions):
        if i % 2:
            tokens = rng.choice(conv_list)[: 64 * 16 + 16 * rng.randrange(1, 60)] + [7]
        else:
            tokens = system + [rng.randrange(32000) for _ in range(16 * rng.randrange(4, 64))]
        t0, c0 = time.perf_counter(), time.thread_time()
        d = router.route("m", tokens, f"r{i}")
        lat.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        router.finished(d.worker_id, f"r{i}")
    lat.sort()
    cpu.sort()
    return {"workers": workers, "blocks_indexed": indexed, "index_bytes_per_block": round(nbytes / indexed, 1),
            "decision_cpu_p50_ms": round(cpu[len(cpu) // 2] * 1000, 3),
            "decision_cpu_p99_ms": round(cpu[int(len(cpu) * 0.99)] * 1000, 3),
            "ingest_blocks_s": round(indexed / ingest), "decision_p50_ms": round(lat[len(lat) // 2] * 1000, 3),
            "decision_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 3),
            "decision_mean_ms": round(statistics.fmean(lat) * 1000, 3), "load_avg": os.getloadavg()[0]}


