"""One model over several ranks: decode throughput, step time and pipeline utilisation on this CPU,
or (``--hosts 2``) PP 2 with one stage per simulated host against PP 2 on one.

    python -m bench parallel             # the `small` model, batch 32 and 128
    python -m bench parallel --quick     # a short run: batch 32, a few tokens
    sudo python -m bench parallel --hosts 2   # PP 2 across two namespace hosts vs on one (root)

The model is ``small`` (``mesh model tiny --size small``: 10 layers, hidden 640) with its 10
query and 5 KV heads of 64 regrouped as 8 and 4 of 80, so that TP 2 divides them: every matrix
and the KV are the same size, so every figure is ``small``'s.

Layouts (``engine.parallel``): PP 1 (one rank); PP 2 one step at a time (``--pp-steps-in-flight 1``)
without micro-batches (``pp2``: ``--pp-microbatches 1``) and with them (``pp2_mb``: one per stage);
PP 2 with a step per stage in flight, each of half the sequences (``pp2_steps``, the default at
``--pp 2``: ``engine.inflight``); TP 2; and TP 2 x PP 2 (the default: steps in flight);
``--layouts ... pp2_mb4`` adds PP 2 one step at a time with four micro-batches, ``tp2_pp2_mb``
TP 2 x PP 2 one step at a time. Every layout has the same CPU threads in all (``--threads``,
default: the cores this process may use), split evenly over its ranks, rank 0's share too, so
that no layout runs more threads than another. (On a loaded machine a rank of two threads waits
at every op for the thread that was descheduled: ``--threads 1`` compares the layouts' work.)

Per layout and batch: a greedy run of ``--new-tokens``, timed from the step after the prefill
(every prompt has its first token) to the end, the best of ``--reps`` rounds (each round runs
every layout in turn, all of a batch's engines open at once):

* ``decode_tok_s`` and ``step_ms`` (per decode step: with steps in flight, a step carries one
  group's sequences, about batch / stages of them);
* ``utilisation``: the stages' busy time (each stage's first rank: seconds computing its layers,
  the embeddings, rank 0's logits; not waiting for activations or for a send to be taken) over
  stages x wall time, over the decode steps (``Engine.stage_stats``). Rank 0's scheduling and
  sampling count as idle: they are the pipeline's bubble between steps.

Every layout's tokens are compared with PP 1's (``identical``). The last line of the output is
one JSON object with every figure. On a shared machine, wall times measure the other tenants
too: compare layouts of one run, and rerun on a quiet one for figures to keep.

``--hosts 2`` (``bench.engine.parallel_hosts``): real decode workers of ``--pp 2`` on simulated
hosts (``tests.helpers.hostbed``), one with both stages on host 1, one with its second stage
joined from host 2 (``mesh rank --join``); decode tok/s of a batch of greedy requests sent to
each in turn over the bus. Target: across hosts within 1.3x of one host.
"""

from __future__ import annotations

import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams

BENCHMARK = Benchmark(
    name="parallel",
    measures="decode tok/s, step time and pipeline utilisation of PP 1, PP 2 (one step at a time with micro-batches "
             "off and on, and a step per stage in flight), TP 2 and TP 2 x PP 2 on the `small` model (CPU), batch 32 "
             "and 128; or (--hosts 2, root) PP 2 with one stage per simulated host against PP 2 on one",
    target="utilisation >= 0.7 at batch 32 with the stages overlapped (steps in flight), at least pp2_mb's tok/s; "
           "across hosts within 1.3x of one host (issue 50)",
    minutes=7,
    smoke=("--dry-run",),
)

BLOCK_SIZE = 16
ONE_STEP = {"pp_steps_in_flight": 1}  # one step at a time over the stages
LAYOUTS = {  # name -> EngineConfig fields
    "pp1": {},
    "pp2": {"pp": 2, "pp_microbatches": 1, **ONE_STEP},
    "pp2_mb": {"pp": 2, **ONE_STEP},
    "pp2_steps": {"pp": 2},
    "tp2": {"tp": 2},
    "tp2_pp2": {"tp": 2, "pp": 2},
    "tp2_pp2_mb": {"tp": 2, "pp": 2, **ONE_STEP},
    "pp2_mb4": {"pp": 2, "pp_microbatches": 4, **ONE_STEP},
}
DEFAULT_LAYOUTS = ["pp1", "pp2", "pp2_mb", "pp2_steps", "tp2", "tp2_pp2"]


# ``small`` has 10 query and 5 KV heads of 64, which 2 ranks cannot split: the same shapes as 8 and 4
# heads of 80 (every projection, the KV bytes and the attention work are the same), which they can.
SMALL_FOR_TP = {"num_attention_heads": 8, "num_key_value_heads": 4}


def small_model_dir() -> Path:
    """The ``small`` benchmark model with its heads regrouped for TP 2 (``SMALL_FOR_TP``), written
    once to a cache dir."""
    from engine.tiny import write_tiny_model

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdmesh" / "bench-small-tp"
    if not (cache / "model.safetensors").is_file():
        print(f"writing the small model (8 heads of 80, 4 KV heads) to {cache} ...", file=sys.stderr)
        write_tiny_model(cache, size="small", seed=0, **SMALL_FOR_TP)
    return cache


def open_engine(model_dir: Path, layout: dict, batch: int, prompt_len: int, new_tokens: int, threads: int) -> Engine:
    """An engine of ``layout`` whose helper ranks take ``threads`` over the ranks each (rank 0's
    share is set before each of its runs: the threads are the process's)."""
    torch.set_num_threads(threads)  # the helper ranks take this count over the ranks
    return Engine(EngineConfig(
        model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
        num_kv_blocks=batch * -(-(prompt_len + new_tokens) // BLOCK_SIZE) + 16,
        max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * prompt_len), enable_prefix_caching=False,
        **layout))


def stage_busy(engine: Engine) -> list[float]:
    """Busy seconds per stage (its first rank's) since the last reset; [] with one stage."""
    stats = engine.stage_stats(reset=True)
    tp = engine.layout.tp
    return [s.busy_s for s in stats if s.rank % tp == 0]


def run(engine: Engine, prompts: list[list[int]], n: int) -> dict:
    """``n`` greedy tokens of every prompt; the decode steps (after every prompt's first token)
    timed, with the stages' busy seconds over them."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    seqs = [engine.new_sequence(p, params) for p in prompts]
    for s in seqs:
        engine.add(s)
    while any(s.num_output_tokens == 0 for s in seqs):  # the prefill (one step when the budget takes it)
        engine.step()
    stage_busy(engine)
    s0, t0 = engine.num_steps, time.perf_counter()
    while engine.has_work:
        engine.step()
    wall = time.perf_counter() - t0
    busy = stage_busy(engine)
    row = {"decode_tok_s": sum(s.num_output_tokens - 1 for s in seqs) / wall,
           "step_ms": wall / max(1, engine.num_steps - s0) * 1000, "out": [s.output_token_ids for s in seqs]}
    if busy:
        row["utilisation"] = sum(busy) / (len(busy) * wall)
        row["stage_busy_s"] = [round(b, 3) for b in busy]
    return row


def measure(engines: dict[str, Engine], prompts: list[list[int]], n: int, reps: int, threads: int) -> dict[str, dict]:
    """Per layout, the best of ``reps`` rounds; each round runs every layout in turn, so that a
    slow spell of a shared machine spoils a round of all of them, not one layout's figure."""
    best: dict[str, dict] = {}
    for _ in range(reps):
        for name, engine in engines.items():
            torch.set_num_threads(max(1, threads // engine.layout.size))  # rank 0's share
            row = run(engine, prompts, n)
            if name not in best or row["decode_tok_s"] > best[name]["decode_tok_s"]:
                best[name] = row
    return best


def run_layouts(args) -> dict:
    """Every layout of ``args.layouts`` at every batch size, in this process (the helper ranks as its children)."""
    model_dir = Path(args.model) if args.model else small_model_dir()
    rows = []
    print(f"{'layout':<10} {'batch':>5} {'tok/s':>8} {'step ms':>8} {'util':>5}  identical", flush=True)
    for batch in args.batch:
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(8, 4096) for _ in range(args.prompt_len)] for _ in range(batch)]
        engines: dict[str, Engine] = {}
        try:
            for name in args.layouts:
                engines[name] = open_engine(model_dir, LAYOUTS[name], batch, args.prompt_len, args.new_tokens,
                                            args.threads)
                run(engines[name], prompts[:4], 2)  # warm-up: every rank's first step
            best = measure(engines, prompts, args.new_tokens, args.reps, args.threads)
        finally:
            for engine in engines.values():
                engine.close()
        reference = best[args.layouts[0]]["out"]
        for name in args.layouts:
            row = best[name]
            out = row.pop("out")
            row = {"layout": name, "batch": batch, **row, "identical": out == reference}
            rows.append(row)
            util = f"{row['utilisation']:.2f}" if "utilisation" in row else "-"
            print(f"{name:<10} {batch:>5} {row['decode_tok_s']:>8.1f} {row['step_ms']:>8.1f} {util:>5}  "
                  f"{row['identical']}", flush=True)
    return {"model": model_dir.name, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
            "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--model", help="model directory (default: the `small` model in a cache dir)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default: 32 and 128; --hosts: 32)")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=DEFAULT_LAYOUTS)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPU threads of every layout, all ranks together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="batch 32, 8 new tokens, one round")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                   help="2: PP 2 with one stage per simulated host against PP 2 on one (real workers; root)")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.quick:
        args.batch, args.new_tokens, args.reps = args.batch or [32], 8, 1
    if args.hosts == 2:
        from bench.engine import parallel_hosts

        return parallel_hosts.run_hosts(BENCHMARK, args)
    args.batch = args.batch or [32, 128]
    if args.dry_run:
        print(f"DRY RUN: layouts {', '.join(args.layouts)} at batch {', '.join(map(str, args.batch))}, "
              f"{args.new_tokens} new tokens after {args.prompt_len}-token prompts, best of {args.reps}")
        return emit(BENCHMARK, {"model": "small", "threads": args.threads, "rows": []}, args)
    figures = run_layouts(args)
    emit(BENCHMARK, figures, args)
    return 0 if all(r["identical"] for r in figures["rows"]) else 1
