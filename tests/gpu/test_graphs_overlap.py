"""CUDA graphs, overlapped scheduling and fused kernels together, on CUDA.

* Greedy outputs of an engine with graphs + overlap + every fused kernel agree with the eager,
  plain engine for a mixed batch (chunked prefills beside decodes, prefix hits) under
  preemption (up to float32 near ties: ``greedy_checks``).
* Overlap alone gives the plain loop's tokens on the GPU too, aborts included.
* An overlapped decode step never waits for the device: ``step()`` runs with torch's sync
  debug mode set to error (tokens come back by an event and a pinned copy, which it allows).
* The graph pool fits the memory the KV budget set aside for it.

Skips cleanly (collected, reported as skipped) without CUDA or flashinfer.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from engine.config import EngineConfig
from engine.cuda_graphs import graph_memory_bytes
from engine.engine import Engine
from engine.kernels import FUSED_KERNELS
from engine.sampling import SamplingParams
from tests.helpers.greedy_checks import assert_greedy_agree, dtype_margin, greedy

pytestmark = pytest.mark.gpu


def make(model, dtype="bfloat16", **kw) -> Engine:
    base = dict(device="cuda", dtype=dtype, num_kv_blocks=512)
    return Engine(EngineConfig(model, **{**base, **kw}))


def mixed_prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(4096) for _ in range(100)]
    own = [3, 250, 17, 64, 130, 9, 40, 200, 5, 77]
    return [(shared if i % 3 == 0 else []) + [rng.randrange(4096) for _ in range(n)] for i, n in enumerate(own)]


def test_graphs_overlap_and_fused_kernels_agree_with_eager_under_preemption(small_model):
    prompts = mixed_prompts()
    lengths = [8 + 3 * (i % 5) for i in range(len(prompts))]
    ref = make(small_model, "float32", attention_backend="torch")
    margin = dtype_margin(ref, make(small_model, attention_backend="torch"), prompts[:4])
    # 60 blocks of 16 tokens for ten sequences of up to 350 tokens: preemption; 64 tokens per step:
    # the long prompts prefill in chunks beside the others' decodes
    tight = dict(num_kv_blocks=60, max_num_batched_tokens=64, max_num_seqs=8)
    eager = make(small_model, **tight, enforce_eager=True, async_scheduling=False)
    fast = make(small_model, **tight, cuda_graphs=True, async_scheduling=True, fused_kernels=FUSED_KERNELS)
    assert fast.runner.graphs is not None and fast.overlap is not None and eager.runner.graphs is None
    runs = {name: e.generate(prompts, [greedy(n) for n in lengths]) for name, e in (("eager", eager), ("fast", fast))}
    assert [len(s.output_token_ids) for s in runs["fast"]] == lengths
    assert fast.scheduler.num_preemptions > 0 and eager.scheduler.num_preemptions > 0
    assert fast.runner.graphs.replays > 0
    assert any(s.num_cached_tokens > 0 for s in runs["fast"])
    assert_greedy_agree(runs["fast"], runs["eager"], ref, margin)
    assert fast.pool.num_used == 1  # everything came back but the graphs' scratch block


def test_overlap_on_the_gpu_gives_the_plain_loops_tokens(small_model):
    prompts = mixed_prompts(9)
    ref = make(small_model, "float32", attention_backend="torch")
    margin = dtype_margin(ref, make(small_model, attention_backend="torch"), prompts[:4])
    params = [greedy(10), SamplingParams(max_tokens=10, temperature=0.7, seed=4, top_k=40, ignore_eos=True)] * 5
    runs = {}
    for name, overlap in (("plain", False), ("overlap", True)):
        e = make(small_model, cuda_graphs=True, async_scheduling=overlap, max_num_batched_tokens=128)
        runs[name] = e.generate(prompts, params)
    greedy_rows = slice(0, None, 2)
    assert_greedy_agree(runs["overlap"][greedy_rows], runs["plain"][greedy_rows], ref, margin)
    for a, b in zip(runs["overlap"][1::2], runs["plain"][1::2], strict=True):  # seeded: drawn per token index
        assert len(a.output_token_ids) == len(b.output_token_ids) == 10


def test_an_overlapped_decode_step_never_waits_for_the_device(small_model):
    engine = make(small_model, cuda_graphs=True, async_scheduling=True)
    rng = random.Random(2)
    for _ in range(6):
        engine.add(engine.new_sequence([rng.randrange(4096) for _ in range(20)],
                                       SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)))
    for _ in range(4):  # prefill, first decodes, graph capture: outside the check
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [engine.step() for _ in range(10)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(o) == 6 for o in outs) and engine.runner.graphs.replays >= 10


def test_the_graph_pool_fits_what_the_kv_budget_set_aside(small_model):
    gc.collect()
    torch.cuda.empty_cache()  # the engines of the tests before: not this test's memory
    # a fraction small enough that the KV pool is sized by memory, not by max_num_seqs x context
    engine = make(small_model, cuda_graphs=True, max_num_seqs=64, kv_memory_fraction=0.04)
    mc, elem = engine.model_config, 2
    qkv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
    set_aside = graph_memory_bytes(mc.hidden_size, mc.intermediate_size, qkv, 64, elem)
    with_graphs = engine._auto_num_blocks(engine.max_model_len, graphs=True)
    without = engine._auto_num_blocks(engine.max_model_len, graphs=False)
    assert abs((without - with_graphs) - set_aside // engine.kv_spec.block_bytes) <= 1
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    engine.runner.graphs.capture_all()
    torch.cuda.synchronize()
    assert set(engine.runner.graphs.graphs) == set(engine.runner.graphs.sizes)
    assert torch.cuda.memory_reserved() - before <= set_aside
