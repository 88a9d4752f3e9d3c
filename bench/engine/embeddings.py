"""Embeddings benchmark: the embed worker's forward (``engine.pooling.Embedder``) against
transformers on the same model, the same inputs and the same cores, in the same run.

    python -m bench embeddings                # the ``small`` model (~52M params, fp32), ~2 min on 2 idle cores
    python -m bench embeddings --quick        # a short run
    python -m bench embeddings --json out.json

Definitions (identical for both sides):

* inputs: random token ids (seed 0, ids 3..vocab-1), ``--tokens`` each (default 64), so
  transformers needs no padding; batch 1 and batch 64 (``--batches``);
* ours: ``Embedder.embed(batch)`` as an embed worker runs it (its default token budget per
  forward, ``--max-num-batched-tokens`` 2048: a batch of 64 x 64 tokens is two forwards);
* transformers: ``AutoModel(batch).last_hidden_state[:, -1]``, normalised (the same last-token
  pooling), under ``torch.inference_mode``;
* embeddings/s = batch size / wall time of one call; the best and the median of ``--reps``
  calls of each side, alternating ours and transformers, after ``--warmup-s`` of warm-up calls
  (the first seconds after transformers loads a model, every call of either side runs several
  times slower: measured, 1.5 s instead of 0.1 s at batch 1) (best: the
  machine may be shared, and a slow spell of another process hits some calls, not the
  undisturbed ones; alternating: it hits both sides alike);
* "max |diff|": the largest difference between the two sides' vectors (a check that both did
  the same work).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.common import Benchmark, emit, parse, parser
from bench.common.models import model_dir as resolve_model
from engine.config import EngineConfig
from engine.pooling import Embedder, PoolingConfig

BENCHMARK = Benchmark(
    name="embeddings",
    measures="embeddings/s of the embed worker's forward against transformers on the same model, inputs and "
             "cores (CPU, `small`), batch 1 and 64",
    minutes=2,
    smoke=("--model", "tiny", "--batches", "1", "--reps", "1", "--warmup-s", "0", "--threads", "1"),
)


def timed_pair(ours, theirs, reps: int, warmup_s: float) -> tuple[list[float], list[float], object, object]:
    """Wall times of ``reps`` calls of each, alternating (ours, theirs, ours, ...) after warm-up
    calls of both for ``warmup_s`` seconds (at least one each), so that a slow spell of another
    process on a shared machine hits both sides alike."""
    out = [ours(), theirs()]
    until = time.monotonic() + warmup_s
    while time.monotonic() < until:
        out = [ours(), theirs()]
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for side, fn in enumerate((ours, theirs)):
            t = time.perf_counter()
            out[side] = fn()
            times[side].append(time.perf_counter() - t)
    return times[0], times[1], out[0], out[1]


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModel

    model_dir = resolve_model(args.model, "small")
    torch.set_num_threads(args.threads)
    ours = Embedder(EngineConfig(model=model_dir, device="cpu", max_num_batched_tokens=args.max_num_batched_tokens),
                    PoolingConfig("last"))
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = ours.model_config.vocab_size
    rng = random.Random(0)
    rows = []
    for batch in args.batches:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.tokens)] for _ in range(batch)]
        reps = args.reps if batch > 1 else args.reps * 4
        def transformers(p=prompts):
            with torch.inference_mode():
                return F.normalize(hf(torch.tensor(p)).last_hidden_state[:, -1].float(), dim=-1)

        ours_t, hf_t, ours_v, hf_v = timed_pair(lambda p=prompts: ours.embed(p), transformers, reps, args.warmup_s)
        row = {"batch": batch, "tokens_each": args.tokens, "reps": reps,
               "ours_best": batch / min(ours_t), "ours_median": batch / statistics.median(ours_t),
               "hf_best": batch / min(hf_t), "hf_median": batch / statistics.median(hf_t),
               "max_abs_diff": float((ours_v - hf_v).abs().max())}
        row["ratio_best"] = row["ours_best"] / row["hf_best"]
        rows.append(row)
        print(f"batch {batch}: done", file=sys.stderr)
    return {"model": str(model_dir), "threads": args.threads, "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "max_num_batched_tokens": args.max_num_batched_tokens, "rows": rows}


def table(result: dict) -> str:
    lines = [f"model {result['model']}, {result['threads']} threads, torch {result['torch']}, "
             f"inputs: random token ids, {result['rows'][0]['tokens_each']} each; ours: "
             f"max_num_batched_tokens {result['max_num_batched_tokens']}",
             "| batch | ours emb/s (best / median) | transformers emb/s (best / median) | ours/HF (best) | max abs diff |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['ours_best']:.1f} / {r['ours_median']:.1f} | {r['hf_best']:.1f} / "
                     f"{r['hf_median']:.1f} | {r['ratio_best']:.2f}x | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--model", help="model directory, or a generated size: tiny, small (default)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--tokens", type=int, default=64, help="tokens per input")
    p.add_argument("--reps", type=int, default=5, help="timed calls per case (batch 1: four times as many)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--warmup-s", type=float, default=10.0,
                   help="warm-up calls of both sides for this long per case: the first seconds after "
                        "transformers loads a model run several times slower, on both sides")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="ours: padded tokens per forward")
    p.add_argument("--quick", action="store_true", help="batch 1 and 8, 2 reps")
    args = parse(BENCHMARK, p, argv)
    if args.quick:
        args.batches, args.reps, args.warmup_s = [1, 8], 2, 2.0
    result = run(args)
    print(table(result))
    return emit(BENCHMARK, result, args)
