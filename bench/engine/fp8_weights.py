"""FP8 weights on CPU (issue 49): load time, resident memory and decode tok/s of one model's FP8
checkpoint against its float32 one, each way the engine can run them.

    python -m bench fp8-weights            # `small` and `deepseek`, each mode in a process of its own, ~5 min on a quiet machine
    python -m bench fp8-weights --quick    # `tiny`, one rep, 8 tokens

Models: ``small`` (Llama-family, 52M params, 128x128 scale blocks) and ``deepseek`` (the tiny
DeepSeek-V3: MLA, DeepSeekMoE), each checkpoint ``mesh model tiny DIR --size SIZE`` and the same
with ``--fp8``: DeepSeek's block-scaled e4m3 format. Modes:

    float32      the float32 checkpoint, computed in float32 (the CPU default)
    bfloat16     the float32 checkpoint, computed in bfloat16 (``--dtype bfloat16``)
    fp8-load     the FP8 checkpoint, dequantized once at load into float32: what the engine does on CPU
    fp8-matmul   the FP8 checkpoint kept resident, dequantized on every matmul (``engine.fp8_linear``'s
                 ``dequant`` GEMM; the engine never picks it on CPU, this benchmark forces it)

Each mode runs in a fresh process: ``load_s`` is the ``Engine`` construction (weights read,
dequantized where they are, the KV pool made), ``rss_mib`` the process's resident memory it
added (VmRSS after minus before; the KV pool is a few blocks), ``decode_tok_s`` batch x steps /
the decode steps' time at batch ``--batch`` (prompts of 32 tokens, ``--tokens`` greedy tokens),
the best of ``--reps`` runs. The first figures, measured by hand when the format landed, are in
``engine/fp8.py``'s docstring: dequantization at load is the CPU choice.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import Benchmark, emit, parse, parser
from bench.common.registry import ROOT

BENCHMARK = Benchmark(
    name="fp8-weights",
    measures="FP8 weights on CPU: load time, resident memory and decode tok/s at batch 4 of the FP8 checkpoints "
             "of `small` and the tiny DeepSeek-V3 (dequantized at load, or per matmul) against float32 and bfloat16",
    minutes=4,
    smoke=("--quick", "--modes", "fp8-load", "--threads", "1"),
)

MODES = ("float32", "bfloat16", "fp8-load", "fp8-matmul")


@dataclass
class ModeRun:
    size: str
    mode: str
    checkpoint_mib: float
    load_s: float
    rss_mib: float
    decode_tok_s: float


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_mode(mode: str, size: str, batch: int, tokens: int, reps: int, threads: int) -> ModeRun:
    """One mode in this process (a fresh one: the RSS before the engine is the imports' only)."""
    import torch

    from bench.common.models import generated
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    model = generated(size, fp8=mode.startswith("fp8"))
    if mode == "fp8-matmul":  # keep the FP8 weights resident: the loader asks for a GEMM, we name one
        import engine.loader
        from engine.fp8_linear import DequantGemm

        engine.loader.resident_gemm = lambda device, block, dtype: DequantGemm()
    dtype = "bfloat16" if mode == "bfloat16" else "float32"
    blocks = batch * -(-(32 + tokens) // 16) + 4
    before = rss_bytes()
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model=model, dtype=dtype, device="cpu", num_kv_blocks=blocks))
    load_s = time.perf_counter() - t0
    rss = rss_bytes() - before
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (32,), generator=g).tolist() for _ in range(batch)]
    best = 0.0
    for _ in range(reps):
        seqs = [eng.new_sequence(p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
                for p in prompts]
        for s in seqs:
            eng.add(s)
        eng.step()  # the prefill
        t0, steps = time.perf_counter(), 0
        while eng.has_work:
            eng.step()
            steps += 1
        best = max(best, batch * steps / (time.perf_counter() - t0))
        eng.pool.evict_all_cached()  # the next rep prefills again
    mib = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 2**20
    eng.close()
    return ModeRun(size, mode, mib, load_s, rss / 2**20, best)


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--sizes", default="small,deepseek", help="comma-separated generated model sizes (engine.tiny)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--quick", action="store_true", help="`tiny`, one rep, 8 tokens")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parse(BENCHMARK, p, argv)
    if args.quick:
        args.sizes, args.reps, args.tokens = "tiny", 1, 8
    if args.child:  # one mode, in the process its parent started: one JSON line
        print(json.dumps(asdict(run_mode(args.child, args.sizes, args.batch, args.tokens, args.reps, args.threads))))
        return 0
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode {unknown[0]!r} (choose from {', '.join(MODES)})")
    from engine.tiny import ALL_SIZES

    bad = [z for z in args.sizes.split(",") if z not in ALL_SIZES]
    if bad:
        p.error(f"unknown size {bad[0]!r} (choose from {', '.join(ALL_SIZES)})")
    runs = [run_child(mode, size, args) for size in args.sizes.split(",") for mode in modes]
    print(f"FP8 weights on CPU: batch {args.batch}, {args.tokens} tokens, best of {args.reps}, "
          f"{args.threads} threads, load {os.getloadavg()[0]:.1f}")
    print(f"{'model':<9} {'mode':<11} {'file MiB':>8} {'load s':>7} {'+RSS MiB':>9} {'decode tok/s':>13}")
    for r in runs:
        print(f"{r.size:<9} {r.mode:<11} {r.checkpoint_mib:>8.1f} {r.load_s:>7.2f} {r.rss_mib:>9.0f} "
              f"{r.decode_tok_s:>13.1f}")
    return emit(BENCHMARK, {"sizes": args.sizes, "batch": args.batch, "tokens": args.tokens, "reps": args.reps,
                            "threads": args.threads, "runs": [asdict(r) for r in runs]}, args)


def run_child(mode: str, size: str, args: argparse.Namespace) -> ModeRun:
    """One mode of one model in a fresh process (its RSS before the engine is the imports' only)."""
    out = subprocess.run([sys.executable, "-m", "bench", "fp8-weights", "--child", mode, "--sizes", size,
                          "--batch", str(args.batch), "--tokens", str(args.tokens), "--reps", str(args.reps),
                          "--threads", str(args.threads)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"{size} {mode} failed: {out.stderr.strip().splitlines()[-1:]}")
    return ModeRun(**json.loads(out.stdout.strip().splitlines()[-1]))
