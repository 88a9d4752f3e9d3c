"""The router's index and policy, without NATS."""

from __future__ import annotations

import random

import pytest

from kvstore.events import BlockRemoved, BlockStored, to_wire
from mesh.protocol import KvEvent, KvEventBatch
from mesh.router.index import KvIndex
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
    idx.load_snapshot("a", 0, {"device": [1, 2, 3]})
    # block 2 is copied to host, then dropped from device: credited 0.75
    assert idx.apply(batch("a", 1, stored([2], 1, "host"), removed([2], "device")))
    assert idx.tiers_of("a", 2) == {"host"}
    assert idx.overlap([1, 2, 3]) == {"a": pytest.approx(2.75)}
    assert idx.apply(batch("a", 2, stored([3], 2, "disk"), removed([3], "device")))
    assert idx.overlap([1, 2, 3]) == {"a": pytest.approx(2.0)}
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


def test_kv_cost_prefers_the_cached_worker_unless_it_is_much_busier():
    req = RouteRequest(num_tokens=160, block_size=16)  # 10 blocks
    cfg = RouterConfig()
    rng = random.Random(0)
    d = pick_worker(req, loads(a=5, b=5), {"a": 8.0}, cfg, rng)
    assert d.worker_id == "a" and d.new_blocks == 2 and d.overlap_blocks == 8.0
    costs = kv_costs(req, loads(a=5, b=5), {"a": 8.0}, cfg)
    assert costs == {"a": 2 + 0.5, "b": 10 + 0.5}
    # a held block costs a tenth of a block to prefill: 20 more active blocks on a do not outweigh
    # its 8 cached ones, 200 more do
    assert pick_worker(req, loads(a=25, b=5), {"a": 8.0}, cfg, rng).worker_id == "a"
    assert pick_worker(req, loads(a=205, b=5), {"a": 8.0}, cfg, rng).worker_id == "b"
    assert pick_worker(req, loads(a=25, b=5), {"a": 8.0}, RouterConfig(decode_weight=1.0), rng).worker_id == "b"
    # pending prefill counts as prefill work
    busy = [WorkerLoad("a", 5, pending_prefill_blocks=30), WorkerLoad("b", 5)]
    assert pick_worker(req, busy, {"a": 8.0}, cfg, rng).worker_id == "b"


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
    assert pick_worker(req, ws, {"a": 1}, RouterConfig(mode="least-loaded"), rng).worker_id == "c"
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
    from mesh.hashing import block_hashes, model_seed
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
    idx.predict("b", block_hashes(two, 16, model_seed("m", lora="x"))[:8], 60.0)
    idx.predict("c", block_hashes(two, 16, model_seed("m")), 60.0)
    d = router.route("m", two, "r2", adapter="x")
    assert (d.worker_id, d.overlap_blocks, d.cost) == ("b", 8.0, 2 + RouterConfig().adapter_cost)
    assert router.route("m", two, "r3").worker_id == "c"  # the base model's prefix is c's
    with pytest.raises(LookupError, match="'y'"):
        router.route("m", one, adapter="y")
