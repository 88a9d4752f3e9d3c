"""Latent KV blocks (MLA: one plane, one vector per token and layer) through the parts of the KV
fabric that copy blocks: the spec, the cache's whole-block operations, the host tier's copier,
and an engine on the tiny DeepSeek-V3 whose blocks go out to the host and disk tiers and back."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from kvstore.cache import KVCache, KVCacheSpec, copy_blocks
from kvstore.tiers import BlockCopier, DeviceBlock

CPU = torch.device("cpu")
LATENT = KVCacheSpec(num_layers=3, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=48, dtype=torch.float32,
                     num_planes=1)
KV = KVCacheSpec(num_layers=3, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=48, dtype=torch.float32)


def filled(spec: KVCacheSpec) -> KVCache:
    kv = KVCache(spec, CPU)
    kv.tensor.copy_(torch.randn(spec.shape, generator=torch.Generator().manual_seed(1)))
    return kv


def test_the_spec_counts_planes_in_its_shape_and_bytes():
    assert LATENT.shape == (3, 1, 8, 4, 1, 48) and LATENT.block_shape == (3, 1, 4, 1, 48)
    assert KV.block_shape == (3, 2, 4, 1, 48)
    assert LATENT.block_bytes == 3 * 4 * 48 * 4 and KV.block_bytes == 2 * LATENT.block_bytes
    assert KVCacheSpec.from_dict(LATENT.to_dict()) == LATENT
    old = {k: v for k, v in KV.to_dict().items() if k != "num_planes"}  # written before planes were in it
    assert KVCacheSpec.from_dict(old) == KV
    assert not LATENT.same_layout(KV)
    with pytest.raises(ValueError, match="1 \\(latent\\) or 2 \\(K, V\\) planes"):
        KVCacheSpec(1, 1, 1, 1, 8, torch.float32, num_planes=3)


def test_a_latent_cache_hands_out_its_plane_and_copies_whole_blocks():
    src, dst = filled(LATENT), KVCache(LATENT, CPU)
    assert src.latent(2).shape == (8, 4, 1, 48)
    with pytest.raises(ValueError, match="latent vectors"):
        src.layer(0)
    with pytest.raises(ValueError, match="K and V per head"):
        filled(KV).latent(0)
    data = src.read_block_major([5, 1, 2])
    assert data.shape == (3, *LATENT.block_shape) and data.is_contiguous()
    dst.write_block_major([0, 6, 7], data)
    assert torch.equal(dst.tensor[:, :, [0, 6, 7]], src.tensor[:, :, [5, 1, 2]])
    again = KVCache(LATENT, CPU)
    copy_blocks(src, again, [3, 4], [4, 5])
    assert torch.equal(again.tensor[:, :, 4:6], src.tensor[:, :, 3:5])
    with pytest.raises(ValueError, match="different planes"):
        copy_blocks(src, KVCache(KV, CPU), [0], [0])


def test_the_host_tiers_copier_moves_latent_blocks():
    src, dst = filled(LATENT), KVCache(LATENT, CPU)
    copier = BlockCopier(src, num_slots=4)
    assert copier.block_bytes == LATENT.block_bytes
    copier.offload([2, 3], [0, 1])
    staged = copier.stage([1, 0, DeviceBlock(7)])
    assert staged.shape == (3, *LATENT.block_shape)
    copier2 = BlockCopier(dst, num_slots=1)
    copier2.onboard([0, 1, 2], staged)
    assert torch.equal(dst.tensor[:, :, [0, 1, 2]], src.tensor[:, :, [3, 2, 7]])


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def conversation_turns(engine: Engine, turns: int = 3) -> tuple[list[list[int]], list[int]]:
    """Three conversations, each turn re-sending its history: (outputs, cached tokens) per request."""
    rng = random.Random(4)
    histories = [[rng.randrange(3, 4096) for _ in range(90)] for _ in range(3)]
    outs, cached = [], []
    for _ in range(turns):
        for i, h in enumerate(histories):
            (s,) = engine.generate([h], GREEDY)
            outs.append(s.output_token_ids)
            cached.append(s.num_cached_tokens)
            histories[i] = [*h, *s.output_token_ids, *[rng.randrange(3, 4096) for _ in range(20)]]
    return outs, cached


def test_latent_blocks_go_to_the_host_and_disk_tiers_and_come_back(deepseek_models, tmp_path):
    path = deepseek_models["deepseek"]
    expected, expected_cached = conversation_turns(Engine(EngineConfig(path, num_kv_blocks=512)))
    engine = Engine(EngineConfig(path, num_kv_blocks=12, host_kv_blocks=8, disk_kv_dir=str(tmp_path), disk_min_hits=0))
    outs, cached = conversation_turns(engine)
    assert outs == expected and cached == expected_cached  # every history found again, in some tier
    c = engine.kv_counters()
    assert c["hit_blocks_host"] > 0 and c["disk_written_blocks"] > 0 and c["hit_blocks_disk"] > 0
    assert engine.tiers.copier.block_bytes == engine.kv_spec.block_bytes == 3 * 16 * 48 * 4
