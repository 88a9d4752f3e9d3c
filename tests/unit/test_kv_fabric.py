"""Cluster-wide KV below the worker (issue 20): pinning blocks for a peer fetch, staging the blocks a
peer sent, and the mocker's timing of tier onboarding and fetches."""

from __future__ import annotations

import pytest

from engine.sampling import SamplingParams
from engine.sequence import Sequence
from kvstore.events import KvEventLog
from kvstore.hashing import DEFAULT_HASH_KEY, hash_seed
from kvstore.manager import KVCacheManager
from kvstore.peer import PeerStage
from kvstore.pins import KvPins
from kvstore.pool import BlockPool, NoFreeBlocks
from kvstore.tiers import HostTier, TieredCache

BS = 4


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=1), block_size=BS, hash_seed=hash_seed(DEFAULT_HASH_KEY, "m"))


def cached_run(pool: BlockPool, hashes: list[int]) -> list[int]:
    """Blocks holding ``hashes`` (a chain), freed so that they stay cached; the last one is evicted first."""
    table = pool.allocate(len(hashes))
    for i, (b, h) in enumerate(zip(table, hashes, strict=True)):
        pool.cache(b, h, hashes[i - 1] if i else None)
    pool.free(reversed(table))
    return table


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# -- the holder: pins -------------------------------------------------------------------------


def test_pins_hold_a_run_across_tiers_until_released():
    from kvstore.disk import VirtualDiskTier

    events = KvEventLog()
    pool = BlockPool(3)
    tiers = TieredCache(HostTier(1, events), disk=VirtualDiskTier(4, events), disk_min_hits=0)
    pool.on_evict = tiers.offload
    clock = Clock()
    pins = KvPins(pool, tiers, clock)
    cached_run(pool, [11, 12, 13])
    pool.allocate(1)  # 13 -> host
    pool.allocate(1)  # 12 -> host, 13 -> disk; 11 stays on the device
    run = pins.pin("f1", [11, 12, 13, 14], lease_s=5.0)
    assert run.hashes == [11, 12, 13] and run.tiers == ["device", "host", "disk"]
    assert run.tier_counts == {"device": 1, "host": 1, "disk": 1}
    assert pins.serving_device and pins.num_pinned_blocks == 3
    # nothing pinned can be evicted: the device block is in use, the host and disk entries are skipped
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    tiers.offload([pool_evicted(pool, 99)])  # a new block for the host tier: its only slot is pinned
    assert 12 in tiers.host and 99 not in tiers.host
    with pytest.raises(ValueError, match="already"):
        pins.pin("f1", [11], 5.0)
    assert pins.release("f1") and not pins.release("f1")
    assert pool.ref_count(pool.lookup(11)) == 0 and pool.num_free == 1  # cached again, evictable
    tiers.offload([pool_evicted(pool, 99)])
    assert 99 in tiers.host and 12 in tiers.disk  # unpinned: 12 went down to make room


def pool_evicted(pool, h):
    from kvstore.pool import EvictedBlock

    return EvictedBlock(0, h, None, 5)


def test_a_lost_fetch_frees_its_pins_when_its_lease_runs_out():
    pool = BlockPool(4)
    clock = Clock()
    pins = KvPins(pool, None, clock)
    cached_run(pool, [1, 2])
    run = pins.pin("lost", [1, 2], lease_s=2.0)
    assert len(run) == 2 and pool.num_free == 2
    assert pins.pin("empty", [7, 8], lease_s=2.0).hashes == []  # nothing held: an empty run
    clock.now += 1.0
    assert pins.expire() == 0
    clock.now += 1.5
    assert pins.expire() == 2 and len(pins) == 0 and pool.num_free == 4
    assert pins.counters()["fetch_pins_expired"] == 2
    with pytest.raises(ValueError):
        pins.pin("x", [1], lease_s=0)


def test_pinned_blocks_are_read_from_any_tier(tmp_path):
    torch = pytest.importorskip("torch")
    from kvstore.cache import KVCache, KVCacheSpec
    from kvstore.disk import DiskTier
    from kvstore.tiers import BlockCopier

    spec = KVCacheSpec(num_layers=2, num_blocks=3, block_size=BS, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    kv = KVCache(spec, torch.device("cpu"))
    events = KvEventLog()
    copier = BlockCopier(kv, 1)
    disk = DiskTier(tmp_path, 16 * spec.block_bytes, 1, spec.block_bytes, events)
    tiers = TieredCache(HostTier(1, events), disk=disk, copier=copier, disk_min_hits=0)
    pool = BlockPool(3)
    pool.on_evict = tiers.offload
    table = pool.allocate(3)
    for i, b in enumerate(table):
        kv.tensor[:, :, b] = float(i + 1)  # block i holds the value i + 1 everywhere
    for i, (b, h) in enumerate(zip(table, [11, 12, 13], strict=True)):
        pool.cache(b, h, 10 + i if i else None)
    pool.free(reversed(table))
    for _ in range(2):  # 13 -> host, then 12 -> host and 13 -> disk; the new owners overwrite the blocks
        kv.tensor[:, :, pool.allocate(1)[0]] = -1.0
    pins = KvPins(pool, tiers)
    run = pins.pin("f", [11, 12, 13], lease_s=5.0)
    assert run.tiers == ["device", "host", "disk"]
    data, n = pins.read("f", copier)
    assert n == 3 and data.shape == (3, 2, 2, BS, 2, 4)
    assert [float(data[i].min()) for i in range(3)] == [1.0, 2.0, 3.0]
    assert [float(data[i].max()) for i in range(3)] == [1.0, 2.0, 3.0]
    # a disk file that fails its check ends the run read there
    disk.path(13).write_bytes(disk.path(13).read_bytes()[:-1] + b"\x00")
    _, n = pins.read("f", copier)
    assert n == 2
    pins.release("f")


# -- the requester: blocks a peer sent ---------------------------------------------------------------


def test_blocks_a_peer_sent_are_onboarded_once_as_peer_hits():
    pool = BlockPool(8)
    tiers = TieredCache(None)
    kv = KVCacheManager(pool, BS, tiers)
    s = seq(range(13))  # three full blocks + one token
    hashes = s.block_hashes()
    tiers.stage_peer(hashes[:2])  # the peer held the first two
    hit = kv.match_prefix(s)
    assert hit.blocks == [None, None] and hit.num_below == 2
    kv.admit(s, hit)
    assert s.num_computed_tokens == 8 and tiers.hit_blocks == {"host": 0, "disk": 0, "peer": 2}
    assert [pool.lookup(h) for h in hashes[:2]] == s.block_table  # now on device, named (events)
    assert len(tiers.peer) == 0  # used once
    # an engine with KV bytes needs the bytes
    with pytest.raises(ValueError, match="payloads"):
        TieredCache(None, copier=object()).stage_peer([1])


def test_staged_blocks_nobody_admitted_expire():
    clock = Clock()
    stage = PeerStage(ttl=30.0, clock=clock)
    stage.put([1, 2])
    clock.now += 10
    stage.put([3])
    clock.now += 25
    assert stage.expire() == 2 and 3 in stage and 1 not in stage
    assert stage.take(3) is not None and stage.take(3) is None


# -- the mocker's timing -------------------------------------------------------------------------------


def mock_engine(**kw):
    from mocker.engine import MockConfig, MockEngine

    return MockEngine(MockConfig(block_size=16, speedup=1e9, **kw))


def ttft_ms(engine, tokens, rid) -> tuple[float, int]:
    """Simulated time from admission to the first token, and the tokens that came from a cache."""
    s = engine.new_sequence(tokens, SamplingParams(max_tokens=1, temperature=0.0), request_id=rid)
    t0 = engine.simulated_ms
    engine.add(s)
    while not s.output_token_ids:
        engine.step()
    return engine.simulated_ms - t0, s.num_cached_tokens


def test_tier_onboarding_time_shows_in_the_mockers_ttft():
    engine = mock_engine(num_blocks=24, host_kv_blocks=64, disk_kv_blocks=256)
    timing = engine.config.timing
    prompt = list(range(1, 321))  # 20 blocks, 19 reusable
    cold, cached = ttft_ms(engine, prompt, "cold")
    assert cached == 0
    warm, cached = ttft_ms(engine, prompt, "warm")
    assert cached == 19 * 16
    # the other prompts push it out of the device pool into the host tier
    for i in range(3):
        ttft_ms(engine, list(range(1000 * (i + 1), 1000 * (i + 1) + 320)), f"other-{i}")
    before = engine.kv_counters()
    host, cached = ttft_ms(engine, prompt, "host")
    after = engine.kv_counters()
    onboarded = after["hit_blocks_host"] - before["hit_blocks_host"]
    assert cached == 19 * 16 and onboarded > 0
    assert host - warm == pytest.approx(timing.onboard_ms(onboarded, 0, 16))
    assert warm < host < cold
    # 2 MiB per block at 25 GB/s: ~0.084 ms a block, against 0.96 ms to prefill it
    assert timing.onboard_ms(1, 0, 16) == pytest.approx(2 * 1024 * 1024 / 25e9 * 1000)

    # blocks reused twice or more go down to the disk tier when the host tier evicts them: slower
    for i in range(6):
        ttft_ms(engine, list(range(5000 + 400 * i, 5000 + 400 * i + 320)), f"flood-{i}")
    before = engine.kv_counters()
    on_disk, cached = ttft_ms(engine, prompt, "disk")
    after = engine.kv_counters()
    disk_n = after["hit_blocks_disk"] - before["hit_blocks_disk"]
    host_n = after["hit_blocks_host"] - before["hit_blocks_host"]
    assert disk_n > 0 and cached == 19 * 16
    assert on_disk - warm == pytest.approx(timing.onboard_ms(host_n, disk_n, 16))
    assert on_disk > host


def test_blocks_fetched_from_a_peer_cost_no_step_time_and_count_as_peer_hits():
    holder, requester = mock_engine(num_blocks=64), mock_engine(num_blocks=64, peer_fetch=True)
    with pytest.raises(RuntimeError, match="no tiers"):
        holder.stage_peer_blocks([1])
    prompt = list(range(1, 321))
    ttft_ms(holder, prompt, "a")
    warm, _ = ttft_ms(holder, prompt, "b")
    hashes = requester.new_sequence(prompt, SamplingParams()).block_hashes(19)
    run = holder.pins.pin("f", hashes, lease_s=5.0)
    assert len(run) == 19 and run.tier_counts == {"device": 19}
    requester.stage_peer_blocks(run.hashes)
    holder.pins.release("f")
    fetched, cached = ttft_ms(requester, prompt, "c")
    assert cached == 19 * 16 and fetched == pytest.approx(warm)  # the transfer was paid before admission
    c = requester.kv_counters()
    assert c["hit_blocks_peer"] == 19 and c["hit_blocks_device"] == 0
    timing = holder.config.timing
    block = 2 * 1024 * 1024
    assert timing.fetch_ms({"device": 19}, 16) == pytest.approx(1.0 + 19 * block / 12.5e9 * 1000)
    assert timing.fetch_ms({"disk": 1}, 16) == pytest.approx(1.0 + block / 5e9 * 1000)  # the disk is slower


def test_a_holder_serving_from_device_memory_steps_slower():
    engine = mock_engine(num_blocks=64)
    prompt = list(range(1, 321))
    ttft_ms(engine, prompt, "a")
    base, _ = ttft_ms(engine, list(range(2000, 2320)), "b")
    engine.pins.pin("f", engine.new_sequence(prompt, SamplingParams()).block_hashes(4), lease_s=5.0)
    slow, _ = ttft_ms(engine, list(range(3000, 3320)), "c")
    assert slow == pytest.approx(base * engine.config.timing.serve_slowdown())
    assert engine.config.timing.serve_slowdown() == pytest.approx(1 + 12.5 / 3350)


def test_the_mockers_costs_for_the_router_follow_its_timing():
    from mocker.engine import MockConfig, TimingModel

    engine = mock_engine()
    assert engine.kv_costs.prefill_block_ms == pytest.approx(0.96)
    fast = mock_engine(timing=TimingModel(host_gb_per_s=50.0))
    assert fast.kv_costs.host_block_ms == pytest.approx(engine.kv_costs.host_block_ms / 2)
    with pytest.raises(ValueError, match="host"):
        MockConfig(disk_kv_blocks=8)


# -- the command line ----------------------------------------------------------------------------------


def test_tier_and_fetch_flags_reach_the_mocker(monkeypatch):
    from cli import CliError, build_parser, engine_config, main

    def mock(*flags):
        return engine_config(build_parser().parse_args(["worker", "mock", *flags]), mock=True)

    cfg = mock("--host-kv-blocks", "64", "--disk-kv-blocks", "128", "--peer-fetch",
               "--mock-timing", "network_gb_per_s=50", "--mock-timing", "num_layers=80")
    assert (cfg.host_kv_blocks, cfg.disk_kv_blocks, cfg.peer_fetch) == (64, 128, True)
    assert cfg.timing.network_gb_per_s == 50.0 and cfg.timing.num_layers == 80
    assert cfg.timing.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    for flags, message in [(("--disk-kv-blocks", "8"), "host"), (("--mock-timing", "warp=9"), "FIELD=VALUE"),
                           (("--mock-timing", "host_gb_per_s=fast"), "not a number"),
                           (("--mock-timing", "host_gb_per_s=0"), "rates"), (("--disk-kv-gb", "1"), "blocks")]:
        with pytest.raises(CliError, match=message):
            mock(*flags)
    with pytest.raises(CliError, match="needs a host KV tier"):  # model workers stage fetched blocks there
        engine_config(build_parser().parse_args(["worker", "decode", "--model", "m", "--peer-fetch"]))

    import cli.localmesh

    plans = []

    async def fake_run_up(plan):
        plans.append(plan)
        return 0

    monkeypatch.setattr(cli.localmesh, "run_up", fake_run_up)
    assert main(["up", "--mock", "--decode", "2", "--host-kv-blocks", "64", "--disk-kv-blocks", "128",
                 "--peer-fetch", "--mock-timing", "host_gb_per_s=50", "--no-planner"]) == 0
    flags, gateway = plans[0].worker_flags, plans[0].gateway_flags
    for flag, value in [("--host-kv-blocks", "64"), ("--disk-kv-blocks", "128"), ("--mock-timing", "host_gb_per_s=50")]:
        assert flags[flags.index(flag) + 1] == value
    assert "--peer-fetch" in flags and "--router-peer-fetch" in gateway
    assert main(["up", "--mock", "--disk-kv-blocks", "8", "--no-planner"]) == 2  # one line, before anything starts


async def test_a_mock_worker_takes_the_routers_decision_whenever_it_arrives():
    import asyncio

    from mesh.protocol import RouterDecision
    from mocker.worker import FetchHints

    def decision(rid, worker="me", source="peer"):
        return RouterDecision("r", "mock", worker, rid, 10, 2, 0.0, "kv", 0.0, fetch_source=source, fetch_blocks=8)

    hints = FetchHints("me")
    hints.add(decision("early"))  # the decision came before the request
    hints.add(decision("other", worker="someone-else"))  # about another worker: ignored
    assert (await hints.wait("early", 0.01)).fetch_source == "peer"
    assert await hints.wait("other", 0.01) is None
    waiting = asyncio.create_task(hints.wait("late", 1.0))
    await asyncio.sleep(0)
    hints.add(decision("late"))  # the request came first: its wait ends when the decision does
    assert (await waiting).request_id == "late"
    assert await hints.wait("never", 0.01) is None and not hints._waiters


async def test_the_gateway_sends_the_routers_fetch_plan_in_the_request():
    """gateway/service.py ``_send``: a decision naming a peer reaches the worker in ``GenerateRequest.peer_fetch``."""
    from types import SimpleNamespace

    from gateway.choices.choice import ChoiceRun, RetryPolicy
    from gateway.service import Gateway, GatewayConfig
    from mesh.protocol import (
        GenerateRequest,
        PeerFetchPlan,
        SamplingOptions,
        Subjects,
        decode,
        encode,
    )
    from mesh.router.policy import Decision

    sent: list[GenerateRequest] = []
    decisions = [Decision("b", "kv", 0.0, 1, hit_blocks=2, fetch_source="a", fetch_blocks=30),
                 Decision("b", "kv", 32.0, 1, hit_blocks=32)]

    class Bus:
        subjects = Subjects("t")

        async def publish(self, subject, msg, reply="", span=None, **_):
            sent.append(decode(encode(msg), GenerateRequest))  # as the worker will see it

    gw = Gateway(GatewayConfig("nats://unused"))
    gw.bus = Bus()
    gw.router = SimpleNamespace(route=lambda *a, **kw: decisions.pop(0))
    gw.replies = SimpleNamespace(batch_subject="replies", open=lambda w: SimpleNamespace(subject="r", key="k"))
    from opentelemetry.trace import INVALID_SPAN

    for _ in range(2):
        await gw._send(ChoiceRun(RetryPolicy()), "rq", "m", [1] * 600, SamplingOptions(), 0, INVALID_SPAN)
    assert sent[0].peer_fetch == PeerFetchPlan("a", 30, 2)
    assert sent[1].peer_fetch is None  # no fetch planned: nothing on the wire


async def test_the_shm_target_is_the_requesters_buffer_and_a_dropped_one_is_gone():
    import torch

    from kvstore.transfer.fetch import ShmChannel

    ch = ShmChannel(worker_id="req")
    shape = (2, 2, 16, 2, 8)  # one block: layers, k/v, tokens, heads, dim
    block = 2 * 2 * 16 * 2 * 8 * 2  # bf16 bytes
    params = await ch.params("f1", 3 * block)
    with pytest.raises(ValueError):  # a holder cannot map past the buffer
        ch.target(params, 4, shape, torch.bfloat16)
    dest = ch.target(params, 3, shape, torch.bfloat16)
    assert dest.shape == (3, *shape) and not dest.any()  # the requester's zeroed pages
    blocks = torch.randn(3, *shape).to(torch.bfloat16)
    dest.copy_(blocks)  # the holder's one copy
    got = await ch.take("f1", 3 * block)
    assert torch.equal(torch.frombuffer(bytearray(got), dtype=torch.bfloat16).view(3, *shape), blocks)
    assert ch.target(params, 0, shape, torch.bfloat16).shape == (0, *shape)
    await ch.forget("f1")
    dest[0].zero_()  # a holder still holding the mapping writes into pages nobody reads
    with pytest.raises(FileNotFoundError):  # and a late holder cannot map it any more
        ch.target(params, 1, shape, torch.bfloat16)


async def test_a_lent_run_is_read_out_of_the_holders_files_and_only_within_its_lease():
    import time

    import torch

    from kvstore.cache import KVCache, KVCacheSpec
    from kvstore.tiers import BlockCopier
    from kvstore.transfer import Refused
    from kvstore.transfer.fetch import ShmChannel
    from kvstore.transfer.shm import segment_name, shm_path

    spec = KVCacheSpec(2, 6, 4, 2, 8, torch.bfloat16)  # the holder's pool: 6 blocks
    kv = KVCache(spec, torch.device("cpu"), shm_path=shm_path("lend-test"))
    copier = BlockCopier(kv, 5, shm_path=kv.shm_path + ".host")
    ch = ShmChannel(worker_id="req")
    bb = spec.block_bytes
    try:
        kv.tensor.copy_(torch.randn(spec.shape).to(torch.bfloat16))
        copier.slots.copy_(torch.randn(copier.slots.shape).to(torch.bfloat16))
        disk = torch.randn(copier.block_shape).to(torch.bfloat16)  # a disk-tier block: in no shared file
        params = await ch.params("f1", 3 * bb)
        assert params["read"] is True
        await ch.write_rows(params, [(2, memoryview(disk.view(-1).view(torch.uint8).numpy()))], bb)
        lent = {"kv": segment_name(kv.shm_path), "slots": segment_name(copier.shm_path), "spec": spec.to_dict(),
                "where": [0, 1, 2], "index": [4, 3, 2], "until": time.time() + 10}
        got = await ch.take("f1", 3 * bb, lent)
        blocks = torch.frombuffer(bytearray(got), dtype=torch.bfloat16).view(3, *copier.block_shape)
        assert torch.equal(blocks[0], kv.tensor[:, :, 4])  # device block 4, out of the layer-major pool
        assert torch.equal(blocks[1], copier.slots[3])  # host slot 3
        assert torch.equal(blocks[2], disk)  # written by the holder into our buffer, at its row
        # a read that ends past the lease is no read: the holder may have reused the blocks
        assert await ch.take("f1", 3 * bb, {**lent, "until": time.time()}) is None
        for bad in ({"where": [0], "index": [6]},  # past the holder's pool
                    {"where": [1], "index": [-1]},
                    {"where": [2], "index": [1]},  # a buffered block must sit at its own row
                    {"kv": "../" + lent["kv"]}, {"kv": "passwd"},  # no file but a KV file of the mesh's
                    {"spec": {"num_layers": 2}}):
            with pytest.raises(Refused):
                await ch.take("f1", bb, {**lent, **bad})
        with pytest.raises(ValueError):  # the holder cannot write past the buffer
            await ch.write_rows(params, [(3, memoryview(disk.view(-1).view(torch.uint8).numpy()))], bb)
    finally:
        await ch.forget("f1")
        copier.close()
        kv.close(unlink=True)
    import os

    assert not os.path.exists(kv.shm_path) and not os.path.exists(kv.shm_path + ".host")
