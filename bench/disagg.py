"""Aggregated vs disaggregated serving under a mixed load, on CPU.

Short requests stream tokens continuously while long prompts keep arriving.
Both runs use the same two cores, one worker pinned to each:

- aggregated: two decode workers (core 0 and core 1), each request sent to the one with fewer
  requests in flight; each long prefill stalls the streams of its worker.
- disaggregated: a prefill worker (core 0) computes the long prompts and ships their KV over
  shm to one decode worker (core 1), whose streams should no longer stall.

Both use the ``small`` model (~52M params, fp32), the same arrival schedule, and talk to the
workers directly on the bus (nats-server and this load generator share the cores).

    python bench/disagg.py [--seconds 40] [--streams 4] [--long-tokens 1024] [--long-every 4.0] [--prefill-nice 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from mesh.bus import Bus
from mesh.client import generate
from mesh.natsserver import EmbeddedNats
from mesh.protocol import GenerateRequest, LoadReport, SamplingOptions
from mesh.registry import Membership


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def spawn(core: int, *args: str, nice: int = 0) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = ["taskset", "-c", str(core), "nice", "-n", str(nice), sys.executable, "-m", "cli", "worker", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)


class LeastInFlight:
    """Which decode worker gets the next request: the one with the fewest of ours in flight."""

    def __init__(self, workers: list[str]):
        self.inflight = dict.fromkeys(workers, 0)

    def pick(self) -> str:
        return min(self.inflight, key=self.inflight.get)


async def one_request(bus, picker: LeastInFlight, prompt, max_tokens, sink: dict) -> None:
    req = GenerateRequest(uuid.uuid4().hex, "small", prompt,
                          SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    worker = picker.pick()
    picker.inflight[worker] += 1
    t0 = time.perf_counter()
    last = None
    try:
        async for chunk in generate(bus, worker, req, first_timeout=300, idle_timeout=300):
            now = time.perf_counter()
            if last is None:
                sink["ttft"].append(now - t0)
            else:
                sink["itl"].extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
            last = now
        sink["tokens"] = sink.get("tokens", 0) + max_tokens
    finally:
        picker.inflight[worker] -= 1


async def run_mode(url: str, model: str, disagg: bool, args) -> dict:
    worker_flags = ["--model", model, "--nats", url, "--device-kv-blocks", "4096", "--max-num-batched-tokens", "512"]
    procs = [spawn(1, "decode", *worker_flags, "--worker-id", "bench-decode", "--transports", "shm", "--prefill-timeout", "30",
                   "--disagg-threshold", str(args.long_tokens // 2 if disagg else 10**9))]
    # Core 0 also runs nats-server and this load generator (two cores is all there is here);
    # --prefill-nice lets its worker yield to them so that the measurement is not slowed.
    if disagg:
        procs.append(spawn(0, "prefill", *worker_flags, "--worker-id", "bench-prefill", "--transports", "shm",
                           nice=args.prefill_nice))
        picker = LeastInFlight(["bench-decode"])
    else:
        procs.append(spawn(0, "decode", *worker_flags, "--worker-id", "bench-decode-2", "--disagg-threshold",
                           str(10**9), nice=args.prefill_nice))
        picker = LeastInFlight(["bench-decode", "bench-decode-2"])
    bus = await Bus.connect(url, "bench-disagg")
    members = Membership(bus)
    await members.start()
    loads: dict[str, LoadReport] = {}

    async def on_load(r: LoadReport, raw) -> None:
        loads[r.worker_id] = r

    await bus.subscribe(bus.subjects.load_all(), on_load, LoadReport)
    try:
        while len(members.cards()) < 2:
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.0)  # load reports reach the decode worker
        rng = random.Random(0)
        short = {"ttft": [], "itl": []}
        long_ = {"ttft": [], "itl": []}
        for worker in picker.inflight:  # warm-up, not measured
            await one_request(bus, LeastInFlight([worker]), [rng.randrange(3, 4096) for _ in range(64)], 4,
                              {"ttft": [], "itl": []})
        start = time.perf_counter()
        end = time.perf_counter() + args.seconds
        tasks = []

        async def streamer(i: int) -> None:
            r = random.Random(100 + i)
            while time.perf_counter() < end:
                prompt = [r.randrange(3, 4096) for _ in range(args.short_tokens)]
                await one_request(bus, picker, prompt, args.short_output, short)

        async def longs() -> None:
            while time.perf_counter() < end:
                prompt = [rng.randrange(3, 4096) for _ in range(args.long_tokens)]
                tasks.append(asyncio.create_task(one_request(bus, picker, prompt, 8, long_)))
                await asyncio.sleep(args.long_every)

        await asyncio.gather(*(streamer(i) for i in range(args.streams)), longs())
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        counters = loads.get("bench-decode").counters if "bench-decode" in loads else {}
        return {"short": short, "long": long_, "remote": counters.get("remote_prefill_done", 0), "counters": counters,
                "tok_s": (short.get("tokens", 0) + long_.get("tokens", 0)) / elapsed}
    finally:
        await members.stop()
        await bus.close()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


async def main_async(args) -> None:
    model = args.model
    tmp = None
    if model is None:
        from engine.tiny import write_tiny_model

        tmp = tempfile.mkdtemp(prefix="pdmesh-bench-")
        model = str(write_tiny_model(Path(tmp) / "small", size="small"))
    results = {}
    with EmbeddedNats() as nats:
        for name, disagg in (("aggregated", False), ("disaggregated", True)):
            results[name] = await run_mode(nats.url, model, disagg, args)
    print(f"mixed load for {args.seconds:.0f}s: {args.streams} streams of {args.short_tokens}->{args.short_output} tokens, "
          f"a {args.long_tokens}-token prompt every {args.long_every}s; small model, fp32, one worker per core "
          "(aggregated: 2 decode; disaggregated: 1 prefill + 1 decode)")
    print(f"{'mode':<14} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'ITL max ms':>10} | {'short TTFT p50':>14} "
          f"{'long TTFT p50':>13} {'long TTFT p99':>13} | {'tokens':>6} {'tok/s':>6} {'remote':>6}")
    for name, r in results.items():
        itl = r["short"]["itl"]
        print(f"{name:<14} {pct(itl, 50) * 1e3:>10.1f} {pct(itl, 99) * 1e3:>10.1f} {max(itl) * 1e3:>10.1f} | "
              f"{pct(r['short']['ttft'], 50) * 1e3:>12.0f}ms {pct(r['long']['ttft'], 50) * 1e3:>11.0f}ms "
              f"{pct(r['long']['ttft'], 99) * 1e3:>11.0f}ms | {len(itl):>6} {r['tok_s']:>6.1f} {r['remote']:>6}")
    for name, r in results.items():
        print(f"  {name} decode worker counters: {r['counters']}")
    a, d = results["aggregated"]["short"]["itl"], results["disaggregated"]["short"]["itl"]
    print(f"ITL p99 aggregated / disaggregated = {pct(a, 99) / pct(d, 99):.2f}x; "
          f"ITL p50 ratio = {pct(a, 50) / pct(d, 50):.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: generate the small model)")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument("--short-output", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--long-every", type=float, default=4.0)
    p.add_argument("--prefill-nice", type=int, default=0,
                   help="nice level of the core-0 worker (prefill, or the second decode worker; core 0 is shared)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
