"""The KV tiers seen from an engine: blocks computed, pushed out to the host tier, onboarded back
(tests/unit/test_offload_engine.py; test_kv_dtype.py over an FP8 cache)."""

from __future__ import annotations

import random

import torch

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import Sequence


def offload_and_onboard(engine: Engine, evict: SamplingParams) -> tuple[torch.Tensor, Sequence]:
    """What a prefill worker sends from its own tiers: a 200-token prompt's 12 full blocks computed
    and held, pushed out of the device (a 370-token prompt generated with ``evict`` takes every
    block), then a prompt extending it run, its 12 blocks onboarded from the host tier. The
    computed blocks (a copy) and that second sequence, finished and still holding its blocks (the
    caller releases it). An engine of 24 device blocks of 16 tokens and a host tier."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, 4096) for _ in range(200)]  # 12 full blocks + 8 tokens
    first = _held(engine, prompt)
    computed = engine.kv_cache.read_blocks(first.block_table[:12]).clone()
    engine.release(first.request_id)
    engine.generate([[rng.randrange(3, 4096) for _ in range(370)]], evict)  # takes every device block
    assert all(engine.pool.lookup(h) is None for h in first.block_hashes(12))
    return computed, _held(engine, [*prompt, 7, 8, 9])


def _held(engine: Engine, prompt: list[int]) -> Sequence:
    """``prompt`` run to its first token, its blocks held."""
    seq = engine.new_sequence(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    seq.hold_blocks = True
    engine.add(seq)
    while not seq.is_finished:
        engine.step()
    return seq
