"""A worker of several ranks does what a worker of one does (issue 50): ``--tp 2`` and ``--pp 2``
engines with a host tier too small a device pool spills into (offloaded, then onboarded on the
next turn's prefix hit) and with overlapped scheduling (``--async-scheduling``: the helper ranks
take each step's in-flight tokens from rank 0) give the greedy tokens and prefix hits of one
rank with neither; the host tier's copier moves each rank's part into its layers and heads of a
slot, so a slot holds what a pool of one rank would."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from kvstore.cache import KVCache, KVCacheSpec, ShardedKVCache
from kvstore.tiers import BlockCopier, DeviceBlock

CONVS, FIRST, USER, TURNS = 3, 100, 30, 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def conversations(engine: Engine) -> tuple[list[list[int]], list[int]]:
    """Multi-turn chats (each turn re-sends the history): outputs and cached tokens, request by request."""
    rng = random.Random(7)
    histories = [[rng.randrange(3, 4096) for _ in range(FIRST)] for _ in range(CONVS)]
    outs, cached = [], []
    for _ in range(TURNS):
        for i, history in enumerate(histories):
            (seq,) = engine.generate([history], GREEDY)
            outs.append(seq.output_token_ids)
            cached.append(seq.num_cached_tokens)
            histories[i] = [*history, *seq.output_token_ids, *(rng.randrange(3, 4096) for _ in range(USER))]
    return outs, cached


@pytest.fixture(scope="module")
def reference(tiny_model):
    return conversations(Engine(EngineConfig(tiny_model, num_kv_blocks=1024)))


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_several_ranks_with_a_host_tier_and_overlapped_steps_match_one_rank(tiny_model, reference, layout):
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=24, host_kv_blocks=256, async_scheduling=True, **layout))
    try:
        assert engine.overlap is not None and engine.tiers is not None
        outs, cached = conversations(engine)
        assert outs == reference[0]
        assert cached == reference[1]  # every history found again, most of it in the host tier
        c = engine.kv_counters()
        assert c["hit_blocks_host"] > 0 and c["host_stored_blocks"] > 0, c
        assert engine.pool.num_used == 0
    finally:
        engine.close()


SPEC = KVCacheSpec(num_layers=4, num_blocks=12, block_size=4, num_kv_heads=4, head_dim=8, dtype=torch.float32)


def pool(tp: int, pp: int) -> KVCache | ShardedKVCache:
    part = KVCacheSpec(SPEC.num_layers // pp, SPEC.num_blocks, SPEC.block_size, SPEC.num_kv_heads // tp,
                       SPEC.head_dim, SPEC.dtype)
    shards = [KVCache(part, torch.device("cpu")) for _ in range(tp * pp)]
    return shards[0] if len(shards) == 1 else ShardedKVCache(shards, tp)


def test_the_host_tiers_copier_moves_each_part_into_its_layers_and_heads_of_a_slot():
    data = torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(5))
    one, four = pool(1, 1), pool(2, 2)
    for kv in (one, four):
        kv.write_blocks(list(range(SPEC.num_blocks)), data)
    a, b = BlockCopier(one, 8), BlockCopier(four, 8)
    for copier in (a, b):
        copier.offload([3, 4, 7], [0, 1, 5])
    assert torch.equal(b.slots[[0, 1, 5]], a.slots[[0, 1, 5]])  # a slot is the whole block, whatever the layout
    assert torch.equal(a.slots[[0, 1, 5]], one.read_block_major([3, 4, 7]))
    sources = [DeviceBlock(2), 1, DeviceBlock(9), a.slot_bytes(5)]
    staged = b.stage(sources)
    assert torch.equal(staged, a.stage(sources))
    fresh = pool(2, 2)
    BlockCopier(fresh, 1).onboard([0, 5, 6, 11], staged)
    assert torch.equal(fresh.read_blocks([0, 5, 6, 11]), one.read_blocks([2, 4, 9, 7]))
    assert not fresh.read_blocks([1, 2, 3, 4, 7, 8, 9, 10]).any()
