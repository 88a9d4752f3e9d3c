"""Mixture-of-experts engine benchmark: the same comparison as ``python -m bench engine`` on Qwen3-MoE.

    python -m bench moe            # CPU: the tiny and the small-sized Qwen3-MoE vs transformers, ~4 min
    python -m bench moe --quick    # a short run

The same measurements as the dense comparison of ``python -m bench engine`` (decode tok/s at
batch 1, 8 and 32, prefill tok/s; same definitions, both engines in the same run), on
``mesh model tiny --size moe`` (8 experts, top-2, ~0.7M params) and ``--size small-moe``
(8 experts of width 896, top-2: as many MLP columns per token as the dense ``small``,
~160M params). Ours runs the grouped experts (only the chosen experts, one matmul pair per
expert with tokens); transformers runs its default experts implementation (named in the header).
An 8B-active MoE on a GPU against its HBM roofline: ``python -m bench moe-gpu``.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict

import torch

from bench.common import Benchmark, emit, parse, parser
from bench.common.models import generated
from bench.engine import engine as compare  # its runners, cases, measuring and table
from engine.config import ModelConfig

BENCHMARK = Benchmark(
    name="moe",
    measures="decode and prefill tok/s of our engine against transformers on the tiny and the small-sized "
             "Qwen3-MoE (CPU), batch 1, 8 and 32",
    minutes=4,
    smoke=("--sizes", "moe", "--quick", "--reps", "1", "--threads", "1"),
)

def run_moe(args) -> dict:
    import transformers

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    reps = args.reps or (1 if args.quick else 3)
    cases = [c for c in compare.build_cases(args.quick, args.seed) if "mixed" not in c.label]
    out = {"mode": "cpu-moe", "threads": threads, "torch": torch.__version__,
           "transformers": transformers.__version__, "reps": reps, "models": []}
    for size in args.sizes.split(","):
        model_dir = generated(size)
        mc = ModelConfig.from_dir(model_dir)
        ours, hf = compare.OursRunner.on_cpu(model_dir, cases), compare.HFRunner(model_dir)
        params = sum(p.numel() for p in hf.model.parameters())
        active = params - mc.num_layers * (mc.moe.num_experts - mc.moe.top_k) * 3 * mc.hidden_size * mc.moe.intermediate_size
        experts_impl = getattr(hf.model.config, "_experts_implementation", None) or "eager"
        header = (
            f"MoE engine benchmark: {model_dir.name} (Qwen3-MoE, {mc.moe.num_experts} experts, top-{mc.moe.top_k}, "
            f"{params / 1e6:.1f}M params, {active / 1e6:.1f}M active per token, fp32) on CPU "
            f"({platform.processor() or platform.machine()}, {threads} threads), torch {torch.__version__}, "
            f"transformers {transformers.__version__} (experts: {experts_impl}); ours: grouped experts\n"
            f"decode tok/s = B / decode step (median step of a run, best of {reps} runs); prefill tok/s = "
            f"prompt tokens / best t(1); t(N)-t(1) = the whole-call cross-check of python -m bench engine\n"
        )
        rows = []
        for i, case in enumerate(cases):
            prompts = compare.make_prompts(case, mc.vocab_size, args.seed + i)
            wall, cpu = time.perf_counter(), time.process_time()
            row = compare.measure(case, [ours, hf], prompts, reps)
            row.cpu_share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * threads)
            rows.append(row)
            print(f"  measured {size} {case.label} batch {case.batch} ({row.cpu_share:.0%} of {threads} CPUs)",
                  file=sys.stderr)
        compare.print_table(rows, header, target=None)  # issue 19 sets no CPU ratio
        busy = [r for r in rows if r.cpu_share < compare.BUSY_SHARE]
        if busy:
            print(f"warning: other processes took CPU time during {len(busy)} case(s) (as little as "
                  f"{min(r.cpu_share for r in busy):.0%} of the CPUs here); those figures are noisy.")
        print()
        out["models"].append({"model": str(model_dir), "params": params, "active_params": active,
                              "hf_experts": experts_impl,
                              "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]})
        del ours, hf
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--sizes", default="moe,small-moe", help="generated MoE models, comma-separated")
    p.add_argument("--quick", action="store_true", help="short prompts, 16 new tokens, 1 rep")
    p.add_argument("--reps", type=int, default=None, help="timed runs per measurement (best kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")
    p.add_argument("--seed", type=int, default=0)
    args = parse(BENCHMARK, p, argv)
    return emit(BENCHMARK, run_moe(args), args)
