"""nixl between pools cut over ranks (``kvstore.transfer.nixl_parts``), without NIXL: the pairs'
descriptors, applied as plain memory copies between real KV parts, move exactly what
``copy_blocks`` moves, from every layout into every other (TP and PP, and both); a job's pairs
end with one notification each, under distinct tags, and its receiver takes it as landed only
once all of them came; params whose parts do not tile the pool are refused."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvstore.cache import KVCache, KVCacheSpec, ShardedKVCache, block_runs, copy_blocks
from kvstore.transfer.nixl_parts import (
    Geometry,
    PairNotifs,
    PartPlace,
    check_tiling,
    part_key,
    parts_of_params,
    plan_pairs,
    split_part_key,
)

SPEC = KVCacheSpec(num_layers=4, num_blocks=10, block_size=4, num_kv_heads=4, head_dim=8, dtype=torch.float32)
GEO = Geometry(SPEC.num_layers, SPEC.num_kv_heads, SPEC.num_planes, SPEC.block_size, SPEC.head_dim * 4)


def pool(tp: int, pp: int) -> KVCache | ShardedKVCache:
    """A pool of ``tp`` x ``pp`` parts in this process (stage-major, as a worker's ranks)."""
    layers = SPEC.num_layers // pp
    part = KVCacheSpec(layers, SPEC.num_blocks, SPEC.block_size, SPEC.num_kv_heads // tp, SPEC.head_dim, SPEC.dtype)
    shards = [KVCache(part, torch.device("cpu")) for _ in range(tp * pp)]
    return shards[0] if len(shards) == 1 else ShardedKVCache(shards, tp)


def places(kv) -> list[PartPlace]:
    return [PartPlace(f"w-{i}", 1, p.cache.tensor.data_ptr(), p.cache.spec.total_bytes, p.layers, p.heads)
            for i, p in enumerate(kv.parts())]


LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)]


@pytest.mark.parametrize("src_layout", LAYOUTS, ids=lambda t: f"tp{t[0]}pp{t[1]}")
@pytest.mark.parametrize("dst_layout", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=lambda t: f"tp{t[0]}pp{t[1]}")
def test_the_pairs_move_what_copy_blocks_moves(src_layout, dst_layout):
    src, dst, want = pool(*src_layout), pool(*dst_layout), pool(*dst_layout)
    src.write_blocks(list(range(SPEC.num_blocks)), torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(1)))
    src_ids, dst_ids = [1, 2, 3, 7, 0], [5, 6, 7, 1, 9]
    copy_blocks(src, want, src_ids, dst_ids)
    pairs = plan_pairs(places(src), SPEC.num_blocks, places(dst), SPEC.num_blocks, GEO, block_runs(src_ids, dst_ids))
    # every pair of parts that share layers and heads, once; equal heads on both sides are whole runs
    expect = sum(1 for s in src.parts() for d in dst.parts()
                 if max(s.layers[0], d.layers[0]) < min(s.layers[1], d.layers[1])
                 and max(s.heads[0], d.heads[0]) < min(s.heads[1], d.heads[1]))
    assert len(pairs) == expect
    for pw in pairs:
        assert pw.local[:, 1].tolist() == pw.remote[:, 1].tolist()
        for (a, n), (b, _) in zip(pw.local.tolist(), pw.remote.tolist(), strict=True):
            ctypes.memmove(b, a, n)  # what the one-sided WRITE does with each descriptor
    assert torch.equal(dst.read_blocks(list(range(SPEC.num_blocks))), want.read_blocks(list(range(SPEC.num_blocks))))
    if src_layout[0] == dst_layout[0]:  # the same heads on both sides: one piece per (layer, plane, run)
        runs = len(block_runs(src_ids, dst_ids))
        assert sum(len(pw.local) for pw in pairs) == runs * SPEC.num_planes * sum(
            min(s.layers[1], d.layers[1]) - max(s.layers[0], d.layers[0])
            for pw in pairs for s, d in [(src.parts()[pw.src], dst.parts()[pw.dst])])


def test_each_pair_notifies_under_its_own_tag_and_the_write_lands_with_the_last():
    key = b"kv:req:1:7"
    assert part_key(key, 0, 1) == key  # one pair (TP 1 to TP 1): the plain key, as always
    tags = [part_key(key, i, 3) for i in range(3)]
    assert len(set(tags)) == 3 and all(split_part_key(t) == (key, i, 3) for i, t in enumerate(tags))
    assert split_part_key(key) is None and split_part_key(b"kv:a#1/2:7") is None  # a job id may hold '#'
    pairs = PairNotifs()
    assert pairs.add(tags[2], "pre-abc", b"") is None
    assert pairs.add(tags[0], "pre-def", b"done") is None  # another rank's agent of the same worker
    assert pairs.add(tags[0], "pre-def", b"") is None  # a repeat counts once
    assert pairs.add(tags[1], "pre-abc", b"") == (key, "pre-abc", b"done")
    assert len(pairs) == 0
    assert pairs.add(part_key(b"kv:r:1:2", 0, 2), "pre-abc", b"") is None
    with pytest.raises(ValueError, match="another worker"):  # a forged pair from elsewhere ends nothing
        pairs.add(part_key(b"kv:r:1:2", 1, 2), "x-abc", b"")
    with pytest.raises(ValueError, match="say 2 and 3"):
        pairs.add(part_key(b"kv:r:1:2", 1, 3), "pre-abc", b"")
    with pytest.raises(ValueError, match="out of range"):
        pairs.add(b"kv:r:2:2#5/5", "pre-abc", b"")
    pairs.forget(b"kv:r:1:2")
    assert len(pairs) == 0


def test_parts_that_do_not_tile_the_pool_are_refused():
    whole = PartPlace("a", 1, 4096, 100, (0, 4), (0, 4))
    assert parts_of_params({}, whole) == [whole]
    part = {"agent": "a", "rev": 1, "addr": 4096, "size": 100, "layers": [0, 4], "heads": [0, 2]}
    two = parts_of_params({"parts": [part, {**part, "agent": "b", "heads": [2, 4]}]}, whole)
    check_tiling(two, GEO)
    for bad in ([part], [part, part], [part, {**part, "heads": [2, 5]}]):
        with pytest.raises(ValueError):
            check_tiling(parts_of_params({"parts": bad}, whole), GEO)
    for malformed in ([{**part, "heads": [2, 2]}], [{**part, "addr": "0x1000"}], [{**part, "layers": [0]}], [], "x"):
        with pytest.raises(ValueError, match="part"):
            parts_of_params({"parts": malformed}, whole)
