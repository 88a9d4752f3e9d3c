"""Expert parallelism on this CPU: ``python -m bench moe --ep N`` (``bench/engine/moe.py`` runs this).

    python -m bench moe --ep 2                    # the tiny and the small-sized Qwen3-MoE, EP 1 against EP 2
    python -m bench moe --ep 2 --sizes small-moe --quick

The same model at ``--ep 1`` (one rank) and ``--ep N`` (rank 0: attention, KV, router and 1/N of
the experts; N - 1 ranks that hold the other experts only, gloo between them), both engines open
at once and measured in turns, each case the best of ``--reps`` runs. Every layout has the same
CPU threads in all (``--threads``, default: the usable cores), split evenly over its ranks.

* decode tok/s = B / decode step (median step of a run after the prefill, as ``bench engine``);
  prefill tok/s = prompt tokens / best wall time of a one-token call;
* ``a2a share``: the wall time rank 0 spends in the expert all-to-alls (counts, rows out,
  outputs back; waits for the other ranks included) over the time of the same steps: decode,
  the median over the steps of a run; prefill, over the call;
* ``identical``: EP N's greedy tokens are EP 1's.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from bench.common.models import generated
from bench.engine import engine as compare  # its cases and prompts
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.sampling import SamplingParams

BLOCK_SIZE = 16


class EpRunner:
    """An engine with its steps timed, and rank 0's seconds in the expert all-to-alls at each step."""

    def __init__(self, model_dir, ep: int, cases, threads: int):
        need = max(sum(-(-(n + c.new_tokens) // BLOCK_SIZE) for n in c.prompt_lens) for c in cases)
        torch.set_num_threads(threads)  # the helper ranks take this count over the ranks
        self.engine = Engine(EngineConfig(
            model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=need + 16, ep=ep,
            max_num_batched_tokens=max(2048, *(c.prompt_tokens for c in cases)), enable_prefix_caching=False))
        self.threads = max(1, threads // self.engine.layout.size)  # rank 0's share
        experts = self.engine.model.shard.experts
        self.dispatch = experts.dispatch if experts is not None else None
        self.stamps: list[tuple[float, float]] = []
        step = self.engine.step

        def timed_step():
            out = step()
            self.stamps.append((time.perf_counter(), self.a2a_seconds))
            return out

        self.engine.step = timed_step

    @property
    def a2a_seconds(self) -> float:
        return self.dispatch.seconds if self.dispatch is not None else 0.0

    def generate(self, prompts, n: int) -> tuple[float, float, list[list[int]]]:
        """(wall seconds, seconds in all-to-alls, tokens); ``stamps`` holds each step's."""
        torch.set_num_threads(self.threads)
        self.stamps = [(time.perf_counter(), self.a2a_seconds)]
        seqs = self.engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        (t0, a0), (t1, a1) = self.stamps[0], self.stamps[-1]
        return t1 - t0, a1 - a0, [list(s.output_token_ids) for s in seqs]

    def decode_steps(self) -> tuple[float, float]:
        """(median decode step seconds, median all-to-all share of a decode step) of the last run."""
        steps = list(zip(self.stamps[1:], self.stamps[2:], strict=False))  # after the prefill step
        return (statistics.median(t1 - t0 for (t0, _), (t1, _) in steps),
                statistics.median((a1 - a0) / (t1 - t0) for (t0, a0), (t1, a1) in steps))


def measure(case, runners: dict[int, EpRunner], prompts, reps: int) -> dict:
    """Per EP degree: tok/s, ms and the all-to-all share (best run: the fastest), and its tokens."""
    best: dict[int, dict] = {}
    for r in runners.values():
        r.generate(prompts, min(case.new_tokens, 3))  # warm-up at these shapes
    for rep in range(reps):
        for ep, r in (runners.items() if rep % 2 == 0 else reversed(runners.items())):
            if case.kind == "prefill":
                wall, a2a, toks = r.generate(prompts, 1)
                row = {"tok_s": case.prompt_tokens / wall, "ms": wall * 1e3, "a2a_share": a2a / wall}
            else:
                _, _, toks = r.generate(prompts, case.new_tokens)
                step, share = r.decode_steps()
                row = {"tok_s": case.batch / step, "ms": step * 1e3, "a2a_share": share}
            if ep not in best or row["tok_s"] > best[ep]["tok_s"]:
                best[ep] = row | {"tokens": toks}
    return best


def run_ep(args) -> dict:
    threads = args.threads or len(os.sched_getaffinity(0))
    reps = args.reps or (1 if args.quick else 3)
    cases = [c for c in compare.build_cases(args.quick, args.seed) if "mixed" not in c.label]
    out = {"mode": "cpu-moe-ep", "ep": args.ep, "threads": threads, "torch": torch.__version__, "reps": reps,
           "load_avg": os.getloadavg()[0], "models": []}
    for size in args.sizes.split(","):
        model_dir = generated(size)
        mc = ModelConfig.from_dir(model_dir)
        runners = {ep: EpRunner(model_dir, ep, cases, threads) for ep in (1, args.ep)}
        print(f"\nEP benchmark: {model_dir.name} (Qwen3-MoE, {mc.moe.num_experts} experts, top-{mc.moe.top_k}, "
              f"fp32) on CPU, {threads} threads over each layout's ranks; EP {args.ep}: "
              f"{runners[args.ep].engine.layout.describe()}, all-to-all over gloo")
        print(f"{'case':<8} {'batch':>5} {'prompt':>6} | {'EP 1 tok/s':>10} {f'EP {args.ep} tok/s':>10} "
              f"{'ratio':>6} | {'a2a share':>9} | identical")
        rows = []
        try:
            for i, case in enumerate(cases):
                prompts = compare.make_prompts(case, mc.vocab_size, args.seed + i)
                best = measure(case, runners, prompts, reps)
                one, many = best[1], best[args.ep]
                row = {"case": case.kind, "batch": case.batch, "prompt": case.prompt_desc,
                       "ep1_tok_s": one["tok_s"], "ep_tok_s": many["tok_s"], "ratio": many["tok_s"] / one["tok_s"],
                       "ep1_ms": one["ms"], "ep_ms": many["ms"], "a2a_share": many["a2a_share"],
                       "identical": many["tokens"] == one["tokens"]}
                rows.append(row)
                print(f"{case.kind:<8} {case.batch:>5} {case.prompt_desc:>6} | {row['ep1_tok_s']:>10.1f} "
                      f"{row['ep_tok_s']:>10.1f} {row['ratio']:>6.2f} | {row['a2a_share']:>9.0%} | "
                      f"{row['identical']}", flush=True)
        finally:
            for r in runners.values():
                r.engine.close()
        out["models"].append({"model": str(model_dir), "rows": rows})
    if not all(r["identical"] for m in out["models"] for r in m["rows"]):
        print("warning: EP changed some greedy tokens", file=sys.stderr)
    return out
