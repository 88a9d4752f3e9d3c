"""The padding of graphed decode batches, run on CPU through the torch attention backend.

A decode step padded to a graph's batch size (``StaticDecodeBatch.fill``, the code the CUDA
graphs run) must leave every real row's logits and the whole KV cache, outside the scratch
block, as the unpadded step does: exactly, up to the rounding of matmuls over more rows
(oneDNN blocks a batch of 8 differently from one of 3: ~1e-5 on logits of ~20). The earlier padding repeated row 0's token, position
and KV slot: from layer 1 on a pad row's K/V differ from row 0's and both wrote row 0's slot.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine.attention import AttentionBatch
from engine.config import EngineConfig
from engine.cuda_graphs import StaticDecodeBatch, batch_sizes
from engine.engine import Engine
from engine.sampling import SamplingParams

PROMPTS = ([5, 6, 7, 8, 9], [10, 11, 12], [3] * 20)  # the third spans two blocks


@pytest.fixture(scope="module")
def decode_step(tiny_model):
    """An engine after one prefill step, the next (pure decode) step's inputs, and the KV before it."""
    engine = Engine(EngineConfig(tiny_model, device="cpu", num_kv_blocks=64))
    scratch = engine.pool.allocate(1)[0]  # as the engine reserves it when it builds graphs
    for p in PROMPTS:
        engine.add(engine.new_sequence(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    engine.step()
    out = engine.scheduler.schedule()
    step, _ = engine.runner.inputs(out)
    assert step.query_lens == [1, 1, 1]
    return engine, scratch, step, engine.kv_cache.tensor.clone()


def run(engine, kv_before, ids, positions, batch: AttentionBatch):
    engine.kv_cache.tensor.copy_(kv_before)
    engine.attention.plan(batch)
    with torch.inference_mode():
        hidden = engine.model(ids, positions, engine.attention)
        return engine.model.logits(hidden), engine.kv_cache.tensor.clone()


@pytest.mark.parametrize("size", [4, 8])
def test_padded_decode_step_leaves_real_rows_and_their_kv_exactly_as_unpadded(decode_step, size):
    engine, scratch, step, kv_before = decode_step
    n = len(step.query_lens)
    plain_batch = AttentionBatch(step.query_lens, step.context_lens, step.block_tables,
                                 torch.from_numpy(step.slot_mapping))
    logits, kv = run(engine, kv_before, torch.from_numpy(step.input_ids), torch.from_numpy(step.positions),
                     plain_batch)

    static = StaticDecodeBatch(8, torch.device("cpu"), scratch, engine.block_size)
    padded = static.fill(torch.from_numpy(step.input_ids), step.positions, step.slot_mapping,
                         step.context_lens, step.block_tables, size)
    assert padded.block_tables[n:] == [[scratch]] * (size - n)
    assert set(static.slots[n:size].tolist()) == {scratch * engine.block_size}
    logits_p, kv_p = run(engine, kv_before, static.input_ids[:size], static.positions[:size], padded)

    # the bug this guards against moved row 0's logits by ~4 and its KV by ~4
    torch.testing.assert_close(logits_p[:n], logits, rtol=0, atol=1e-4)
    # every block but the scratch one holds what the unpadded step wrote
    others = [b for b in range(engine.pool.num_blocks) if b != scratch]
    torch.testing.assert_close(kv_p[:, :, others], kv[:, :, others], rtol=0, atol=1e-5)
    assert not torch.equal(kv_p[:, :, scratch], kv_before[:, :, scratch])  # the pad rows wrote there


def test_the_scratch_block_is_never_handed_out(tiny_model):
    engine = Engine(EngineConfig(tiny_model, device="cpu", num_kv_blocks=16))
    scratch = engine.pool.allocate(1)[0]
    taken = engine.pool.allocate(engine.pool.num_free)
    assert scratch not in taken and engine.pool.num_free == 0


def test_batch_sizes_cover_every_batch_up_to_max_num_seqs():
    assert batch_sizes(1) == [1]
    assert batch_sizes(64)[-1] == 64 and 48 in batch_sizes(64)
    assert batch_sizes(256)[-1] == 256
    big = batch_sizes(512)
    assert big[-1] == 512 and 256 in big and 288 in big
    assert all(b - a <= 32 for a, b in itertools.pairwise(big) if a >= 128)
    sizes = batch_sizes(300)
    for n in range(1, 301):  # every batch the scheduler can make has a graph no more than 32 rows larger
        bucket = next(s for s in sizes if s >= n)
        assert bucket - n < 32 or n <= 32
    assert np.all(np.diff(sizes) > 0)
