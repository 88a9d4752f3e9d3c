"""How many streams a closed-loop client really keeps open: ``../shared/peers/load.py``'s workload
(C concurrent chat streams of T tokens, N requests, the same body), with each request's phases
timed through httpx's trace hook and the streams open sampled over the run.

side_by_side.sh's ratio swings with how many streams are open: a per-step cost is shared by the
rows of a step. Its client (httpx 0.28-0.29 / httpcore 1.0, one pool of C connections) does not
keep C open: after a cohort of streams ends together, the next requests sit in httpcore's pool
for seconds (about its 5 s keep-alive expiry) before they connect, while the server has ~10% of
C in flight (measured 2026-12-04 against pdmesh and Dynamo alike: docs/benchmarks.md). This
prints how much of the run had fewer than C/2 streams open and how long requests waited in the
client before their bytes left (``connect`` or ``send_request_headers`` started), so a side-by-side
figure can be read with the concurrency it was taken at.

    python bench/load_shape.py URL [--n 1000] [--c 128] [--t 64] [--model tiny]

Run it with the interpreter side_by_side.sh's load runs under (the peers' venv:
``~/.cache/pdmesh-peers/dynamo/bin/python``) to see that client's behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

WORDS = ["hello", "world", "how", "are", "you", "the", "a", "is", "of", "and", "to", "in"]


async def one(client: httpx.AsyncClient, url: str, args, t_run: float, out: list) -> None:
    prompt = " ".join(random.choice(WORDS) for _ in range(100))  # load.py's prompt
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.t,
            "stream": True, "ignore_eos": True, "min_tokens": args.t, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    sent: list[float] = []

    async def trace(name: str, info) -> None:
        if not sent and name in ("connection.connect_tcp.started", "http11.send_request_headers.started"):
            sent.append(time.perf_counter())

    first = done = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, extensions={"trace": trace}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                first = first or time.perf_counter()
                if "[DONE]" in line:
                    done = time.perf_counter()
    end = time.perf_counter()
    out.append({"sent": (sent[0] if sent else t0) - t0, "ttft": first - t0,
                "open": (first - t_run, (done or end) - t_run)})


def open_over_time(spans: list[tuple[float, float]], until: float, step: float = 0.05) -> list[int]:
    """Streams open (first chunk seen, [DONE] not yet) at each ``step`` of the run."""
    return [sum(1 for a, b in spans if a <= t < b) for t in (i * step for i in range(int(until / step)))]


def pool_state(client: httpx.AsyncClient) -> tuple[int, int, int] | None:
    """httpcore's pool as it stands: (requests in it, the connections they are assigned to, its idle
    connections); None where the pool's internals are not httpcore 1.0's."""
    try:
        pool = client._transport._pool
        held = {id(r.connection) for r in pool._requests if r.connection is not None}
        return len(pool._requests), len(held), sum(1 for c in pool._connections if c.is_idle())
    except AttributeError:
        return None


def piled_figures(pool: list[tuple[int, int, int]]) -> dict:
    piled = [p for p in pool if p[0] > 2 * max(1, p[1])]
    return {"pool_samples": len(pool), "pool_piled_share": round(len(piled) / len(pool), 2) if pool else None,
            "piled_requests_connections_idle": [round(statistics.fmean(p[i] for p in piled), 1) for i in range(3)]
            if piled else None}


async def sample_pool(client: httpx.AsyncClient, seen: list, every: float = 0.25) -> None:
    while True:
        await asyncio.sleep(every)
        state = pool_state(client)
        if state is None:
            return
        seen.append(state)


async def main(args) -> None:
    res: list[dict] = []
    sem = asyncio.Semaphore(args.c)
    pool: list[tuple[int, int, int]] = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.c)) as client:  # as load.py
        async def w(t_run: float, sink: list) -> None:
            async with sem:
                await one(client, args.url, args, t_run, sink)

        warm: list[dict] = []
        now = time.perf_counter()
        await asyncio.gather(*[w(now, warm) for _ in range(min(args.c, 20))])  # load.py's warm-up
        t_run = time.perf_counter()
        sampler = asyncio.create_task(sample_pool(client, pool))
        await asyncio.gather(*[w(t_run, res) for _ in range(args.n)])
        seconds = time.perf_counter() - t_run
        sampler.cancel()
    counts = open_over_time([r["open"] for r in res], seconds)
    low = sum(1 for k in counts if k < args.c / 2) / len(counts)
    waits = sorted(r["sent"] for r in res)
    ttfts = sorted(r["ttft"] for r in res)
    print(json.dumps({
        "req_s": round(args.n / seconds, 1), "seconds": round(seconds, 1),
        "streams_open_mean": round(statistics.fmean(counts), 1), "share_below_half_c": round(low, 2),
        "client_wait_p50_ms": round(1000 * waits[len(waits) // 2], 1),
        "client_wait_p99_ms": round(1000 * waits[int(len(waits) * 0.99)], 1),
        "requests_waiting_over_1s": sum(1 for x in waits if x > 1.0),
        "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1), "ttft_p99_ms": round(1000 * ttfts[int(len(ttfts) * 0.99)], 1),
        # httpcore 1.0's pool hands every request queued in one pass the same idle connection
        # (encode/httpcore#822; the review of #1111): they wait on it one after another while
        # other connections sit idle. Sampled every 0.25 s: the share of samples where the pool's
        # requests were piled (more than 2 per connection they are assigned to), and the means of
        # requests, connections they are on, and idle connections over those samples.
        **piled_figures(pool),
    }))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--c", type=int, default=128)
    p.add_argument("--t", type=int, default=64)
    p.add_argument("--model", default="tiny")
    asyncio.run(main(p.parse_args()))
