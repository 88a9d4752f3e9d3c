"""Priority: interactive TTFT under a flood of batch generations, against an idle mesh.

`mesh up` serves the tiny model with one decode worker whose device KV pool is
small and whose host tier is not. First, interactive requests (one at a time)
on the idle mesh; then a flood of long batch generations (`x-priority: batch`)
fills the worker, and the same interactive requests run again. Interactive
work preempts and pauses batch work; every batch request must still finish,
with the greedy output it has alone (checked against the engine in-process).

    python -m bench priority [--flood 48] [--interactive 20]
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from cli.up import default_model_dir, ensure_tiny_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.loads import subscribe_loads
from mesh.natsserver import free_port

BENCHMARK = Benchmark(
    name="priority",
    measures="interactive TTFT under a flood of batch-priority generations against the idle mesh (`mesh up`, "
             "the tiny model, a small device pool and a host tier); every preempted batch request checked",
    target="interactive TTFT within 2x of idle under the flood",
    minutes=0.5,
    smoke=("--dry-run",),
)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def ttft(client: httpx.AsyncClient, url: str, prompt: list[int], headers=None) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "return_token_ids": True}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {}) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("token_ids"):
                first = time.perf_counter() - t0  # the first event that carries a token
    if first is None:
        raise RuntimeError("no token")
    return first


def up_command(args, model: str, port: int) -> list[str]:
    return [sys.executable, "-m", "cli", "up", "--model", model, "--prefill", "0", "--decode", "1",
            "--no-planner", "--port", str(port), "--device-kv-blocks", str(args.device_blocks),
            "--host-kv-gb", "0.5", "--max-num-seqs", str(args.max_num_seqs)]


def summary(idle: list[float], busy: list[float], completed: int, identical: int, batch: int, counters: dict) -> dict:
    p50 = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731 (the table's p50)
    return {"idle_ttft_ms": {"p50": p50(idle) * 1e3, "p90": pct(idle, 0.9) * 1e3},
            "flood_ttft_ms": {"p50": p50(busy) * 1e3, "p90": pct(busy, 0.9) * 1e3},
            "ratio_p50": p50(busy) / p50(idle) if idle and busy else None,
            "ratio_p90": pct(busy, 0.9) / pct(idle, 0.9) if idle and busy else None,
            "batch_requests": batch, "completed": completed, "identical": identical, "counters": counters,
            "idle_s": idle, "flood_s": busy}


async def run(args) -> dict:
    model = str(ensure_tiny_model(default_model_dir()))
    port = free_port()
    argv = up_command(args, model, port)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            line = proc.stdout.readline()
            if not line:
                raise SystemExit("mesh up failed")
            if "pdmesh is up" in line:
                nats = re.search(r"NATS (nats://[^)\s]+)", line).group(1)
                break
        rng = random.Random(0)
        interactive = [[rng.randrange(3, 4000) for _ in range(64)] for _ in range(args.interactive)]
        flood = [[rng.randrange(3, 4000) for _ in range(args.flood_prompt)] for _ in range(args.flood)]
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as client:
            await ttft(client, url, interactive[0])  # warm-up
            idle = [await ttft(client, url, p) for p in interactive]
            body = {"model": "tiny", "max_tokens": args.flood_tokens, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            batch = [asyncio.create_task(client.post(f"{url}/v1/completions", json={**body, "prompt": p},
                                                     headers={"x-priority": "batch"})) for p in flood]
            await asyncio.sleep(args.settle)  # the flood fills the worker
            busy = [await ttft(client, url, p) for p in interactive]
            results = await asyncio.gather(*batch)
        from mesh.bus import Bus
        from mesh.protocol import LoadReport

        bus = await Bus.connect(nats, "bench-priority")
        report: list[LoadReport] = []

        async def on_load(r: LoadReport, raw) -> None:
            report.append(r)

        await subscribe_loads(bus, on_load)
        await asyncio.sleep(1.5)
        await bus.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    ok = [r.status_code == 200 for r in results]
    engine = Engine(EngineConfig(model, num_kv_blocks=4096))
    ref = engine.generate(flood, SamplingParams(max_tokens=args.flood_tokens, temperature=0.0, ignore_eos=True))
    same = sum(1 for r, s in zip(results, ref, strict=True)
               if r.status_code == 200 and r.json()["choices"][0]["token_ids"] == s.output_token_ids)
    counters = report[-1].counters if report else {}
    print(f"priority: {args.interactive} interactive requests (64-token prompts), one at a time, idle vs under "
          f"a flood of {args.flood} batch generations ({args.flood_prompt} -> {args.flood_tokens} tokens); "
          f"tiny model, device pool {args.device_blocks} blocks + host tier, max {args.max_num_seqs} sequences")
    print(f"{'':<22} {'TTFT p50':>9} {'p90':>8} {'max':>8}")
    for name, xs in (("idle mesh", idle), ("under the batch flood", busy)):
        print(f"{name:<22} {statistics.median(xs) * 1e3:>7.1f}ms {pct(xs, 0.9) * 1e3:>6.1f}ms {max(xs) * 1e3:>6.1f}ms")
    print(f"ratio flood/idle: p50 {statistics.median(busy) / statistics.median(idle):.2f}x, "
          f"p90 {pct(busy, 0.9) / pct(idle, 0.9):.2f}x (target <= 2x)")
    print(f"batch requests: {sum(ok)}/{len(ok)} completed, {same}/{len(ok)} identical to the engine alone; "
          f"worker: {counters.get('preemptions', 0)} preemptions, host-tier hits {counters.get('hit_blocks_host', 0)} "
          f"blocks, stored {counters.get('host_stored_blocks', 0)}")
    return summary(idle, busy, sum(ok), same, len(ok), counters)


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--flood", type=int, default=48)
    p.add_argument("--flood-prompt", type=int, default=200)
    p.add_argument("--flood-tokens", type=int, default=300)
    p.add_argument("--interactive", type=int, default=20)
    p.add_argument("--device-blocks", type=int, default=320)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.dry_run:
        print(f"DRY RUN: {' '.join(up_command(args, str(default_model_dir()), 0)[1:])}; {args.interactive} "
              f"interactive requests idle, then beside {args.flood} batch requests of {args.flood_prompt} -> "
              f"{args.flood_tokens} tokens")
        return emit(BENCHMARK, summary([], [], 0, 0, 0, {}), args)
    return emit(BENCHMARK, asyncio.run(run(args)), args)
