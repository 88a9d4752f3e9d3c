"""Helpers of the GPU engine tests: per-step logits, and greedy agreement up to near ties.

Two engines that compute in bfloat16 along different kernels (FlashInfer vs torch, graphs vs
eager, fused vs plain) may flip a greedy choice where two logits are within that dtype's noise.
``assert_greedy_agree`` accepts a first divergence only where a float32 engine calls the two
tokens a near tie (within ``margin``), and nothing else.
"""

from __future__ import annotations

import torch

from engine.engine import Engine
from engine.sampling import SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def step_logits(engine: Engine, prompts, steps: int) -> tuple[list[torch.Tensor], list]:
    """Logits of every row of the first ``steps`` steps (prefill, then decodes), and the sequences."""
    engine.runner.capture_logits = True
    seqs = [engine.new_sequence(p, greedy(steps)) for p in prompts]
    for s in seqs:
        engine.add(s)
    out = []
    for _ in range(steps):
        engine.step()
        out.append(engine.runner.last_logits.clone())
    return out, seqs


def last_logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    engine.runner.capture_logits = True
    engine.generate([tokens], greedy(1))
    return engine.runner.last_logits[-1]


def dtype_margin(ref: Engine, same_dtype: Engine, prompts) -> float:
    """Twice the largest logit error of a same-dtype torch engine against the float32 one."""
    return 2 * (step_logits(same_dtype, prompts, 1)[0][0] - step_logits(ref, prompts, 1)[0][0]).abs().max().item()


def assert_greedy_agree(flash_seqs, torch_seqs, ref: Engine, margin: float) -> None:
    """Identical greedy outputs, except a first divergence where the float32 logits call it a near tie."""
    for f, t in zip(flash_seqs, torch_seqs, strict=True):
        a, b = f.output_token_ids, t.output_token_ids
        j = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if j is None:
            continue
        logits = last_logits(ref, f.prompt_token_ids + a[:j])
        best = logits.max()
        assert best - logits[a[j]] <= margin and best - logits[b[j]] <= margin, (
            f"diverged at output {j}: {a[j]} ({logits[a[j]]:.3f}) vs {b[j]} "
            f"({logits[b[j]]:.3f}), float32 best {best:.3f}; margin {margin:.3f}"
        )
