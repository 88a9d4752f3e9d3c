"""Host work per engine step in a decode worker, with nothing else to wait for.

A real ``DecodeWorker`` runs in this process on the mocker with its timing model switched off
(``speedup=inf``: the engine step is scheduling, bookkeeping and the per-step output, no sleep), fed
``--batch`` requests at once over a real nats-server; a separate consumer process reads the token
streams. Per engine step it prints the host milliseconds spent

- in the engine thread: schedule + (no-op) execute + update (``engine.step``),
- on the event loop: processing the step's outputs and publishing them (``handle_outputs``),
- in the whole process (CPU time of every thread, over the decode phase),

and the microseconds per generated token. ``--emit single`` makes the worker send one
``TokenChunk`` per request per step, as a gateway that asks for no batches (or a custom worker's
client) gets; the default ``batch`` is the per-step ``TokenBatch``. Both run by default, in that
order, so the baseline is in the same run.

    python -m bench host-overhead                      # batch 64 and 256, 256 tokens, both emit modes, 3 reps
    python -m bench host-overhead --batch 256 --emit batch

Every case runs in a fresh process (a case run after another in the same process inherited its
heap and measured up to twice as slow); the table is the median of ``--reps`` interleaved runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import subprocess
import sys
import time

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.common.registry import ROOT
from decode.worker import DecodeWorker
from mesh.bus import Bus
from mesh.natsserver import EmbeddedNats
from mesh.protocol import GenerateRequest, SamplingOptions
from mocker.engine import MockConfig
from worker.base import WorkerSettings

BENCHMARK = Benchmark(
    name="host-overhead",
    measures="host ms per engine step of a real decode worker on the mocker with no step time (engine, emission, "
             "whole process) and us per token, batch 64 and 256, a TokenChunk per row or a TokenBatch per step",
    target="<= 2 ms of host work per step at batch 256 (issue 16)",
    minutes=2,
    smoke=("--dry-run",),
)
REPLY_PREFIX = "bench.replies"

CONSUMER = r"""
import asyncio, sys, time
import nats
from mesh.protocol import TokenBatch, TokenChunk, decode
url, want = sys.argv[1], int(sys.argv[2])
async def main():
    nc = await nats.connect(url)
    done = asyncio.Event(); state = {"finished": 0, "tokens": 0, "messages": 0}
    def take(chunk):
        state["tokens"] += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            state["finished"] += 1
    async def on_msg(msg):
        state["messages"] += 1
        m = decode(msg.data)
        for c in (m.chunks if isinstance(m, TokenBatch) else [m]):
            take(c)
        if state["finished"] >= want:
            done.set()
    await nc.subscribe(sys.argv[3] + ".>", cb=on_msg, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.wait_for(done.wait(), 600)
    print(state["tokens"], state["messages"], flush=True)
    await nc.close()
asyncio.run(main())
"""


async def run_one(url: str, batch: int, tokens: int, prompt: int, emit: str) -> dict:
    cfg = MockConfig(model_name="bench", speedup=math.inf, max_num_seqs=batch, num_blocks=batch * 32 + 64,
                     max_num_batched_tokens=max(8192, prompt))
    worker = DecodeWorker(WorkerSettings(nats_url=url, engine=cfg, metrics_port=-1, load_interval=5.0))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(worker.ready.wait(), 60)

    step_s = [0.0]
    steps = [0]
    plain_step = worker.engine.step

    def timed_step():
        t0 = time.thread_time()
        out = plain_step()
        step_s[0] += time.thread_time() - t0
        steps[0] += 1
        return out

    worker.engine.step = timed_step
    emit_s = [0.0]
    plain_handle = worker.handle_outputs

    async def timed_handle(outs):
        t0 = time.thread_time()
        await plain_handle(outs)
        emit_s[0] += time.thread_time() - t0

    worker.handle_outputs = timed_handle

    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, url, str(batch), REPLY_PREFIX],
                                stdout=subprocess.PIPE, text=True)
    assert consumer.stdout.readline().strip() == "ready"
    bus = await Bus.connect(url, "bench-client")
    subject = bus.subjects.generate("bench", worker.worker_id)
    sampling = SamplingOptions(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    batch_subject = f"{REPLY_PREFIX}.batch" if emit == "batch" else ""
    for i in range(batch):
        req = GenerateRequest(f"r{i}", "bench", [(7 * i + j) % 30000 + 1 for j in range(prompt)], sampling,
                              batch_to=batch_subject, stream=format(i, "x"))
        await bus.publish(subject, req, reply=f"{REPLY_PREFIX}.{i:x}", traced=False)
    await bus.nc.flush()

    # measure the decode phase: from the step after every request was admitted to the last token
    while steps[0] == 0 or worker.engine.scheduler.waiting or any(
            s.is_prefilling for s in worker.engine.scheduler.running):
        await asyncio.sleep(0.001)
    s0, e0, n0 = step_s[0], emit_s[0], steps[0]
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    line = await asyncio.to_thread(consumer.stdout.readline)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    n = steps[0] - n0
    got_tokens, messages = (int(x) for x in line.split())
    consumer.wait(30)
    stop.set()
    await run
    await bus.close()
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    decode_tokens = n * batch
    return {
        "batch": batch, "emit": emit, "steps": n, "tokens": got_tokens, "messages": messages,
        "step_ms": round(1000 * (step_s[0] - s0) / n, 3),
        "emit_ms": round(1000 * (emit_s[0] - e0) / n, 3),
        "process_cpu_ms_per_step": round(1000 * cpu / n, 3),
        "us_per_token": round(1e6 * cpu / decode_tokens, 2),
        "wall_ms_per_step": round(1000 * wall / n, 3),
    }


def bare_step_ms(batch: int, steps: int = 200) -> float:
    """The mocker's ``EngineCore.step`` alone (paced: no sleep), median of ``steps`` steps."""
    import random
    import statistics

    from engine.sampling import SamplingParams
    from mocker.engine import MockEngine

    eng = MockEngine(MockConfig(speedup=1000, block_size=16, max_num_seqs=batch, num_blocks=8 * batch * 32,
                                max_num_batched_tokens=1 << 16))
    eng.paced = True
    rng = random.Random(0)
    for _ in range(batch):
        eng.add(eng.new_sequence([rng.randrange(1, 30000) for _ in range(128)],
                                 SamplingParams(max_tokens=1 << 20, ignore_eos=True)))
    times = []
    for _ in range(steps + 20):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        eng.take_owed_seconds()
    return 1000 * statistics.median(times[20:])


async def run(args) -> dict:
    yardstick = bare_step_ms(256)
    print(f"this machine now: the mocker's engine step alone at batch 256 takes {yardstick:.3f} ms "
          "(no worker, no bus: a yardstick for the machine's speed, which varies on a shared host)", flush=True)
    runs: dict[tuple[int, str], list[dict]] = {}
    with EmbeddedNats() as nats:
        # every case in a fresh process, so that no case inherits another's heap
        for _ in range(args.reps):
            for batch in args.batch:
                for emit_mode in args.emit:
                    out = await asyncio.to_thread(subprocess.run, case_command(nats.url, batch, emit_mode, args),
                                                  capture_output=True, text=True, timeout=600, check=True, cwd=ROOT)
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                    runs.setdefault((batch, emit_mode), []).append(row)
                    print(json.dumps(row), flush=True)
    rows = [sorted(rs, key=lambda r: r["step_ms"] + r["emit_ms"])[len(rs) // 2] for rs in runs.values()]
    print(f"median of {args.reps} runs per case, each in a fresh process")
    print(f"{'batch':>5} {'emit':>6} {'engine ms/step':>14} {'emit ms/step':>12} {'host ms/step':>12} "
          f"{'process ms/step':>15} {'us/token':>8} {'msgs':>6}")
    for r in rows:
        host = round(r["step_ms"] + r["emit_ms"], 3)
        print(f"{r['batch']:>5} {r['emit']:>6} {r['step_ms']:>14} {r['emit_ms']:>12} {host:>12} "
              f"{r['process_cpu_ms_per_step']:>15} {r['us_per_token']:>8} {r['messages']:>6}")
    b256 = [r for r in rows if r["batch"] == 256 and r["emit"] == "batch"]
    if b256:
        host = b256[0]["step_ms"] + b256[0]["emit_ms"]
        print(f"target: <= 2 ms of host work per step at batch 256 (per-step emission): {host:.2f} ms, "
              f"{'met' if host <= 2.0 else 'NOT met'}")
    return {"yardstick_ms": yardstick, "reps": args.reps, "tokens": args.tokens, "rows": rows}


def case_command(url: str, batch: int, emit_mode: str, args) -> list[str]:
    """One case in a fresh process (``--one``: prints its row as JSON)."""
    return [sys.executable, "-m", "bench", BENCHMARK.name, "--one", url, str(batch), emit_mode,
            "--tokens", str(args.tokens), "--prompt", str(args.prompt)]


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--emit", nargs="+", choices=["single", "batch"], default=["single", "batch"])
    p.add_argument("--reps", type=int, default=3, help="runs per case, interleaved; the median is reported")
    p.add_argument("--one", nargs=3, metavar=("URL", "BATCH", "EMIT"), help=argparse.SUPPRESS)  # a case, in a child
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.one:
        url, batch, emit_mode = args.one
        print(json.dumps(asyncio.run(run_one(url, int(batch), args.tokens, args.prompt, emit_mode))), flush=True)
        return 0
    if args.dry_run:
        yardstick = bare_step_ms(8, steps=10)
        print(f"DRY RUN: the yardstick at batch 8: {yardstick:.3f} ms; then per case, {args.reps} times: "
              f"{' '.join(case_command('nats://HOST:PORT', args.batch[0], args.emit[0], args)[1:])}")
        return emit(BENCHMARK, {"yardstick_ms": None, "reps": args.reps, "tokens": args.tokens, "rows": []}, args)
    return emit(BENCHMARK, asyncio.run(run(args)), args)
