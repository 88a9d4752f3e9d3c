"""Priority: interactive TTFT under a flood of batch generations, against an idle mesh.

`mesh up` serves the tiny model with one decode worker whose device KV pool is
small and whose host tier is not. First, interactive requests (one at a time)
on the idle mesh; then a flood of long batch generations (`x-priority: batch`)
fills the worker, and the same interactive requests run again. Interactive
work preempts and pauses batch work; every batch request must still finish,
with the greedy output it has alone (checked against the engine in-process).

    python bench/priority.py [--flood 48] [--interactive 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time

if sys.path and os.path.basename(sys.path[0]) == "bench":  # run as a script: the packages before bench/engine.py
    sys.path.insert(0, os.path.dirname(sys.path[0]))

import httpx

from cli.up import default_model_dir, ensure_tiny_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.natsserver import free_port


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


async def run(args) -> None:
    model = str(ensure_tiny_model(default_model_dir()))
    port = free_port()
    argv = [sys.executable, "-m", "cli", "up", "--model", model, "--prefill", "0", "--decode", "1",
            "--no-planner", "--port", str(port), "--device-kv-blocks", str(args.device_blocks),
            "--host-kv-gb", "0.5", "--max-num-seqs", str(args.max_num_seqs)]
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

        await bus.subscribe(bus.subjects.load_all(), on_load, LoadReport)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"idle": idle, "busy": busy, "completed": sum(ok), "identical": same,
                       "counters": counters}, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flood", type=int, default=48)
    p.add_argument("--flood-prompt", type=int, default=200)
    p.add_argument("--flood-tokens", type=int, default=300)
    p.add_argument("--interactive", type=int, default=20)
    p.add_argument("--device-blocks", type=int, default=320)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--json", default=None)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
