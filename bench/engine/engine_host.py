"""Host time of the engine per decode step: what the CPU spends around the model.

The real engine on the tiny model (CPU, so the model itself is cheap and the host's part is
visible), a batch of B sequences decoding together. Each decode step is split into

    schedule   Scheduler.schedule(): which sequences compute what, blocks
    inputs     building the flat batch (runner.inputs) and copying it to the device
    model      the forward pass and sampling (launch(), minus the above)
    update     Scheduler.advance() + resolve(): counters, hashes, stops, outputs

per step (median over the decode steps of a run), for the plain loop and for overlapped
scheduling, in the same run. On a GPU the model part runs on the device and the rest is
what overlap hides; on this CPU nothing is hidden (the step runs in the calling thread),
so the overlapped loop shows its own bookkeeping cost instead.

    python -m bench engine-host [--batches 64 256] [--new-tokens 64]
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.common import Benchmark, emit, parse, parser
from bench.common.models import generated
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams

BENCHMARK = Benchmark(
    name="engine-host",
    measures="host ms per decode step of the engine (schedule, inputs, model, update) on the tiny model (CPU), "
             "plain and overlapped loops, batch 64 and 256",
    minutes=1,
    smoke=("--batches", "4", "--new-tokens", "12", "--threads", "1"),
)


class Timers:
    """Wraps an engine's methods to add up their wall time per step."""

    def __init__(self, engine: Engine):
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        sched, runner = engine.scheduler, engine.runner
        self._wrap(sched, "schedule", "schedule")
        self._wrap(sched, "advance", "update")
        self._wrap(sched, "resolve", "update")
        self._wrap(runner, "inputs", "inputs")
        self._wrap(runner, "_input_ids", "inputs")
        self._wrap(runner, "launch", "launch")
        step = engine.step

        def timed_step():
            self.step.clear()
            t0 = time.perf_counter()
            outs = step()
            self.step["total"] = time.perf_counter() - t0
            self.step["model"] = self.step.pop("launch", 0.0) - self.step.get("inputs", 0.0)
            self.steps.append(dict(self.step))
            return outs

        engine.step = timed_step

    def _wrap(self, obj, name: str, bucket: str) -> None:
        fn = getattr(obj, name)
        acc = self.step

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[bucket] += time.perf_counter() - t0

        setattr(obj, name, timed)


def run(model: Path, batch: int, new_tokens: int, overlap: bool) -> dict[str, float]:
    engine = Engine(EngineConfig(model, device="cpu", num_kv_blocks=batch * 8 + 16, max_num_seqs=batch,
                                 max_num_batched_tokens=batch * 32, async_scheduling=overlap,
                                 enable_prefix_caching=True))
    timers = Timers(engine)
    prompts = [[(i * 31 + j * 7) % 4000 + 8 for j in range(32)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)
    decode = timers.steps[3:-3]  # the prefill and the tail (overlap's drain) left out
    return {k: statistics.median(s.get(k, 0.0) for s in decode) * 1e3
            for k in ("total", "schedule", "inputs", "model", "update")}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    args = parse(BENCHMARK, p, argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    model = generated("tiny")
    print(f"engine host time per decode step: tiny model on CPU ({threads} threads), torch {torch.__version__}; "
          f"median over {args.new_tokens} decode steps, ms")
    cols = f"{'loop':<12}{'batch':>6}{'step':>9}{'schedule':>10}{'inputs':>9}{'model':>9}{'update':>9}{'host share':>12}"
    print(cols)
    print("-" * len(cols))
    rows = []
    for batch in args.batches:
        for overlap in (False, True):
            r = run(model, batch, args.new_tokens, overlap)
            host = r["schedule"] + r["inputs"] + r["update"]
            print(f"{'overlapped' if overlap else 'plain':<12}{batch:>6}{r['total']:>9.2f}{r['schedule']:>10.3f}"
                  f"{r['inputs']:>9.3f}{r['model']:>9.2f}{r['update']:>9.3f}{host / r['total']:>12.0%}")
            rows.append({"batch": batch, "overlap": overlap, **r})
    return emit(BENCHMARK, {"threads": threads, "new_tokens": args.new_tokens, "rows": rows}, args)
