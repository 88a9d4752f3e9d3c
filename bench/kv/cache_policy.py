"""The prefix cache's eviction policy on a Mooncake trace, without the mesh.

Replays the trace's prompts (the token mapping of ``python -m bench trace-replay``) through
one real ``BlockPool`` per worker, one request at a time: the request goes to the
worker holding the longest prefix of it (ties: the worker that has prefilled the
fewest tokens), takes its hit, computes the rest and its ``output_length`` generated
tokens, and frees its blocks. No load, no event delay, no concurrency: an upper bound
for any router, which isolates what the eviction policy keeps.

    python -m bench cache-policy     # --trace: default ../shared/data/traces/mooncake_synthetic_trace.jsonl

Policies: ``lru`` (one queue, least recently freed first), ``slru`` (the pool's
default: blocks that served a hit are protected, up to half the pool; generated
blocks go first), and Belady's optimal eviction per worker (knows each block's next
use on that worker; same routing decisions) as the ceiling.

``--host-blocks N`` adds the KV fabric's bounds (issue 20), through the real block
manager, host tier and peer stage of every worker: ``+host`` (a host tier of N blocks
behind each pool, the same longest-prefix routing), and two placements that ignore
the caches (round-robin, perfectly balanced): ``rr+host`` and ``rr+host+peer`` (the
worker fetches the prefix from whichever worker holds the longest run of it, any tier).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

from bench.common import Benchmark, emit, parse, parser
from bench.mesh import trace_replay as tr
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from kvstore.manager import KVCacheManager
from kvstore.pool import BlockPool
from kvstore.tiers import HostTier, TieredCache

BENCHMARK = Benchmark(
    name="cache-policy",
    measures="the prefix cache's reuse on the Mooncake trace with an ideal router and no load: LRU against the "
             "pool's segmented LRU (and Belady), per pool size; with --host-blocks, the tiers' bounds",
    minutes=3,
    smoke=("--limit", "200", "--blocks", "1024", "--host-blocks", "1024"),
)


def run(requests, workers: int, blocks: int, policy: str, block_size: int = 16, seed: int = 0,
        uncached: list[int] | None = None) -> float:
    """Prefix hit rate; ``uncached`` (if given) gets each request's prompt tokens left to prefill."""
    hseed = hash_seed(DEFAULT_HASH_KEY, tr.MODEL)
    share = 0.0 if policy == "lru" else 0.5
    pools = [BlockPool(blocks, protected_share=share) for _ in range(workers)]
    prefilled = [0] * workers
    rng = random.Random(seed)
    fresh = iter(range(1 << 62, 1 << 63))  # hashes of generated blocks: never asked for again
    hit_tokens = prompt_tokens = 0
    for r in requests:
        hashes = block_hashes(r.prompt, block_size, hseed)
        usable = hashes[: (len(r.prompt) - 1) // block_size]
        overlaps = []
        for pool in pools:
            n = 0
            while n < len(usable) and pool.lookup(usable[n]) is not None:
                n += 1
            overlaps.append(n)
        best = max(overlaps)
        w = min((i for i, n in enumerate(overlaps) if n == best), key=lambda i: (prefilled[i], rng.random()))
        pool = pools[w]
        hit = [pool.lookup(h) for h in usable[:best]]
        pool.touch(hit)
        total_blocks = (len(r.prompt) + r.max_tokens) // block_size
        rest = pool.allocate(min(total_blocks - best, blocks - best))
        table = hit + rest
        for i in range(best, len(table)):
            generated = i >= len(hashes)
            h = next(fresh) if generated else hashes[i]
            pool.cache(table[i], h, table[i - 1] if i else None, generated=generated and policy != "lru")
        pool.free(reversed(table))
        hit_tokens += best * block_size
        prompt_tokens += len(r.prompt)
        prefilled[w] += len(r.prompt) - best * block_size
        if uncached is not None:
            uncached.append(len(r.prompt) - best * block_size)
    return hit_tokens / prompt_tokens


def belady(requests, workers: int, blocks: int, block_size: int = 16, seed: int = 0) -> float:
    """Routing as ``run`` with LRU would route it is not knowable in advance, so this routes by
    longest prefix over the caches Belady keeps (ties as above) and evicts, per worker, the
    block whose next use is farthest away (a prompt block's next request, if any)."""
    hseed = hash_seed(DEFAULT_HASH_KEY, tr.MODEL)
    seqs = [block_hashes(r.prompt, block_size, hseed) for r in requests]
    next_use: list[dict[int, int]] = []
    upcoming: dict[int, int] = {}
    for i in range(len(seqs) - 1, -1, -1):
        next_use.append({h: upcoming.get(h, 1 << 60) for h in seqs[i]})
        for h in seqs[i]:
            upcoming[h] = i
    next_use.reverse()
    caches: list[dict[int, int]] = [{} for _ in range(workers)]  # hash -> next use
    prefilled = [0] * workers
    rng = random.Random(seed)
    hit_tokens = prompt_tokens = 0
    for i, r in enumerate(requests):
        usable = seqs[i][: (len(r.prompt) - 1) // block_size]
        overlaps = []
        for c in caches:
            n = 0
            while n < len(usable) and usable[n] in c:
                n += 1
            overlaps.append(n)
        best = max(overlaps)
        w = min((j for j, n in enumerate(overlaps) if n == best), key=lambda j: (prefilled[j], rng.random()))
        c = caches[w]
        for h in seqs[i]:
            c[h] = next_use[i][h]
        if len(c) > blocks:
            for h, _ in sorted(c.items(), key=lambda kv: kv[1])[blocks:]:
                del c[h]
        hit_tokens += best * block_size
        prompt_tokens += len(r.prompt)
        prefilled[w] += len(r.prompt) - best * block_size
    return hit_tokens / prompt_tokens


def tiered(requests, workers: int, blocks: int, host_blocks: int, placement: str = "prefix", peer: bool = False,
           block_size: int = 16, seed: int = 0) -> dict[str, float]:
    """Reuse (cached / prompt tokens) with a host tier behind every pool, in total and by source.

    ``placement``: ``prefix`` (the worker holding the longest run, any tier; ties: fewest
    tokens prefilled) or ``rr`` (round-robin). ``peer``: blocks past the chosen worker's own run
    that another worker holds (any tier) are fetched instead of computed."""
    hseed = hash_seed(DEFAULT_HASH_KEY, tr.MODEL)
    pools = [BlockPool(blocks) for _ in range(workers)]
    kvs = []
    for pool in pools:
        tiers = TieredCache(HostTier(host_blocks, pool.events))
        pool.on_evict = tiers.offload
        pool.events.enabled = False
        kvs.append(KVCacheManager(pool, block_size, tiers))
    prefilled = [0] * workers
    rng = random.Random(seed)
    cached = prompt = 0
    for i, r in enumerate(requests):
        out = min(r.max_tokens, max(blocks * block_size - len(r.prompt) - block_size, 1))
        s = Sequence(str(i), list(r.prompt), SamplingParams(max_tokens=out), block_size=block_size, hash_seed=hseed)
        runs = [len(kv.match_prefix(s)) for kv in kvs]
        if placement == "rr":
            w = i % workers
        else:
            best = max(runs)
            w = min((j for j, n in enumerate(runs) if n == best), key=lambda j: (prefilled[j], rng.random()))
        kv = kvs[w]
        if peer and max(runs) > runs[w]:
            kv.tiers.stage_peer(s.block_hashes(max(runs))[runs[w]:])
        hit = kv.match_prefix(s)
        kv.admit(s, hit)
        s.output_token_ids.extend(rng.randrange(1, tr.VOCAB) for _ in range(out))
        if not kv.grow(s, s.num_tokens - s.num_computed_tokens):
            raise RuntimeError("a request does not fit the pool")
        s.num_computed_tokens = s.num_tokens
        kv.cache_computed(s)
        kv.free(s)
        cached += len(hit) * block_size
        prompt += len(r.prompt)
        prefilled[w] += len(r.prompt) - len(hit) * block_size
    out = {"reuse": cached / prompt}
    device = sum(kv.device_hit_blocks for kv in kvs)
    out["device"] = device * block_size / prompt
    for src in ("host", "peer"):
        out[src] = sum(kv.tiers.hit_blocks[src] for kv in kvs) * block_size / prompt
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--trace", type=Path, default=tr.TRACE, help="Mooncake trace JSONL (default: the shared one)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--blocks", type=int, nargs="+", default=[3600, 4096],
                   help="blocks per worker (3,600: what 4,096 leave free beside running requests)")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--belady", action="store_true", help="also the optimal-eviction ceiling (slow)")
    p.add_argument("--host-blocks", type=int, default=0,
                   help="also the bounds with a host tier of this many blocks per worker (and peer fetch)")
    args = parse(BENCHMARK, p, argv)
    if not args.trace.is_file():
        p.error(f"no trace at {args.trace}")
    requests = tr.load_trace(args.trace, 1.0, args.limit, None)
    oracle = sum(tr.oracle_hits(requests)) / sum(len(r.prompt) for r in requests)
    print(f"{len(requests)} requests, {args.workers} workers; prefix hit rate (cached / prompt tokens), "
          f"unlimited shared cache: {oracle:.1%}")
    # TTFT grows with the prompt tokens a request must prefill: the median of those, against the
    # median prompt (no cache, as round-robin nearly is), bounds what routing can do to TTFT p50
    no_cache = statistics.median(len(r.prompt) for r in requests)
    print(f"{'blocks/worker':>14} {'lru':>8} {'slru':>8} {'slru/lru':>9} {'median to prefill':>18} "
          f"{'/ no cache':>10}" + (f" {'belady':>8}" if args.belady else ""))
    figures = {"requests": len(requests), "workers": args.workers, "oracle_hit_rate": oracle,
               "median_prompt_tokens": no_cache, "pools": [], "tiers": []}
    for blocks in args.blocks:
        left: list[int] = []
        lru = run(requests, args.workers, blocks, "lru")
        slru = run(requests, args.workers, blocks, "slru", uncached=left)
        ceiling = belady(requests, args.workers, blocks) if args.belady else None
        extra = f" {ceiling:>8.1%}" if args.belady else ""
        med = statistics.median(left)
        figures["pools"].append({"blocks_per_worker": blocks, "lru": lru, "slru": slru, "belady": ceiling,
                                 "median_to_prefill": med})
        print(f"{blocks:>14} {lru:>8.1%} {slru:>8.1%} {slru / lru if lru else float('nan'):>8.2f}x {med:>18.0f} {med / no_cache:>10.2f}"
              f"{extra}", flush=True)
    print(f"median prompt: {no_cache:.0f} tokens")
    if args.host_blocks:
        print(f"with a host tier of {args.host_blocks} blocks per worker (reuse: total = device + host + peer):")
        for blocks in args.blocks:
            for label, placement, peer in (("+host", "prefix", False), ("rr+host", "rr", False),
                                           ("rr+host+peer", "rr", True)):
                t = tiered(requests, args.workers, blocks, args.host_blocks, placement, peer)
                figures["tiers"].append({"blocks_per_worker": blocks, "host_blocks": args.host_blocks,
                                         "placement": label, **t})
                print(f"{blocks:>14} {label:>13} {t['reuse']:>7.1%} = {t['device']:.1%} + {t['host']:.1%} "
                      f"+ {t['peer']:.1%}", flush=True)
    return emit(BENCHMARK, figures, args)
