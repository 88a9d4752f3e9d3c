"""The router's index and policy, without NATS."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvstore.events import BlockRemoved, BlockStored
from mesh.kvevents import to_wire
from mesh.protocol import KvEvent, KvEventBatch
from mesh.router.costs import DISK, HOST, KvCosts, default_costs
from mesh.router.index import DEFAULT_WEIGHTS, KvIndex, PrefixMatch
from mesh.router.policy import RouterConfig, RouteRequest, WorkerLoad, kv_costs, pick_worker


def batch(worker, seq, *events):
    return KvEventBatch(worker, "m", seq, list(events))


def stored(hashes, parent=None, tier="device"):
    return KvEvent("stored", list(hashes), parent, tier)


def removed(hashes, tier="device"):
    return KvEvent("removed", list(hashes), None, tier)


def test_insert_remove_and_overlap_walk():
    idx = KvIndex()
    idx.load_snapshot("a", 0, {})
    idx.load_snapshot("b", 0, {})
    assert idx.apply(batch("a", 1, stored([1, 2, 3, 4])))
    assert idx.apply(batch("b", 1, stored([1, 2, 9])))
    assert idx.overlap([1, 2, 3, 4, 5]) == {"a": 4.0, "b": 2.0}
    assert idx.overlap([7, 1, 2]) == {}  # overlap is a leading run
    assert idx.apply(batch("a", 2, removed([2])))
    assert idx.overlap([1, 2, 3, 4]) == {"a": 1.0, "b": 2.0}  # a's run ends at its first miss
    idx.drop_worker("b")
    assert idx.overlap([1, 2, 3]) == {"a": 1.0}
    assert idx.num_blocks("a") == 3


def test_tier_moves_change_the_credit():
    idx = KvIndex()
    host, disk = DEFAULT_WEIGHTS["host"], DEFAULT_WEIGHTS["disk"]
    idx.load_snapshot("a", 0, {"device": [1, 2, 3]})
    # block 2 is copied to host, then dropped from device: credited less than a device hit
    assert idx.apply(batch("a", 1, stored([2], 1, "host"), removed([2], "device")))
    assert idx.tiers_of("a", 2) == {"host"}
    assert idx.overlap([1, 2, 3]) == {"a": pytest.approx(2 + host)}
    assert idx.match([1, 2, 3]) == {"a": PrefixMatch(3, ((1, HOST),))}
    assert idx.apply(batch("a", 2, stored([3], 2, "disk"), removed([3], "device")))
    assert idx.overlap([1, 2, 3]) == {"a": pytest.approx(1 + host + disk)}
    assert idx.match([1, 2, 3])["a"].tier_counts() == {"device": 1, "host": 1, "disk": 1}
    # back on device (onboarded): full credit again, whatever else it is also on
    assert idx.apply(batch("a", 3, stored([2, 3], 1, "device")))
    assert idx.overlap([1, 2, 3]) == {"a": pytest.approx(3.0)}
    assert idx.apply(batch("a", 4, KvEvent("cleared")))
    assert idx.overlap([1]) == {}


def test_a_gap_in_sequence_numbers_is_refused_until_a_snapshot():
    idx = KvIndex()
    assert not idx.apply(batch("a", 1, stored([1])))  # never synced: resync first
    idx.load_snapshot("a", 5, {"device": [1]})
    assert not idx.apply(batch("a", 7, stored([2], 1)))  # 6 is missing
    assert idx.overlap([1, 2]) == {"a": 1.0}
    assert idx.apply(batch("a", 6, stored([2], 1)))
    assert idx.apply(batch("a", 7, stored([3], 2)))
    assert idx.overlap([1, 2, 3]) == {"a": 3.0}
    idx.load_snapshot("a", 20, {"device": [9]})  # a snapshot replaces what was known
    assert idx.overlap([1]) == {} and idx.seq("a") == 20


def test_approximate_mode_predictions_expire():
    idx = KvIndex()
    idx.predict("x", [1, 2, 3], ttl=10.0, now=100.0)
    assert idx.overlap([1, 2, 3]) == {"x": 3.0}
    assert idx.expire(now=105.0) == 0
    idx.predict("x", [1], ttl=10.0, now=106.0)  # refreshed
    assert idx.expire(now=111.0) == 2
    assert idx.overlap([1, 2]) == {"x": 1.0}
    assert idx.expire(now=117.0) == 1
    assert idx.overlap([1]) == {}


def test_a_routed_prefix_counts_until_the_events_about_it_arrive():
    idx = KvIndex()
    idx.load_snapshot("a", 0, {})
    idx.predict("a", [1, 2, 3, 4], ttl=10.0, now=100.0)  # routed there, not yet prefilled
    assert idx.overlap([1, 2, 3, 4]) == {"a": 4.0}
    assert idx.apply(batch("a", 1, stored([1, 2, 3])))  # the worker's events replace the guess...
    assert idx.tiers_of("a", 1) == {"device"} and idx.tiers_of("a", 4) == {"predicted"}
    assert idx.apply(batch("a", 2, removed([2])))  # ...so an eviction ends the credit at once
    assert idx.overlap([1, 2, 3, 4]) == {"a": 1.0}
    assert idx.expire(now=111.0) == 1  # block 4 was never stored: forgotten after the TTL
    assert idx.tiers_of("a", 4) == set()
    assert idx.num_blocks("a") == 2  # 1 and 3, from its events


def test_event_log_to_wire_merges_chains():
    events = [BlockStored(1, None, "device"), BlockStored(2, 1, "device"), BlockStored(7, None, "device"),
              BlockRemoved(5, "device"), BlockRemoved(6, "device"), BlockRemoved(8, "host")]
    wire = to_wire(events)
    assert [(e.kind, e.hashes, e.parent, e.tier) for e in wire] == [
        ("stored", [1, 2], None, "device"), ("stored", [7], None, "device"),
        ("removed", [5, 6], None, "device"), ("removed", [8], None, "host"),
    ]


def loads(**active):
    return [WorkerLoad(w, active_blocks=a, total_blocks=1000) for w, a in active.items()]


def on_device(n):
    return PrefixMatch(n)


def test_kv_cost_prefers_the_cached_worker_unless_it_is_much_busier():
    req = RouteRequest(num_tokens=160, block_size=16)  # 10 blocks
    cfg = RouterConfig()
    rng = random.Random(0)
    d = pick_worker(req, loads(a=5, b=5), {"a": on_device(8)}, cfg, rng)
    assert d.worker_id == "a" and d.new_blocks == 2 and d.overlap_blocks == 8.0 and d.hit_blocks == 8
    costs = kv_costs(req, loads(a=5, b=5), {"a": on_device(8)}, cfg)
    assert costs == {"a": 2 + 0.5, "b": 10 + 0.5}
    # a held block costs a tenth of a block to prefill: 20 more active blocks on a do not outweigh
    # its 8 cached ones, 200 more do
    assert pick_worker(req, loads(a=25, b=5), {"a": on_device(8)}, cfg, rng).worker_id == "a"
    assert pick_worker(req, loads(a=205, b=5), {"a": on_device(8)}, cfg, rng).worker_id == "b"
    assert pick_worker(req, loads(a=25, b=5), {"a": on_device(8)}, RouterConfig(decode_weight=1.0),
                       rng).worker_id == "b"
    # pending prefill counts as prefill work
    busy = [WorkerLoad("a", 5, pending_prefill_blocks=30), WorkerLoad("b", 5)]
    assert pick_worker(req, busy, {"a": on_device(8)}, cfg, rng).worker_id == "b"
    # the last prompt token is always computed: a full-prompt match reuses one block less
    assert pick_worker(req, loads(a=0), {"a": on_device(10)}, cfg, rng).new_blocks == 1


# -- tier costs ----------------------------------------------------------------------------------


def test_tier_costs_come_from_transfer_rates_not_guesses():
    c = default_costs(16)  # Llama-3-8B KV, 2 MiB per block; prefill 0.06 ms per token
    block = 2 * 32 * 8 * 128 * 2 * 16
    assert c.prefill_block_ms == pytest.approx(0.96)
    assert c.host_block_ms == pytest.approx(block / 25e9 * 1000)  # PCIe host memory, 25 GB/s
    assert c.disk_block_ms == pytest.approx(block / 5e9 * 1000)  # NVMe, 5 GB/s
    assert c.peer_block_ms == pytest.approx(block / 12.5e9 * 1000)  # 100 Gb/s NIC
    # cheaper than prefill, dearer than a device hit, in that order
    assert 0.0 == c.block_cost(1) < c.block_cost(HOST) < c.block_cost(DISK) < 1.0
    assert c.block_cost(HOST) == pytest.approx(c.host_block_ms / 0.96)
    assert DEFAULT_WEIGHTS["host"] == pytest.approx(1 - c.host_block_ms / 0.96)
    # a tier slower than recompute is worth nothing, never less
    slow = KvCosts.from_rates(16, disk_gb_per_s=0.5)
    assert slow.block_cost(DISK) == 1.0
    # the card's form
    assert KvCosts.from_dict(c.to_dict(), 16) == c
    assert KvCosts.from_dict({}, 32) == default_costs(32)
    assert KvCosts.from_dict({"prefill_block_ms": -1.0}, 16) == default_costs(16)  # garbled: the reference
    assert KvCosts.from_dict({"host_block_ms": 0.5, "unknown": 3.0}, 16).host_block_ms == 0.5


def test_a_host_or_disk_block_costs_its_onboarding():
    idx = KvIndex()
    idx.load_snapshot("dev", 0, {"device": list(range(1, 41))})
    idx.load_snapshot("host", 0, {"host": list(range(1, 41))})
    idx.load_snapshot("disk", 0, {"disk": list(range(1, 41))})
    req = RouteRequest(num_tokens=41 * 16, block_size=16, hashes=tuple(range(1, 42)))
    m = idx.match(req.hashes)
    assert [m[w].depth for w in ("dev", "host", "disk")] == [40, 40, 40]
    c = default_costs(16)
    costs = kv_costs(req, loads(dev=0, host=0, disk=0, cold=0), m, RouterConfig())
    assert costs["dev"] == pytest.approx(1)
    assert costs["host"] == pytest.approx(1 + 40 * c.host_block_ms / c.prefill_block_ms)
    assert costs["disk"] == pytest.approx(1 + 40 * c.disk_block_ms / c.prefill_block_ms)
    assert costs["cold"] == 41
    rng = random.Random(0)
    pick = [WorkerLoad("host"), WorkerLoad("cold")]
    assert pick_worker(req, pick, m, RouterConfig(), rng).worker_id == "host"
    # onboarding 40 host blocks costs ~3.5 prefill blocks: 3 queued blocks on "dev" do not outweigh it, 4 do
    assert pick_worker(req, [WorkerLoad("dev", pending_prefill_blocks=3), WorkerLoad("host")], m,
                       RouterConfig(), rng).worker_id == "dev"
    assert pick_worker(req, [WorkerLoad("dev", pending_prefill_blocks=4), WorkerLoad("host")], m,
                       RouterConfig(), rng).worker_id == "host"
    # a worker whose host tier is slow (its card says so) gets less credit for it
    slow = KvCosts.from_rates(16, host_gb_per_s=2.5)
    d = pick_worker(req, [WorkerLoad("host", costs=slow), WorkerLoad("disk")], m, RouterConfig(), rng)
    assert d.worker_id == "disk" and d.hit_blocks == 40


# -- peer fetch: the fetch-vs-prefill decision --------------------------------------------------------


def fetch_cfg(**kw):
    return RouterConfig(peer_fetch=True, **kw)


def test_a_busy_holder_lends_its_prefix_to_an_idle_worker():
    req = RouteRequest(num_tokens=64 * 16 + 5, block_size=16)  # 65 blocks, 64 reusable
    m = {"a": on_device(64)}
    busy = [WorkerLoad("a", pending_prefill_blocks=40), WorkerLoad("b")]
    rng = random.Random(0)
    d = pick_worker(req, busy, m, fetch_cfg(), rng)
    # b fetches a's 64 blocks (~11 ms of network and round trips, plus half of a's ~46 ms step
    # against ~61 ms to prefill them) and prefills one
    c = default_costs(16)
    fetch = c.fetch_cost(64, 0, 40)
    assert fetch == pytest.approx((1.0 + 0.5 * (8.0 + 40 * 0.96) + 64 * c.peer_block_ms) / 0.96)
    assert (d.worker_id, d.fetch_source, d.fetch_blocks, d.hit_blocks, d.new_blocks) == ("b", "a", 64, 0, 1)
    assert d.cost == pytest.approx(fetch + 1)
    # without peer fetch b would prefill all 65: a keeps it despite its queue
    d = pick_worker(req, busy, m, RouterConfig(), rng)
    assert (d.worker_id, d.fetch_source, d.new_blocks) == ("a", "", 1)
    # when the holder is idle, its own device hit is cheaper than any fetch
    d = pick_worker(req, [WorkerLoad("a"), WorkerLoad("b")], m, fetch_cfg(), rng)
    assert (d.worker_id, d.fetch_source) == ("a", "")


def test_a_fetch_is_planned_only_where_it_beats_prefill():
    rng = random.Random(0)
    c = default_costs(16)
    req = RouteRequest(num_tokens=100 * 16, block_size=16)
    # b holds 10 blocks, a 10 + n: b fetches the n more if that is cheaper than prefilling them
    for n, fetched in ((1, 0), (4, 0), (8, 8), (60, 60)):
        m = {"a": on_device(10 + n), "b": on_device(10)}
        d = pick_worker(req, [WorkerLoad("b")], m, fetch_cfg(), rng, sources=[WorkerLoad("a"), WorkerLoad("b")])
        assert (d.fetch_blocks > 0) == (c.fetch_cost(n) < n), n  # 1 ms + half a decode step: ~5.3 blocks
        assert d.fetch_blocks == fetched and d.hit_blocks == 10 and d.new_blocks == 100 - 10 - fetched
        assert d.fetch_source == ("a" if fetched else "")
    # a holder in the middle of a long prefill answers after its step: not worth it for 60 blocks
    m = {"a": on_device(70), "b": on_device(10)}
    d = pick_worker(req, [WorkerLoad("b")], m, fetch_cfg(), rng,
                    sources=[WorkerLoad("a", pending_prefill_blocks=600), WorkerLoad("b")])
    assert d.fetch_blocks == 0 and c.fetch_cost(60, 0, 600) > 60
    # holders busy decoding (no prefill queue) answer fast: the deepest one is the source, and
    # sources default to the candidates
    m = {"a": on_device(40), "c": on_device(60)}
    d = pick_worker(req, [WorkerLoad("a", active_blocks=2000), WorkerLoad("b"), WorkerLoad("c", active_blocks=2000)],
                    m, fetch_cfg(), rng)
    assert (d.worker_id, d.fetch_source, d.fetch_blocks) == ("b", "c", 60)


def test_only_blocks_a_peer_surely_holds_are_fetched_and_its_disk_is_slower():
    rng = random.Random(0)
    c = default_costs(16)
    idx = KvIndex()
    idx.load_snapshot("a", 0, {"device": list(range(1, 21)), "disk": list(range(21, 41))})
    idx.predict("a", list(range(41, 61)), ttl=10.0, now=0.0)  # routed there: still being prefilled
    idx.load_snapshot("b", 0, {"host": list(range(1, 6))})
    req = RouteRequest(num_tokens=80 * 16, block_size=16, hashes=tuple(range(1, 81)))
    m = idx.match(req.hashes)
    assert m["a"].depth == 60 and m["a"].fetchable() == 40 and m["b"].depth == 5
    busy_a = [WorkerLoad("a", active_blocks=1000), WorkerLoad("b")]
    d = pick_worker(req, busy_a, m, fetch_cfg(), rng)
    assert (d.worker_id, d.fetch_source, d.hit_blocks, d.fetch_blocks) == ("b", "a", 5, 35)
    own = 5 * c.block_cost(HOST)
    fetch = c.fetch_cost(35, 20)  # 15 from a's device, 20 from its disk (at disk speed)
    assert fetch > c.fetch_cost(35, 0)
    assert d.cost == pytest.approx(own + fetch + 80 - 40)
    assert d.overlap_blocks == pytest.approx(5 - own)


def test_decisions_of_other_modes_report_the_chosen_workers_run():
    req = RouteRequest(num_tokens=16 * 10, block_size=16)
    d = pick_worker(req, loads(a=0, b=0), {"b": on_device(6)}, RouterConfig(mode="round-robin"), random.Random(0), 1)
    assert (d.worker_id, d.hit_blocks, d.new_blocks, d.fetch_source) == ("b", 6, 4, "")


def test_ties_break_at_random_and_softmax_spreads():
    req = RouteRequest(num_tokens=16, block_size=16)
    rng = random.Random(1)
    picks = {pick_worker(req, loads(a=0, b=0, c=0), {}, RouterConfig(), rng).worker_id for _ in range(60)}
    assert picks == {"a", "b", "c"}
    hot = RouterConfig(temperature=1.0)
    picks = [pick_worker(req, loads(a=0, b=1), {}, hot, rng).worker_id for _ in range(400)]
    assert 0.3 < picks.count("b") / len(picks) < 0.5  # cheaper a is likelier, b still chosen
    cold = [pick_worker(req, loads(a=0, b=1), {}, RouterConfig(), rng).worker_id for _ in range(50)]
    assert set(cold) == {"a"}


def test_other_modes():
    req = RouteRequest(num_tokens=16, block_size=16)
    rng = random.Random(0)
    ws = loads(b=3, a=9, c=1)
    rr = [pick_worker(req, ws, {}, RouterConfig(mode="round-robin"), rng, i).worker_id for i in range(6)]
    assert rr == ["a", "b", "c", "a", "b", "c"]
    assert pick_worker(req, ws, {"a": on_device(1)}, RouterConfig(mode="least-loaded"), rng).worker_id == "c"
    seen = {pick_worker(req, ws, {}, RouterConfig(mode="random"), rng).worker_id for _ in range(50)}
    assert seen == {"a", "b", "c"}
    with pytest.raises(ValueError):
        RouterConfig(mode="fastest")
    with pytest.raises(LookupError):
        pick_worker(req, [], {}, RouterConfig(), rng)


class _Cards:
    """Just what ``KvRouter.candidates`` reads of the membership."""

    def __init__(self, cards):
        self._cards = cards

    def cards(self, model=None, role=None):
        return [c for c in self._cards if (model is None or c.model == model) and (role is None or c.role == role)]

    def vouches(self, worker_id, role, model):
        return any((c.worker_id, c.role, c.model) == (worker_id, role, model) for c in self._cards)


async def test_the_router_keeps_nothing_from_ids_the_registry_does_not_vouch_for():
    """Anyone on the bus may claim a worker id: load reports, KV events and other routers'
    decisions count only for decode workers of that model in the registry, and what a worker
    left behind is pruned when it leaves."""
    from mesh.protocol import KvEvent, KvEventBatch, LoadReport, RouterDecision, WorkerCard
    from mesh.router.router import KvRouter

    cards = [WorkerCard("a", "decode", "m", 16, 100, 1024, "h", 1, 0.0, 0.0)]
    router = KvRouter(None, _Cards(cards), RouterConfig())
    for i in range(50):  # self-claimed ids, or a member's id with another model or role
        await router._on_load(LoadReport(f"ghost-{i}", "m", "decode", 0.0), None)
        await router._on_events(KvEventBatch(f"ghost-{i}", f"model-{i}", 1, [KvEvent("stored", [i])]), None)
        await router._on_decision(RouterDecision("other", "m", f"ghost-{i}", f"r{i}", 1, 1, 0.0, "kv", 0.0), None)
    await router._on_load(LoadReport("a", "other-model", "decode", 0.0), None)
    assert router.loads == {} and router.indexes == {} and router.inflight == {} and router.ignored == 101
    await router._on_load(LoadReport("a", "m", "decode", 0.0), None)
    await router._on_decision(RouterDecision("other", "m", "a", "r", 1, 1, 0.0, "kv", 0.0), None)
    assert set(router.loads) == {"a"} and set(router.inflight) == {"a"}
    router._on_member("a", None)  # a left
    assert router.loads == {} and router.inflight == {}


async def test_a_worker_whose_load_reports_stop_gets_no_new_work(monkeypatch):
    import mesh.router.router as router_module
    from mesh.protocol import LoadReport, WorkerCard
    from mesh.router.router import KvRouter

    cards = [WorkerCard(w, "decode", "m", 16, 100, 1024, "h", 1, 0.0, 0.0) for w in ("a", "b", "c")]
    router = KvRouter(None, _Cards(cards), RouterConfig(mode="round-robin"))
    clock = [1000.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: clock[0])
    assert [c.worker_id for c in router.candidates("m")] == ["a", "b", "c"]  # none reported yet: all kept
    for w in ("a", "b", "c"):
        await router._on_load(LoadReport(w, "m", "decode", 0.0), None)
    clock[0] += 2.0
    for w in ("a", "c"):
        await router._on_load(LoadReport(w, "m", "decode", 0.0), None)
    assert [c.worker_id for c in router.candidates("m")] == ["a", "b", "c"]
    clock[0] += 2.0  # b silent for 4 s (killed; its card is still there)
    assert [c.worker_id for c in router.candidates("m")] == ["a", "c"]
    assert {router.route("m", list(range(40))).worker_id for _ in range(6)} == {"a", "c"}
    await router._on_load(LoadReport("b", "m", "decode", 0.0), None)  # b is back
    router.suspect("c")  # a request found nobody on c's subject: c waits for its next report
    assert [c.worker_id for c in router.candidates("m")] == ["a", "b"]
    await router._on_load(LoadReport("c", "m", "decode", 0.0), None)
    assert [c.worker_id for c in router.candidates("m")] == ["a", "b", "c"]
    clock[0] += 10.0  # everyone silent (the bus was down): nobody is excluded
    assert [c.worker_id for c in router.candidates("m")] == ["a", "b", "c"]


async def test_lora_requests_go_where_the_adapter_is_hot_and_its_prefix_cached():
    from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
    from mesh.protocol import LoadReport, WorkerCard
    from mesh.router.router import KvRouter

    cards = [WorkerCard(w, "decode", "m", 16, 100, 1024, "h", 1, 0.0, 0.0, adapters=held)
             for w, held in (("a", []), ("b", ["x"]), ("c", ["x"]))]
    router = KvRouter(None, _Cards(cards), RouterConfig())
    for w in "abc":  # x sits in one of c's device slots
        await router._on_load(LoadReport(w, "m", "decode", 0.0, hot_adapters=["x"] if w == "c" else []), None)
    one, two = list(range(160)), list(range(1000, 1160))  # 10 blocks each
    d = router.route("m", one, "r1", adapter="x")  # a does not hold x; b would copy x into a slot
    assert d.worker_id == "c" and d.cost == 10
    router.finished("c", "r1")
    # b caches 8 blocks of ``two`` under x, c the same tokens under the base model: b wins (2 + 4 < 10)
    idx = router.index("m")
    idx.predict("b", block_hashes(two, 16, hash_seed(DEFAULT_HASH_KEY, "m", lora="x"))[:8], 60.0)
    idx.predict("c", block_hashes(two, 16, hash_seed(DEFAULT_HASH_KEY, "m")), 60.0)
    d = router.route("m", two, "r2", adapter="x")
    assert (d.worker_id, d.overlap_blocks, d.cost) == ("b", 8.0, 2 + RouterConfig().adapter_cost)
    assert router.route("m", two, "r3").worker_id == "c"  # the base model's prefix is c's
    with pytest.raises(LookupError, match="'y'"):
        router.route("m", one, adapter="y")


async def test_the_router_plans_a_fetch_from_a_worker_it_may_not_send_to():
    from mesh.protocol import LoadReport, WorkerCard
    from mesh.router.router import KvRouter

    slow_net = KvCosts.from_rates(16, network_gb_per_s=0.1).to_dict()  # 21 ms per block: never worth it
    def card(w, **kw):
        return WorkerCard(w, "decode", "m", 16, 1000, 1 << 16, "h", 1, 0.0, 0.0, serves_kv_fetch=True,
                          fetches_kv=True, **kw)

    cards = [card("a"), card("b"), card("c", kv_costs=slow_net), card("d")]
    cards[3].fetches_kv = False  # a worker that does not fetch (a model worker, before phase B)
    router = KvRouter(None, _Cards(cards), RouterConfig(peer_fetch=True))
    tokens = list(range(1000, 1000 + 16 * 30 + 1))
    from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed

    hashes = block_hashes(tokens, 16, hash_seed(DEFAULT_HASH_KEY, "m"))
    idx = router.index("m")
    idx.load_snapshot("a", 0, {"device": hashes})
    for w in ("b", "c", "d"):
        idx.load_snapshot(w, 0, {})
        await router._on_load(LoadReport(w, "m", "decode", 0.0), None)
    await router._on_load(LoadReport("a", "m", "decode", 0.0), None)
    d = router.route("m", tokens, "r1", exclude={"a", "c", "d"})  # a failed to serve it; it can still send blocks
    assert (d.worker_id, d.fetch_source, d.fetch_blocks) == ("b", "a", 30)
    assert router.fetches == 1
    d = router.route("m", tokens, "r2", exclude={"a", "b", "d"})  # c's own network is too slow to fetch
    assert (d.worker_id, d.fetch_source, d.new_blocks) == ("c", "", 31)
    d = router.route("m", tokens, "r3", exclude={"a", "b", "c"})  # d does not fetch
    assert (d.worker_id, d.fetch_source, d.new_blocks) == ("d", "", 31)
    cards[0].serves_kv_fetch = False  # nor does anyone fetch from a worker that does not serve
    d = router.route("m", tokens, "r4", exclude={"a", "c", "d"})
    assert (d.worker_id, d.fetch_source) == ("b", "")


LATENT_BLOCK = 61 * 576 * 2 * 16  # DeepSeek-V3: one latent vector (512 + 64 rope) per token and layer, bf16
LLAMA_70B_BLOCK = 80 * 2 * 8 * 128 * 2 * 16  # K and V of 8 heads of 128 per token and layer, bf16


async def test_a_block_costs_what_the_workers_model_caches_per_block():
    """The card's ``kv_block_bytes`` sizes the reference's onboarding and fetch costs: a latent
    (MLA) block moves ~4.7x cheaper than a Llama-3-70B one, and the router's plan says so."""
    from mesh.protocol import LoadReport, WorkerCard
    from mesh.router.router import KvRouter

    latent, big = default_costs(16, LATENT_BLOCK), default_costs(16, LLAMA_70B_BLOCK)
    assert latent.peer_block_ms == pytest.approx(LATENT_BLOCK / 12.5e9 * 1000)
    assert big.host_block_ms / latent.host_block_ms == pytest.approx(LLAMA_70B_BLOCK / LATENT_BLOCK)
    assert big.prefill_block_ms == latent.prefill_block_ms == default_costs(16).prefill_block_ms
    assert default_costs(16, 0) == default_costs(16)  # unknown: the reference model's block
    assert KvCosts.from_dict({}, 16, LATENT_BLOCK) == latent
    assert KvCosts.from_dict({"peer_block_ms": 0.5}, 16, LATENT_BLOCK).host_block_ms == latent.host_block_ms

    def card(w, block_bytes=0):
        return WorkerCard(w, "decode", "m", 16, 1000, 1 << 16, "h", 1, 0.0, 0.0, serves_kv_fetch=True,
                          fetches_kv=True, kv_block_bytes=block_bytes)

    cards = [card("a"), card("mla", LATENT_BLOCK), card("70b", LLAMA_70B_BLOCK)]
    router = KvRouter(None, _Cards(cards), RouterConfig(peer_fetch=True))
    from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed

    tokens = list(range(1000, 1000 + 16 * 30 + 1))
    idx = router.index("m")
    idx.load_snapshot("a", 0, {"device": block_hashes(tokens, 16, hash_seed(DEFAULT_HASH_KEY, "m"))})
    for c in cards:
        if c.worker_id != "a":
            idx.load_snapshot(c.worker_id, 0, {})
        await router._on_load(LoadReport(c.worker_id, "m", "decode", 0.0), None)
    via_mla = router.route("m", tokens, "r1", exclude={"a", "70b"})
    via_70b = router.route("m", tokens, "r2", exclude={"a", "mla"})
    assert (via_mla.fetch_source, via_mla.fetch_blocks) == (via_70b.fetch_source, via_70b.fetch_blocks) == ("a", 30)
    assert via_mla.cost < via_70b.cost
    assert via_70b.cost - via_mla.cost == pytest.approx(30 * (big.peer_block_ms - latent.peer_block_ms)
                                                       / latent.prefill_block_ms, rel=1e-3)


def test_a_workers_inflight_sums_are_those_of_its_requests_through_any_sequence_of_events():
    """The router keeps each worker's in-flight prompt and prefill blocks as running sums: after
    every add, first token, finish, re-route and pruning they equal the sums over what is left."""
    from mesh.router.router import _Inflight, _InflightQueue

    rng = random.Random(7)
    q, model, t = _InflightQueue(), {}, 0.0
    for _ in range(5000):
        op = rng.random()
        rid = f"r{rng.randrange(60)}"
        if op < 0.45:
            t += rng.random()
            d = _Inflight(t, rng.randrange(1, 40), rng.randrange(0, 40))
            q.add(rid, d)
            model[rid] = d  # a re-route of the same request replaces it, in place
        elif op < 0.65:
            q.prefilled(rid)
            if rid in model:
                model[rid].new_blocks = 0
        elif op < 0.85:
            q.pop(rid)
            model.pop(rid, None)
        else:
            cut = t - rng.random() * 10
            q.drop_before(cut)
            for k in list(model):  # the oldest first, up to the first at or after the cut
                if model[k].timestamp >= cut:
                    break
                del model[k]
        assert list(q.items) == list(model)
        assert q.prompt_blocks == sum(d.prompt_blocks for d in model.values())
        assert q.new_blocks == sum(d.new_blocks for d in model.values())


async def test_a_process_messages_leave_the_router_as_its_workers_alone_would():
    """A process's load reports and KV event batches together (``mesh.loads``, ``mesh.kvevents.
    KvBatcher``) are taken one by one, as if alone: the same loads, table rows and index, the same
    refusals of ids the registry does not vouch for, and a gap still resyncs only its worker."""
    from mesh.protocol import KvEvent, KvEventBatch, KvEventBatches, LoadReport, WorkerCard
    from mesh.router.router import KvRouter
    from mesh.router.table import LoadSummaries, LoadSummary

    workers = ["a", "b", "c"]
    cards = [WorkerCard(w, "decode", "m", 16, 100, 1024, "h", 1, 0.0, 0.0) for w in workers]
    reports = [LoadReport(w, "m", "decode", 0.0, running=i + 1, kv_blocks_used=10 * i) for i, w in enumerate(workers)]
    reports.append(LoadReport("ghost", "m", "decode", 0.0, running=9))
    batches = [KvEventBatch(w, "m", 1, [KvEvent("stored", [100 * i + j for j in range(3)])])
               for i, w in enumerate([*workers, "ghost"])]
    routers = [KvRouter(None, _Cards(cards), RouterConfig()) for _ in range(2)]
    for r in routers:
        for w in workers:
            r.index("m").load_snapshot(w, 0, {})  # known from their start
    alone, together = routers
    for report, b in zip(reports, batches, strict=True):
        await alone._on_load(msgspec.convert(msgspec.to_builtins(report), LoadSummary), None)
        await alone._on_events(b, None)
    summaries = [msgspec.convert(msgspec.to_builtins(r), LoadSummary) for r in reports]
    await together._on_loads(LoadSummaries(summaries), None)
    await together._on_batches(KvEventBatches(batches), None)
    for r in routers:
        assert sorted(r.loads) == workers and r.ignored == 2
        assert [r.index("m").num_blocks(w) for w in workers] == [3, 3, 3]
    rows = [alone.slots.get(w) for w in workers]
    assert rows == [together.slots.get(w) for w in workers]
    for name in ("active", "pending_tokens", "pending_blocks", "others"):
        assert list(getattr(alone.table, name)[rows]) == list(getattr(together.table, name)[rows]), name
    # a gap for b (seq 3 after 1): only b waits for a snapshot; a's next batch is applied
    spawned = []
    together._spawn = lambda coro: spawned.append(coro) or coro.close()
    await together._on_batches(KvEventBatches([KvEventBatch("b", "m", 3, [KvEvent("stored", [7])]),
                                               KvEventBatch("a", "m", 2, [KvEvent("stored", [8])])]), None)
    assert len(spawned) == 1 and together.index("m").num_blocks("a") == 4 and together.index("m").num_blocks("b") == 3
