"""The gateway's cost per ``TokenBatch`` and per row, at real pace (issue 33).

A worker sends the gateway one ``TokenBatch`` per engine step with a chunk for each of the
gateway's streams it serves. At real pace each batch arrives on its own (a loop wake-up, a read,
nats-py's parse and subscription queue, our decode and dispatch), so with few streams per step
the per-batch part dominates the gateway's cost per token. This measures it on the real path: a
real nats-server, this process as the gateway (``gateway.replies.ReplyStreams`` on a real
``Bus``, a reader waiting on each stream with a sink that takes each chunk, as
``gateway.direct.DirectSink`` does before it detokenizes and writes), and a publisher process
sending paced batches of K rows. It prints this process's CPU per batch for each K and the fit
``cpu = fixed + K * per_row``. The detokenization and the SSE write of each token
(``bench/stream_costs.py``) come on top of the per-row part.

    python bench/batch_costs.py [--rows 1 4 16 64] [--batches 600] [--every-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and os.path.basename(sys.path[0]) == "bench":  # bench/gateway.py would shadow the package
    sys.path.pop(0)
sys.path.insert(0, str(ROOT))

from gateway.replies import ReplyStreams  # noqa: E402
from mesh.bus import Bus  # noqa: E402
from mesh.natsserver import EmbeddedNats  # noqa: E402
from mesh.protocol import TokenChunk  # noqa: E402

WORKER = "bench-worker"

PUBLISHER = """
import asyncio, json, sys, time
sys.path.insert(0, {root!r})
from mesh.bus import Bus
from mesh.protocol import TokenBatch, TokenChunk, encode

async def main():
    url, subject, keys, batches, every = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    bus = await Bus.connect(url, "bench-publisher")
    nxt = time.monotonic()
    for i in range(batches):
        chunks = [TokenChunk(request_id="r" + k, index=i, token_ids=[1000 + i % 997], worker={worker!r}, stream=k)
                  for k in keys]
        await bus.nc.publish(subject, encode(TokenBatch(worker={worker!r}, chunks=chunks)))
        nxt += every
        await asyncio.sleep(max(0.0, nxt - time.monotonic()))
    await bus.nc.flush()
    await bus.close()

asyncio.run(main())
"""


async def one(url: str, rows: int, batches: int, every_s: float) -> float:
    """This process's CPU seconds per batch of ``rows`` chunks (after a warm-up tenth)."""
    bus = await Bus.connect(url, "bench-gateway")
    replies = ReplyStreams(bus)
    await replies.start()
    streams = [replies.open(WORKER) for _ in range(rows)]
    taken = [0]

    def sink(chunk: TokenChunk) -> bool:
        taken[0] += 1
        return True

    readers = []
    for s in streams:
        s.sink = sink
        readers.append(asyncio.create_task(s.next_batch(3600)))
    await bus.nc.flush()
    warm = max(1, batches // 10)
    code = PUBLISHER.format(root=str(ROOT), worker=WORKER)
    proc = subprocess.Popen([sys.executable, "-c", code, url, replies.batch_subject,
                             json.dumps([s.key for s in streams]), str(batches), str(every_s)])
    try:
        while taken[0] < warm * rows:
            await asyncio.sleep(0.01)
        cpu0, seen0 = time.process_time(), taken[0]
        while taken[0] < batches * rows and proc.poll() is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        cpu = time.process_time() - cpu0
        got = (taken[0] - seen0) / rows
    finally:
        proc.wait(timeout=60)
        for r in readers:
            r.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await replies.stop()
        await bus.close()
    if taken[0] < batches * rows:
        raise SystemExit(f"only {taken[0]} of {batches * rows} chunks ({rows} a batch) arrived")
    return cpu / got


async def main(args) -> None:
    with EmbeddedNats() as nats:
        results = {}
        for rows in args.rows:
            runs = [await one(nats.url, rows, args.batches, args.every_ms / 1000) for _ in range(args.repeat)]
            results[rows] = statistics.median(runs)
            print(f"{rows:>4} rows a batch: {results[rows] * 1e6:8.1f} us of CPU a batch "
                  f"({results[rows] * 1e6 / rows:6.1f} a row; runs {', '.join(f'{r * 1e6:.0f}' for r in runs)})",
                  flush=True)
    ks = sorted(results)
    if len(ks) >= 2:
        xs, ys = ks, [results[k] * 1e6 for k in ks]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        print(f"fit: {my - slope * mx:.1f} us a batch + {slope:.2f} us a row "
              f"(batches every {args.every_ms:g} ms, load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--batches", type=int, default=600)
    p.add_argument("--every-ms", type=float, default=5.0, help="the simulated step: one batch this often")
    p.add_argument("--repeat", type=int, default=3)
    asyncio.run(main(p.parse_args()))
