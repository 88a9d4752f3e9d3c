"""Router cost: decision latency with a large index, and KV event ingest rate.

64 workers each hold 100k blocks (chains of a shared system prompt plus their
own conversations). A decision = hash the prompt + overlap walk + cost + choice,
exactly what the gateway runs per request (``KvIndex`` + ``pick_worker``).
Ingest = applying ``KvEventBatch``es of stored/removed runs as they arrive
from workers, decoded from the wire first.

    python -m bench router [--workers 64] [--blocks 100000] [--decisions 5000]
"""

from __future__ import annotations

import random
import statistics
import time

from bench.common import Benchmark, emit, parse, parser
from kvstore.hashing import DEFAULT_HASH_KEY, HashSeed, block_hashes, hash_seed
from mesh.protocol import KvEvent, KvEventBatch, decode, encode
from mesh.router.index import KvIndex
from mesh.router.policy import RouterConfig, RouteRequest, WorkerLoad, pick_worker

BENCHMARK = Benchmark(
    name="router",
    measures="the KV router's decision latency over 6.4M indexed blocks (64 workers), and its KV event ingest rate",
    target="decision p99 <= 1 ms, ingest >= 200k block events/s",
    minutes=1,
    smoke=("--workers", "2", "--blocks", "2000", "--decisions", "20", "--prompt-tokens", "1100"),
)
BS = 16


def chain(rng: random.Random, n_blocks: int, seed: HashSeed, prefix: list[int] | None = None) -> list[int]:
    tokens = (prefix or []) + [rng.randrange(50_000) for _ in range(n_blocks * BS)]
    return block_hashes(tokens, BS, seed)


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--blocks", type=int, default=100_000, help="indexed blocks per worker")
    p.add_argument("--decisions", type=int, default=5000)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    args = parse(BENCHMARK, p, argv)
    rng = random.Random(0)
    seed = hash_seed(DEFAULT_HASH_KEY, "bench")
    system = [rng.randrange(50_000) for _ in range(1024)]  # a 64-block system prompt everyone shares

    # -- ingest: every worker's blocks arrive as wire batches of 64-block stored runs ------------
    idx = KvIndex()
    workers = [f"w{i:02d}" for i in range(args.workers)]
    shared = block_hashes(system, BS, seed)
    payloads = []
    for w in workers:
        idx.load_snapshot(w, 0, {})
        hashes = list(shared)
        wr = random.Random(hash(w))
        while len(hashes) < args.blocks:
            hashes.extend(wr.getrandbits(64) for _ in range(min(4096, args.blocks - len(hashes))))
        for seq, i in enumerate(range(0, len(hashes), 256), start=1):
            events = [KvEvent("stored", hashes[j : j + 64], None) for j in range(i, min(i + 256, len(hashes)), 64)]
            payloads.append(encode(KvEventBatch(w, "bench", seq, events)))
    total_events = args.workers * args.blocks
    t0 = time.perf_counter()
    for raw in payloads:
        assert idx.apply(decode(raw, KvEventBatch))
    ingest = time.perf_counter() - t0
    # removals too: each worker evicts 10% of its blocks, then stores them again
    t0 = time.perf_counter()
    n_moves = 0
    for w in workers:
        mine = list(idx._blocks[w])[: args.blocks // 10]
        seq = idx.seq(w)
        idx.apply(KvEventBatch(w, "bench", seq + 1, [KvEvent("removed", mine)]))
        idx.apply(KvEventBatch(w, "bench", seq + 2, [KvEvent("stored", mine)]))
        n_moves += 2 * len(mine)
    churn = time.perf_counter() - t0

    # -- decisions: prompts sharing the system prompt, some continuing a worker's conversation ---
    loads = [WorkerLoad(w, active_blocks=rng.randrange(0, 2000), total_blocks=args.blocks) for w in workers]
    lats = {}
    for label, cfg in (("kv", RouterConfig()), ("kv + peer fetch", RouterConfig(peer_fetch=True))):
        lat = lats[label] = []
        for i in range(args.decisions):
            body = [rng.randrange(50_000) for _ in range(args.prompt_tokens - len(system))]
            tokens = system + body
            t0 = time.perf_counter()
            hashes = block_hashes(tokens, BS, seed)
            matches = idx.match(hashes)
            d = pick_worker(RouteRequest(len(tokens), BS, tuple(hashes)), loads, matches, cfg, rng, i)
            lat.append(time.perf_counter() - t0)
            assert matches and d.hit_blocks + d.fetch_blocks >= len(shared)
        lat.sort()
    print(f"router index: {args.workers} workers x {args.blocks:,} blocks = {total_events:,} indexed blocks")
    print(f"ingest: {total_events / ingest:,.0f} block events/s ({ingest:.2f}s, decode + apply, "
          f"64-block stored runs)")
    print(f"churn:  {n_moves / churn:,.0f} block events/s (removed + stored again, 10% of each worker)")
    figures = {"workers": args.workers, "blocks_per_worker": args.blocks, "indexed_blocks": total_events,
               "ingest_events_per_s": total_events / ingest, "churn_events_per_s": n_moves / churn, "decisions": {}}
    for label, lat in lats.items():
        figures["decisions"][label] = {"p50_ms": statistics.median(lat) * 1e3, "p99_ms": lat[int(0.99 * len(lat))] * 1e3,
                                       "max_ms": lat[-1] * 1e3}
        print(f"decision, {label} ({args.prompt_tokens}-token prompt, all {args.workers} workers share a 64-block "
              f"prefix): p50 {statistics.median(lat) * 1e3:.3f} ms, p99 {lat[int(0.99 * len(lat))] * 1e3:.3f} ms, "
              f"max {lat[-1] * 1e3:.3f} ms")
    t0 = time.perf_counter()
    for _ in range(200):
        block_hashes(tokens, BS, seed)
    figures["hash_prompt_ms"] = (time.perf_counter() - t0) / 200 * 1e3
    print(f"  of which hashing the prompt: {figures['hash_prompt_ms']:.3f} ms")
    return emit(BENCHMARK, figures, args)
