"""Aggregated vs disaggregated serving under a mixed load, on CPU.

Short requests stream tokens continuously while long prompts keep arriving.
Both runs use the same two cores, one worker pinned to each:

- aggregated: two decode workers (core 0 and core 1), each request sent to the one with fewer
  requests in flight; each long prefill stalls the streams of its worker.
- disaggregated: a prefill worker (core 0) computes the long prompts and ships their KV over
  shm to one decode worker (core 1), whose streams should no longer stall.

Both use the ``small`` model (~52M params, fp32), the same arrival schedule, and talk to the
workers directly on the bus (nats-server and this load generator share the cores).

    python -m bench disagg [--seconds 40] [--streams 4] [--long-tokens 1024] [--long-every 4.0] [--prefill-nice 10]
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import uuid

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.common.models import model_dir as resolve_model
from mesh.bus import Bus
from mesh.client import generate
from mesh.loads import subscribe_loads
from mesh.natsserver import EmbeddedNats
from mesh.protocol import GenerateRequest, LoadReport, SamplingOptions
from mesh.registry import Membership

MODEL = "small"  # the workers' served name, whichever --model
BENCHMARK = Benchmark(
    name="disagg",
    measures="decode ITL of short streams while long prompts arrive, aggregated (two decode workers) against "
             "disaggregated (a prefill worker ships the KV over shm), one worker per core (CPU, `small`)",
    target="decode ITL p99 stops spiking under long prefills",
    minutes=2,
    smoke=("--dry-run",),
)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def worker_commands(url: str, model: str, disagg: bool, args) -> list[list[str]]:
    """The two workers of a mode, each pinned to its core: the decode worker on core 1, on core 0 the
    prefill worker (disaggregated) or a second decode worker (aggregated)."""
    flags = ["--model", model, "--served-name", MODEL, "--nats", url, "--device-kv-blocks", "4096",
             "--max-num-batched-tokens", "512"]
    decode = [*_pinned(1, 0), "decode", *flags, "--worker-id", "bench-decode", "--transports", "shm",
              "--prefill-timeout", "30", "--disagg-threshold", str(args.long_tokens // 2 if disagg else 10**9)]
    # Core 0 also runs nats-server and this load generator (two cores is all there is here);
    # --prefill-nice lets its worker yield to them so that the measurement is not slowed.
    if disagg:
        other = [*_pinned(0, args.prefill_nice), "prefill", *flags, "--worker-id", "bench-prefill", "--transports", "shm"]
    else:
        other = [*_pinned(0, args.prefill_nice), "decode", *flags, "--worker-id", "bench-decode-2",
                 "--disagg-threshold", str(10**9)]
    return [decode, other]


def _pinned(core: int, nice: int) -> list[str]:
    return ["taskset", "-c", str(core), "nice", "-n", str(nice), sys.executable, "-m", "cli", "worker"]


def spawn(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)


class LeastInFlight:
    """Which decode worker gets the next request: the one with the fewest of ours in flight."""

    def __init__(self, workers: list[str]):
        self.inflight = dict.fromkeys(workers, 0)

    def pick(self) -> str:
        return min(self.inflight, key=self.inflight.get)


async def one_request(bus, picker: LeastInFlight, prompt, max_tokens, sink: dict) -> None:
    req = GenerateRequest(uuid.uuid4().hex, MODEL, prompt,
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
    procs = [spawn(cmd) for cmd in worker_commands(url, model, disagg, args)]
    picker = LeastInFlight(["bench-decode"] if disagg else ["bench-decode", "bench-decode-2"])
    bus = await Bus.connect(url, "bench-disagg")
    members = Membership(bus)
    await members.start()
    loads: dict[str, LoadReport] = {}

    async def on_load(r: LoadReport, raw) -> None:
        loads[r.worker_id] = r

    await subscribe_loads(bus, on_load)
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


async def main_async(args) -> dict:
    model = str(resolve_model(args.model, "small"))
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
    figures = summary(results)
    print(f"ITL p99 aggregated / disaggregated = {figures['itl_p99_ratio']:.2f}x; "
          f"ITL p50 ratio = {figures['itl_p50_ratio']:.2f}x")
    return figures


def summary(results: dict) -> dict:
    """Per mode: ITL and TTFT percentiles (ms), tokens/s, remote prefills; and aggregated / disaggregated."""
    modes = {name: {"itl_p50_ms": pct(r["short"]["itl"], 50) * 1e3, "itl_p99_ms": pct(r["short"]["itl"], 99) * 1e3,
                    "short_ttft_p50_ms": pct(r["short"]["ttft"], 50) * 1e3,
                    "long_ttft_p50_ms": pct(r["long"]["ttft"], 50) * 1e3,
                    "long_ttft_p99_ms": pct(r["long"]["ttft"], 99) * 1e3, "tok_s": r["tok_s"],
                    "remote_prefills": r["remote"]} for name, r in results.items()}
    a, d = modes.get("aggregated"), modes.get("disaggregated")
    ratio = (lambda k: a[k] / d[k]) if a and d else (lambda k: float("nan"))
    return {"modes": modes, "itl_p99_ratio": ratio("itl_p99_ms"), "itl_p50_ratio": ratio("itl_p50_ms")}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--model", default=None, help="model directory, or a generated size (default: small)")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument("--short-output", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--long-every", type=float, default=4.0)
    p.add_argument("--prefill-nice", type=int, default=0,
                   help="nice level of the core-0 worker (prefill, or the second decode worker; core 0 is shared)")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.dry_run:
        for name, disagg in (("aggregated", False), ("disaggregated", True)):
            for cmd in worker_commands("nats://HOST:PORT", args.model or "small", disagg, args):
                print(f"DRY RUN: {name}: {' '.join(cmd)}")
        return emit(BENCHMARK, summary({}), args)
    return emit(BENCHMARK, asyncio.run(main_async(args)), args)
