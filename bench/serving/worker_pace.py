"""Host CPU of one mock decode worker at real pace, per request and per token, without a gateway.

``python -m bench host-overhead`` measures a worker's step with nothing to wait for (no pacing, no
arrivals). At real pace a worker's cost is elsewhere: a few rows per step, ~100 paced steps a
second, a stream of arrivals (each decoded, admitted, hashed, its KV events published). This
starts a real nats-server and one ``mesh worker mock --mock-speedup 1`` process, and drives it as
a gateway does (``GenerateRequest`` with ``batch_to``, token batches back), closed loop: ``-c``
requests in flight, ``-n`` requests of ``--tokens`` tokens each, prompts of ``--prompt`` random
tokens (the side-by-side harness's chat prompts: ~104 tokens from a dozen words). It prints the
worker process's CPU (all threads, from /proc) per request and per generated token over the
requests after the first ``--warm``, with the steps it ran and the load average.

    python -m bench worker-pace                    # Poisson arrivals at 16/s, 320 measured requests
    python -m bench worker-pace --tree /work/base  # another source tree's worker, for A/B runs
    python -m bench worker-pace --profile out.prof # the worker under cProfile (thread CPU time)

Only the worker is measured: the driver (this process) and nats-server use CPU beside it, so on
a shared host interleave A/B runs and compare the worker's own CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.common.registry import ROOT
from mesh.bus import Bus
from mesh.natsserver import EmbeddedNats
from mesh.protocol import GenerateRequest, LoadReport, SamplingOptions, TokenBatch

BENCHMARK = Benchmark(
    name="worker-pace",
    measures="host CPU of one mock decode worker at real pace (paced steps, a stream of arrivals), per request "
             "and per generated token, driven over a real nats-server as a gateway drives it",
    minutes=1,
    smoke=("--dry-run",),
)

MODEL = "tiny"
WORKER = "wpace"
BATCH_SUBJECT = "bench.pace.batch"
PROFILER = r"""
import cProfile, os, runpy, signal, sys, time
out = sys.argv.pop(1)
prof = cProfile.Profile(time.thread_time)
def dump(*_):
    prof.disable(); prof.dump_stats(out); os._exit(0)
signal.signal(signal.SIGUSR2, dump)
sys.argv = ["mesh"] + sys.argv[1:]
prof.enable()
runpy.run_module("cli", run_name="__main__")
"""


def process_cpu(pid: int) -> tuple[float, float]:
    """User and system seconds of every thread of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Chat-like prompts: a shared opening, then tokens drawn from a dozen words."""
    rng = random.Random(seed)
    words = [rng.randrange(100, 30000) for _ in range(12)]
    head = [5, 881, 1412, 25]  # "user :" and friends: the template's tokens
    return [head + [rng.choice(words) for _ in range(length - len(head))] for _ in range(n)]


async def drive(url: str, pid: int, n: int, c: int, tokens: int, prompt: int, warm: int, rate: float,
                on_start=None) -> dict:
    bus = await Bus.connect(url, "bench-pace")
    subject = bus.subjects.generate(MODEL, WORKER)
    sampling = SamplingOptions(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0)
    reqs = prompts(n + warm, prompt)
    state = {"sent": 0, "done": 0, "tokens": 0, "errors": 0}
    marks: dict[str, tuple[float, tuple[float, float]]] = {}
    loads: list[LoadReport] = []
    finished = asyncio.Event()

    async def send_next() -> None:
        i = state["sent"]
        if i >= len(reqs):
            return
        state["sent"] += 1
        req = GenerateRequest(f"p{i}", MODEL, reqs[i], sampling, created=time.time(), batch_to=BATCH_SUBJECT,
                              stream=format(i, "x"))
        await bus.publish(subject, req, reply=f"bench.pace.r.{i:x}", traced=False)

    async def on_batch(batch: TokenBatch, raw) -> None:
        for chunk in batch.chunks:
            state["tokens"] += len(chunk.token_ids)
            if chunk.finish_reason is None:
                continue
            state["errors"] += chunk.finish_reason == "error"
            state["done"] += 1
            if state["done"] == warm:
                marks["start"] = (time.perf_counter(), process_cpu(pid))
                if on_start is not None:
                    on_start()
                state["tokens"] = 0
            if state["done"] == len(reqs):
                marks["end"] = (time.perf_counter(), process_cpu(pid))
                finished.set()
            if not rate:
                await send_next()

    async def on_load(report: LoadReport, raw) -> None:
        if report.worker_id == WORKER:
            loads.append(report)

    await bus.subscribe(BATCH_SUBJECT, on_batch, TokenBatch, pending_msgs_limit=1 << 20)
    await bus.subscribe(bus.subjects.load_model(MODEL), on_load, LoadReport)
    await bus.nc.flush()
    if rate:  # open loop: Poisson arrivals
        gaps = random.Random(1)
        while state["sent"] < len(reqs):
            await send_next()
            await asyncio.sleep(gaps.expovariate(rate))
    else:
        for _ in range(c):
            await send_next()
    await asyncio.wait_for(finished.wait(), 600)
    await asyncio.sleep(1.2)  # one more load report: the steps run until the last request finished
    await bus.close()
    (t0, cpu0), (t1, cpu1) = marks["start"], marks["end"]
    steps = [r.counters.get("steps", 0) for r in loads]
    cpu_ms = 1000 * (sum(cpu1) - sum(cpu0))
    return {"requests": n, "concurrency": c, "rate": rate, "errors": state["errors"], "seconds": round(t1 - t0, 2),
            "req_s": round(n / (t1 - t0), 1), "worker_cpu_ms_per_s": round(cpu_ms / (t1 - t0), 1),
            "cpu_ms_per_request": round(cpu_ms / n, 3),
            "system_share": round((cpu1[1] - cpu0[1]) * 1000 / cpu_ms, 2), "us_per_token": round(1000 * cpu_ms / state["tokens"], 1),
            "steps_total": max(steps) if steps else None}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("-n", type=int, default=320, help="measured requests")
    p.add_argument("--rate", type=float, default=16.0,
                   help="open loop: Poisson arrivals, requests a second (0: closed loop, -c in flight)")
    p.add_argument("-c", type=int, default=64, help="requests in flight (closed loop)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=104)
    p.add_argument("--warm", type=int, default=40, help="requests finished before the measure starts")
    p.add_argument("--tree", default=str(ROOT), help="the source tree the worker runs")
    p.add_argument("--profile", help="run the worker under cProfile (thread CPU time) and write its stats here")
    p.add_argument("--wrap", help="run the worker under this Python script (it gets the worker's argv and must "
                                  "run ``cli`` as __main__; SIGUSR1 when the measure starts, SIGUSR2 at the end)")
    p.add_argument("--worker-arg", action="append", default=[], help="one more argument for the worker")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    env = {**os.environ, "PYTHONPATH": str(Path(args.tree).resolve())}
    if args.dry_run:
        print(f"DRY RUN: PYTHONPATH={env['PYTHONPATH']} {' '.join(worker_command(args, 'nats://HOST:PORT')[1:])}; "
              f"{args.n} measured requests of {args.tokens} tokens after {args.warm}")
        return emit(BENCHMARK, {"tree": args.tree, "dry_run": True}, args)
    with EmbeddedNats() as nats:
        cmd = worker_command(args, nats.url)
        worker = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  cwd=args.tree)
        try:
            time.sleep(0.5)
            row = asyncio.run(wait_and_drive(nats.url, worker, args))
        finally:
            if args.profile or args.wrap:
                worker.send_signal(12)  # SIGUSR2: the profiler dumps and exits
            else:
                worker.terminate()
            try:
                _, err = worker.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                worker.kill()
            else:
                if args.wrap:
                    print(err[-4000:], file=sys.stderr)
    row["load"] = float(Path("/proc/loadavg").read_text().split()[0])
    row["tree"] = args.tree
    print(json.dumps(row), flush=True)
    return emit(BENCHMARK, row, args)


def worker_command(args, url: str) -> list[str]:
    argv = ["worker", "mock", "--nats", url, "--served-name", MODEL, "--block-size", "16",
            "--mock-speedup", "1", "--worker-id", WORKER, *args.worker_arg]
    if args.profile:
        return [sys.executable, "-c", PROFILER, args.profile, *argv]
    if args.wrap:
        return [sys.executable, args.wrap, *argv]
    return [sys.executable, "-m", "cli", *argv]


async def wait_and_drive(url: str, worker: subprocess.Popen, args) -> dict:
    from mesh.registry import Membership

    bus = await Bus.connect(url, "bench-pace-watch")
    members = Membership(bus)
    await members.start(wait=1.0)
    try:
        for _ in range(600):
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited: {worker.stderr.read()[-2000:]}")
            card = members.get(WORKER)
            if card is not None and card.status == "ready":
                break
            await asyncio.sleep(0.1)
        else:
            raise TimeoutError("the worker did not come up in 60 s")
    finally:
        await members.stop()
        await bus.close()
    return await drive(url, worker.pid, args.n, args.c, args.tokens, args.prompt, args.warm, args.rate,
                       on_start=(lambda: worker.send_signal(10)) if args.wrap else None)  # SIGUSR1: measure from now

