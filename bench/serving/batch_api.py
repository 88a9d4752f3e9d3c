"""The Batch API beside interactive traffic: a large batch on spare capacity, in one run.

`mesh up --mock` (mocker workers: a 10,000-line batch fits a 2-core box; the gateway, bus,
JetStream state, governor and planner are the real ones) with the planner on, decode pool
`--decode` workers, bounds `--decode`..`--max-decode`. Phase 1: an interactive load alone
(streamed completions, open loop at `--rate` per second) for `--seconds`. Phase 2: the same load
while a batch of `--lines` completions runs, until the batch completes. Reported: the batch's
throughput, interactive TTFT p50/p99 in both phases (the target: p99 within 1.5x), and the
decode replica-seconds above the pool's size at the batch's start (the planner must not grow
the pool for a batch: the target is 0).

    python -m bench batch [--lines 10000] [--rate 4] [--seconds 30] [--out bench/out/batch.json]
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from mesh.natsserver import free_port

BENCHMARK = Benchmark(
    name="batch",
    measures="a Batch API batch of 10,000 completions on spare capacity beside interactive streams (`mesh up "
             "--mock`, the planner on): lines/s, interactive TTFT beside the batch against alone, replicas added",
    target="the batch completes; interactive TTFT p99 within 1.5x of no batch; no replicas added for it (issue 35)",
    minutes=5,
    smoke=("--dry-run",),
)

LIVE = re.compile(r'^pdmesh_gateway_live_workers\{model="mock"\} (\S+)', re.M)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def ttft(client: httpx.AsyncClient, url: str, rng: random.Random) -> float:
    body = {"model": "mock", "prompt": [rng.randrange(1, 30000) for _ in range(64)], "max_tokens": 16,
            "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                took = time.perf_counter() - t0
                if took > 0.1:
                    print(f"slow TTFT {took * 1e3:.0f} ms at {time.monotonic():.1f}", file=sys.stderr)
                return took
    raise RuntimeError(f"no token (status {r.status_code})")


async def interactive(client: httpx.AsyncClient, url: str, rate: float, until, out: list[float]) -> int:
    """Open-loop Poisson arrivals until ``until()``; TTFTs into ``out``; the failures counted."""
    rng = random.Random(7)
    tasks = []
    while not until():
        tasks.append(asyncio.create_task(ttft(client, url, rng)))
        await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    out.extend(r for r in results if isinstance(r, float))
    return sum(1 for r in results if not isinstance(r, float))


async def replicas(client: httpx.AsyncClient, url: str) -> int:
    m = LIVE.search((await client.get(f"{url}/metrics", timeout=10)).text)
    return int(float(m.group(1))) if m else 0


def batch_file(n: int) -> bytes:
    rng = random.Random(11)
    rows = []
    for i in range(n):
        body = {"model": "mock", "prompt": [rng.randrange(1, 30000) for _ in range(64)], "max_tokens": 16}
        rows.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    return ("\n".join(rows) + "\n").encode()


async def run_batch(client: httpx.AsyncClient, url: str, lines: int, timeout: float, samples: list) -> dict:
    up = await client.post(f"{url}/v1/files", files={"file": ("batch.jsonl", batch_file(lines))},
                           data={"purpose": "batch"}, timeout=120)
    up.raise_for_status()
    start_replicas = await replicas(client, url)
    t0 = time.monotonic()
    b = (await client.post(f"{url}/v1/batches", json={"input_file_id": up.json()["id"], "completion_window": "24h",
                                                     "endpoint": "/v1/completions"})).json()
    last = t0
    while time.monotonic() - t0 < timeout:
        await asyncio.sleep(1.0)
        now = time.monotonic()
        samples.append((now - last, await replicas(client, url) - start_replicas))
        last = now
        b = (await client.get(f"{url}/v1/batches/{b['id']}", timeout=30)).json()
        if b["status"] in ("completed", "failed", "cancelled", "expired"):
            break
    wall = time.monotonic() - t0
    print(f"batch from {t0:.1f} to {time.monotonic():.1f} (in progress at {b.get('in_progress_at')}, "
          f"finalizing at {b.get('finalizing_at')})", file=sys.stderr)
    out_lines = 0
    if b.get("output_file_id"):
        content = await client.get(f"{url}/v1/files/{b['output_file_id']}/content", timeout=120)
        ids = [json.loads(x)["custom_id"] for x in content.text.splitlines()]
        out_lines = len(ids)
        assert len(set(ids)) == len(ids), "a custom_id twice in the output"
    return {"status": b["status"], "wall_s": round(wall, 1), "counts": b["request_counts"],
            "output_lines": out_lines, "lines_per_s": round(b["request_counts"]["completed"] / wall, 1),
            "start_replicas": start_replicas}


def up_command(args, port: int) -> list[str]:
    return [sys.executable, "-m", "cli", "up", "--mock", "--prefill", "0", "--decode", str(args.decode),
            "--min-decode", str(args.decode), "--max-decode", str(args.max_decode), "--planner-window", "2",
            "--mock-speedup", str(args.speedup), "--port", str(port),
            # chunked prefill in steps of 512 tokens: an interactive prompt never waits behind a long
            # prefill step of batch prompts (the usual setting for latency, batch or not)
            "--max-num-batched-tokens", str(args.step_tokens), *args.up_flags]


def setup(args) -> dict:
    return {"workers": "mocker (mesh up --mock)", "decode": args.decode, "max_decode": args.max_decode,
            "speedup": args.speedup, "step_tokens": args.step_tokens, "lines": args.lines, "rate": args.rate,
            "seconds": args.seconds, "up_flags": args.up_flags}


async def bench(args) -> dict:
    port = free_port()
    argv = up_command(args, port)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while "pdmesh is up" not in (line := proc.stdout.readline()):
            if not line and proc.poll() is not None:
                raise RuntimeError("mesh up did not start")
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
            alone: list[float] = []
            end = time.monotonic() + args.seconds
            failed_alone = await interactive(client, url, args.rate, lambda: time.monotonic() >= end, alone)
            beside: list[float] = []
            samples: list[tuple[float, int]] = []
            batch_task = asyncio.create_task(run_batch(client, url, args.lines, args.timeout, samples))
            failed_beside = await interactive(client, url, args.rate, batch_task.done, beside)
            batch = await batch_task
        return {
            "setup": setup(args),
            "batch": batch,
            "ttft_ms": {"alone": {"n": len(alone), "failed": failed_alone, "p50": round(pct(alone, 0.5) * 1e3, 1),
                                  "p99": round(pct(alone, 0.99) * 1e3, 1)},
                        "beside_batch": {"n": len(beside), "failed": failed_beside,
                                         "p50": round(pct(beside, 0.5) * 1e3, 1),
                                         "p99": round(pct(beside, 0.99) * 1e3, 1)}},
            "p99_ratio": round(pct(beside, 0.99) / pct(alone, 0.99), 2),
            "p90_ms": {"alone": round(pct(alone, 0.9) * 1e3, 1), "beside_batch": round(pct(beside, 0.9) * 1e3, 1)},
            "slowest_beside_ms": [round(x * 1e3) for x in sorted(beside)[-5:]],
            "replica_seconds_added": round(sum(dt * max(0, n) for dt, n in samples), 1),
            "max_replicas_added": max((n for _, n in samples), default=0),
        }
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--lines", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=4.0, help="interactive requests per second")
    p.add_argument("--seconds", type=float, default=30.0, help="the interactive load alone, first")
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--max-decode", type=int, default=4)
    p.add_argument("--speedup", type=float, default=1.0, help="the mocker's --mock-speedup")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--step-tokens", type=int, default=512, help="the workers' --max-num-batched-tokens")
    p.add_argument("--out", default="bench/out/batch.json")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    p.add_argument("up_flags", nargs="*", help="more `mesh up` flags (after --), e.g. --batch-max-inflight 16")
    args = parse(BENCHMARK, p, argv)
    if args.dry_run:
        print(f"DRY RUN: {' '.join(up_command(args, 0)[1:])}; {len(batch_file(min(args.lines, 3)))} bytes for 3 lines")
        return emit(BENCHMARK, {"setup": setup(args), "batch": None, "ttft_ms": None, "p99_ratio": None,
                                "p90_ms": None, "slowest_beside_ms": [], "replica_seconds_added": None,
                                "max_replicas_added": None}, args)
    result = asyncio.run(bench(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return emit(BENCHMARK, result, args)
