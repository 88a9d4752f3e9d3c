"""KV tiers without a model: the host tier's LRU, the pool's eviction hook, tiered prefix
matching and onboarding (bookkeeping), the disk tier's files, and the mocker's virtual tier."""

from __future__ import annotations

import os
import stat

import pytest

from engine.sampling import SamplingParams
from engine.sequence import Sequence
from kvstore.disk import HEADER, DiskTier
from kvstore.events import BlockRemoved, BlockStored, KvEventLog
from kvstore.hashing import DEFAULT_HASH_KEY, hash_seed
from kvstore.manager import KVCacheManager
from kvstore.pool import BlockPool, EvictedBlock, NoFreeBlocks
from kvstore.tiers import HostTier, TieredCache

BS = 4


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(), block_size=BS, hash_seed=hash_seed(DEFAULT_HASH_KEY, "m"))


def ev(bid, h, parent=None, hits=0):
    return EvictedBlock(bid, h, parent, hits)


def compute(kv: KVCacheManager, s: Sequence) -> None:
    """What a prefill does to the block tables: blocks for every token, all computed and named."""
    hit = kv.match_prefix(s)
    assert kv.can_admit(s, hit, s.num_tokens - len(hit) * BS)
    kv.admit(s, hit)
    assert kv.grow(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens
    kv.cache_computed(s)


# -- the host tier ---------------------------------------------------------------------------


def test_host_tier_is_lru_and_reports_the_slots_it_reuses():
    events = KvEventLog()
    host = HostTier(3, events)
    stored, dropped = host.store([ev(0, 10), ev(1, 11, 10), ev(2, 12, 11)])
    assert [h for h, _ in [(b.block_hash, s) for b, s in stored]] == [10, 11, 12] and dropped == []
    slots = {b.block_hash: s for b, s in stored}
    assert len(set(slots.values())) == 3
    host.touch(10)  # 11 is now the coldest, then 12
    stored, dropped = host.store([ev(3, 20), ev(4, 21, 20)])
    assert [h for h, _ in dropped] == [11, 12]
    # the new blocks take exactly the slots of the evicted ones
    assert sorted(s for _, s in stored) == sorted([slots[11], slots[12]])
    assert host.hashes() == [10, 20, 21]
    assert events.drain()[3:] == [
        BlockRemoved(11, "host"), BlockStored(20, None, "host"),
        BlockRemoved(12, "host"), BlockStored(21, 20, "host"),
    ]
    assert (host.stored, host.evicted) == (5, 2)


def test_host_tier_only_touches_a_block_it_already_holds():
    host = HostTier(2)
    host.store([ev(0, 1, hits=1), ev(1, 2)])
    stored, dropped = host.store([ev(5, 1, hits=3)])  # block 1 evicted from the device again
    assert stored == [] and dropped == []
    assert host.get(1).hits == 3 and host.hashes() == [2, 1]


def test_host_tier_keeps_the_hottest_end_of_a_batch_larger_than_itself():
    host = HostTier(2)
    stored, _ = host.store([ev(i, 100 + i) for i in range(5)])  # coldest first
    assert [b.block_hash for b, _ in stored] == [103, 104]
    assert sorted(host.hashes()) == [103, 104]


# -- the pool's eviction hook -------------------------------------------------------------------


def test_evictions_reach_the_hook_once_per_allocate_before_the_slots_are_reused():
    contents = {}  # block id -> "bytes"
    offloaded = {}
    calls = []

    def on_evict(batch):
        calls.append([b.block_id for b in batch])
        for b in batch:  # the copy: it must see the old contents
            offloaded[b.block_hash] = contents[b.block_id]

    pool = BlockPool(4, on_evict=on_evict)
    ids = pool.allocate(4)
    for i, b in enumerate(ids):
        contents[b] = f"kv{i}"
        pool.cache(b, 100 + i, 100 + i - 1 if i else None)
    pool.free(ids[:3])  # three cached blocks in the free queue, the fourth in use
    got = pool.allocate(3)
    for b in got:
        contents[b] = "overwritten"
    assert calls == [ids[:3]]  # one batch, coldest first
    assert offloaded == {100: "kv0", 101: "kv1", 102: "kv2"}


def test_blocks_in_use_are_never_offloaded_or_reused():
    seen = []
    pool = BlockPool(4, on_evict=seen.extend)
    a, b, c, d = pool.allocate(4)
    for i, x in enumerate((a, b, c, d)):
        pool.cache(x, 10 + i, None)
    pool.touch([b])  # b: two references
    pool.free([a, b, c])  # a and c free; b still held once; d held
    assert pool.allocate(2) and {e.block_id for e in seen} == {a, c}
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    assert pool.lookup(11) == b and pool.lookup(13) == d  # in-use blocks kept their names
    assert all(e.block_id not in (b, d) for e in seen)


def test_evicted_blocks_carry_parent_and_hit_count():
    seen = []
    pool = BlockPool(2, on_evict=seen.extend)
    a, b = pool.allocate(2)
    pool.cache(a, 1, None)
    pool.cache(b, 2, 1)
    pool.free([b, a])
    pool.touch([a, b])  # a prefix hit
    pool.free([b, a])
    pool.allocate(2)
    assert sorted(seen) == sorted([ev(a, 1, None, 1), ev(b, 2, 1, 1)])


# -- tiered prefix matching and onboarding (bookkeeping only) -------------------------------------


def tiered(num_blocks=6, host_slots=16):
    pool = BlockPool(num_blocks)
    tiers = TieredCache(HostTier(host_slots, pool.events))
    pool.on_evict = tiers.offload
    return pool, KVCacheManager(pool, BS, tiers), tiers


def test_evicted_prefix_is_found_in_the_host_tier_and_onboarded():
    pool, kv, tiers = tiered()
    a = seq(range(17), "a")  # four full blocks + one token
    compute(kv, a)
    hashes = a.block_hashes()
    kv.free(a)
    pool.events.drain()
    filler = seq(range(1000, 1024), "f")  # six blocks: evicts all of a's
    compute(kv, filler)
    assert all(pool.lookup(h) is None for h in hashes) and all(h in tiers.host for h in hashes)
    events = pool.events.drain()
    assert BlockRemoved(hashes[0], "device") in events and BlockStored(hashes[0], None, "host") in events
    kv.free(filler)

    b = seq([*range(17), 99, 98, 97], "b")  # a's prompt plus a turn
    hit = kv.match_prefix(b)
    assert hit.hashes == hashes and hit.blocks == [None] * 4 and hit.num_below == 4
    # onboarding needs four fresh device blocks, plus what the new tokens need
    assert kv.can_admit(b, hit, 4)
    kv.admit(b, hit)
    assert b.num_computed_tokens == 16 and b.num_cached_blocks == 4 and len(b.block_table) == 4
    assert [pool.lookup(h) for h in hashes] == b.block_table
    assert all(pool.ref_count(x) == 1 for x in b.block_table)
    assert tiers.hit_blocks["host"] == 4 and kv.device_hit_blocks == 0
    stored = [e for e in pool.events.drain() if isinstance(e, BlockStored) and e.tier == "device"]
    assert [(e.block_hash, e.parent) for e in stored] == list(zip(hashes, [None, *hashes[:-1]], strict=True))
    assert all(h in tiers.host for h in hashes)  # inclusive: the host keeps its copy


def test_admission_counts_the_device_blocks_onboarding_needs():
    pool, kv, _ = tiered(num_blocks=6)
    a = seq(range(21), "a")  # five blocks
    compute(kv, a)
    kv.free(a)
    compute(kv, f := seq(range(500, 524), "f"))  # six blocks: a's all go to the host tier
    kv.free(f)
    keep = pool.allocate(3)  # three blocks in use elsewhere: 3 free
    b = seq(range(21), "b")
    hit = kv.match_prefix(b)
    assert hit.num_below == 5
    assert not kv.can_admit(b, hit, 1)  # 5 to onboard + 1 to grow > 3 free
    pool.free(keep)
    assert kv.can_admit(b, hit, 1)
    kv.admit(b, hit)
    assert kv.grow(b, 1) and b.num_computed_tokens == 20


def test_walk_continues_through_device_blocks_after_a_host_block():
    pool, kv, tiers = tiered(num_blocks=5)
    a = seq(range(13), "a")  # three full blocks + one token
    compute(kv, a)
    _, b1, b2, _ = a.block_table
    h = a.block_hashes()
    kv.free(a)
    pool.touch([b1, b2])  # held elsewhere, so that only block 0 can go down
    pool.allocate(pool.num_free)
    assert pool.lookup(h[0]) is None and h[0] in tiers.host
    pool.free([b1, b2])
    s = seq([*range(13), 5], "s")
    hit = kv.match_prefix(s)
    assert hit.blocks == [None, b1, b2]
    pool.free([x for x in range(5) if pool.ref_count(x)])  # make room for the onboarded block
    assert kv.can_admit(s, hit, 2)
    kv.admit(s, hit)
    assert s.block_table[1:] == [b1, b2] and pool.lookup(h[0]) == s.block_table[0]
    assert s.num_computed_tokens == 12 and kv.device_hit_blocks == 2 and tiers.hit_blocks["host"] == 1


def test_pool_without_caching_and_without_tiers_matches_nothing_below():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    s = seq(range(9))
    compute(kv, s)
    kv.free(s)
    hit = kv.match_prefix(seq(range(9), "b"))
    assert hit.num_below == 0 and len(hit) == 2


# -- the disk tier ------------------------------------------------------------------------------


PAYLOAD = 64


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PAYLOAD))


def disk(root, cap_blocks=8, fp=7, events=None):
    return DiskTier(root, cap_blocks * (HEADER.size + PAYLOAD), fp, PAYLOAD, events)


def test_disk_round_trip_and_restart(tmp_path):
    events = KvEventLog()
    d = disk(tmp_path, events=events)
    assert d.put(1, None, payload(1)) and d.put(2, 1, payload(2))
    assert not d.put(2, 1, payload(2))  # already there: only touched
    assert d.get(2) == payload(2)
    assert events.drain() == [BlockStored(1, None, "disk"), BlockStored(2, 1, "disk")]
    assert not any(p.name.endswith(".tmp") for p in d.dir.iterdir())
    again = disk(tmp_path, events=events)  # a new engine on the same directory
    assert sorted(again.hashes()) == [1, 2] and again.get(1) == payload(1)
    assert events.drain() == []  # found blocks reach routers through the snapshot
    assert disk(tmp_path, fp=8).hashes() == []  # another model/layout: its own subdirectory


def test_disk_evicts_its_coldest_files_under_the_cap(tmp_path):
    events = KvEventLog()
    d = disk(tmp_path, cap_blocks=3, events=events)
    for i in range(3):
        d.put(i, None, payload(i))
    d.get(0)  # 1 is now the coldest
    d.put(3, None, payload(3))
    assert sorted(d.hashes()) == [0, 2, 3] and not d.path(1).exists()
    assert BlockRemoved(1, "disk") in events.drain()
    assert d.used_bytes <= d.capacity_bytes and d.evicted == 1


def test_corrupt_truncated_and_foreign_files_are_misses(tmp_path):
    events = KvEventLog()
    d = disk(tmp_path, events=events)
    for i in range(4):
        d.put(i, None, payload(i))
    events.drain()
    raw = bytearray(d.path(0).read_bytes())
    raw[-1] ^= 0xFF  # a flipped payload byte
    d.path(0).write_bytes(bytes(raw))
    assert d.get(0) is None and not d.path(0).exists() and 0 not in d
    assert events.drain() == [BlockRemoved(0, "disk")] and d.corrupt == 1
    raw = bytearray(d.path(1).read_bytes())
    raw[12] ^= 0x01  # the header's fingerprint
    d.path(1).write_bytes(bytes(raw))
    assert d.get(1) is None
    with open(d.path(2), "r+b") as f:
        f.truncate(HEADER.size + PAYLOAD // 2)
    assert d.get(2) is None
    os.replace(d.path(3), d.path(9))  # a file under the wrong name
    again = disk(tmp_path)
    assert again.hashes() == [] and again.corrupt == 1
    assert d.get(3) is None  # gone from under the first engine: a plain miss


def test_the_disk_tier_is_private_to_its_user(tmp_path):
    d = disk(tmp_path / "root")
    d.put(1, None, payload(1))
    assert stat.S_IMODE(d.dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(d.path(1).stat().st_mode) == 0o600
    open_dir = tmp_path / "open"
    (open_dir / f"{7:016x}").mkdir(parents=True, mode=0o755)
    os.chmod(open_dir / f"{7:016x}", 0o755)  # open to others: refused, not served from
    with pytest.raises(PermissionError, match="0700"):
        disk(open_dir)
    link = tmp_path / "link"
    link.mkdir()
    (link / f"{7:016x}").symlink_to(d.dir)  # a link to a private directory is not one
    with pytest.raises(PermissionError):
        disk(link)
    os.chmod(d.path(1), 0o644)  # a file others could have written is not indexed
    assert disk(tmp_path / "root").hashes() == []


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_disk_tier_directory_of_another_user_is_refused(tmp_path):
    foreign = tmp_path / "foreign"
    (foreign / f"{7:016x}").mkdir(parents=True, mode=0o700)
    os.chown(foreign / f"{7:016x}", 65534, 65534)
    with pytest.raises(PermissionError, match="of this user"):
        disk(foreign)


def test_a_keyed_checksum_refuses_blocks_written_without_the_key(tmp_path):
    keyed = DiskTier(tmp_path, 8 * (HEADER.size + PAYLOAD), 7, PAYLOAD, checksum_key=b"mesh-secret")
    assert keyed.put(1, None, payload(1)) and keyed.get(1) == payload(1)
    # a forger without the key: an unkeyed tier (the same layout) writes block 2
    unkeyed = DiskTier(tmp_path, 8 * (HEADER.size + PAYLOAD), 7, PAYLOAD)
    assert unkeyed.get(1) is None  # and the keyed file is no block to it either
    unkeyed.put(2, None, payload(2))
    other = DiskTier(tmp_path, 8 * (HEADER.size + PAYLOAD), 7, PAYLOAD, checksum_key=b"another-key")
    other.put(3, None, payload(3))
    again = DiskTier(tmp_path, 8 * (HEADER.size + PAYLOAD), 7, PAYLOAD, checksum_key=b"mesh-secret")
    assert again.get(2) is None and again.get(3) is None and again.corrupt == 2
    keyed.put(4, None, payload(4))
    raw = bytearray(keyed.path(4).read_bytes())
    raw[16:24] = (5).to_bytes(8, "little")  # the header says block 5: the MAC covers the header too
    keyed.path(5).write_bytes(bytes(raw))
    os.chmod(keyed.path(5), 0o600)
    assert DiskTier(tmp_path, 8 * (HEADER.size + PAYLOAD), 7, PAYLOAD, checksum_key=b"mesh-secret").get(5) is None


def test_spill_writes_only_reused_blocks(tmp_path):
    class Copier:  # bytes by slot, as the real copier would have them
        def __init__(self):
            self.slots = {}

        def offload(self, block_ids, slots):
            for b, s in zip(block_ids, slots, strict=True):
                self.slots[s] = payload(b)

        def slot_bytes(self, slot):
            return self.slots[slot]

        def stage(self, sources):
            return [self.slots[x] if isinstance(x, int) else bytes(x) for x in sources]

        def sync(self):
            pass

    events = KvEventLog()
    host = HostTier(2, events)
    d = disk(tmp_path, events=events)
    tiers = TieredCache(host, disk=d, copier=Copier(), disk_min_hits=2)
    tiers.offload([ev(1, 11, hits=0), ev(2, 12, hits=2)])
    tiers.offload([ev(3, 13), ev(4, 14)])  # evicts 11 (not reused: dropped) and 12 (reused twice: written)
    assert d.hashes() == [12] and d.get(12) == payload(2)
    assert tiers.holds(12) and not tiers.holds(11)
    staged = tiers.load([13, 12])  # host first, then disk
    assert staged.tiers == ["host", "disk"] and staged.hashes == [13, 12]
    assert staged.data == [payload(3), payload(2)]
    assert tiers.snapshot() == {"host": [14, 13], "disk": [12]}


# -- the mocker's virtual host tier ---------------------------------------------------------------


def test_mocker_models_host_hits_without_bytes():
    from mocker.engine import MockConfig, MockEngine

    engine = MockEngine(MockConfig(num_blocks=24, block_size=16, host_kv_blocks=256, speedup=1e9))
    convs = [list(range(c * 1000, c * 1000 + 150)) for c in range(4)]
    cached = []
    for _turn in range(3):
        for i, history in enumerate(convs):
            (s,) = engine.generate([history], SamplingParams(max_tokens=4, temperature=0.0))
            cached.append(s.num_cached_tokens)
            convs[i] = [*history, *s.output_token_ids, *range(50)]
    assert cached[:4] == [0] * 4 and all(c >= 144 for c in cached[4:])
    counters = engine.kv_counters()
    assert counters["hit_blocks_host"] > 0 and counters["host_blocks"] > 0
    snap = engine.kv_snapshot()
    assert set(snap) == {"device", "host"} and snap["host"]


# -- the virtual disk tier and pins -----------------------------------------------------------------


def test_virtual_disk_tier_is_the_disk_bookkeeping_without_bytes():
    from kvstore.disk import EMPTY, VirtualDiskTier

    events = KvEventLog()
    d = VirtualDiskTier(2, events)
    assert d.put(1, None) and d.put(2, 1) and not d.put(1, None)  # 1 again: only touched (now hottest)
    assert d.get(3) is None and d.get(2) is EMPTY  # 2 is now the hottest
    assert d.put(3, 2)  # evicts the coldest: 1
    assert d.hashes() == [2, 3]
    assert events.drain() == [BlockStored(1, None, "disk"), BlockStored(2, 1, "disk"), BlockRemoved(1, "disk"),
                              BlockStored(3, 2, "disk")]
    assert d.pin(2) and not d.pin(9)
    assert d.put(4, 3) and d.hashes() == [2, 4]  # 2 is pinned: 3 went instead
    assert d.pin(4) and not d.put(5, 4)  # everything pinned: the new block is not kept
    d.unpin(2)
    assert d.put(5, 4) and d.hashes() == [4, 5]
    assert d.counters() == {"disk_blocks": 2, "disk_capacity_blocks": 2, "disk_written_blocks": 5,
                            "disk_evicted_blocks": 3}


def test_host_tier_never_evicts_a_pinned_block():
    host = HostTier(2)
    host.store([ev(0, 10), ev(1, 11)])
    assert host.pin(10) and host.pin(10) and not host.pin(99)
    stored, dropped = host.store([ev(2, 12)])
    assert [h for h, _ in dropped] == [11] and host.hashes() == [10, 12]  # 10 is colder, but pinned
    assert host.pin(12)
    stored, dropped = host.store([ev(3, 13)])
    assert stored == [] and dropped == [] and 13 not in host  # all pinned: not kept
    host.unpin(10)
    assert 10 in host._pins  # pinned twice, released once
    host.unpin(10)
    stored, dropped = host.store([ev(3, 13)])
    assert [h for h, _ in dropped] == [10] and 13 in host


def test_disk_tier_skips_pinned_files_when_over_its_cap(tmp_path):
    d = disk(tmp_path, cap_blocks=2)
    d.put(1, None, payload(1))
    d.put(2, 1, payload(2))
    assert d.pin(1)
    d.put(3, 2, payload(3))
    assert d.hashes() == [1, 3] and not d.path(2).exists()
    assert d.pin(3) and not d.put(4, 3, payload(4))  # every file pinned: not written
    assert d.get(1) == payload(1)


def test_the_mockers_tiers_spill_reused_blocks_to_a_virtual_disk():
    from kvstore.disk import VirtualDiskTier

    events = KvEventLog()
    tiers = TieredCache(HostTier(2, events), disk=VirtualDiskTier(4, events), disk_min_hits=2)
    tiers.offload([ev(1, 11, hits=0), ev(2, 12, hits=3)])
    tiers.offload([ev(3, 13), ev(4, 14)])  # 11 (never reused) is dropped, 12 goes to disk
    assert tiers.disk.hashes() == [12] and tiers.holds(12) and not tiers.holds(11)
    staged = tiers.load([13, 12])
    assert staged.tiers == ["host", "disk"] and staged.data is None
    with pytest.raises(ValueError, match="virtual"):
        TieredCache(HostTier(2), disk=VirtualDiskTier(4), copier=object())
