"""The router's decision over every worker at once (``mesh.router.table``) against ``pick_worker``
over a ``WorkerLoad`` per worker: the same choice, cost and credit, random tie-breaks included, and
the index's masks against a plain model of who holds what."""

from __future__ import annotations

import random

from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from mesh.protocol import KvEvent, KvEventBatch, LoadReport, WorkerCard
from mesh.router.costs import DEVICE, DISK, HOST
from mesh.router.index import KvIndex, PrefixMatch, Slots
from mesh.router.policy import RouterConfig, RouteRequest, pick_worker
from mesh.router.router import KvRouter


class Cards:
    """What the router reads of the registry, with a version as ``Membership`` keeps one."""

    def __init__(self, cards):
        self._cards = {c.worker_id: c for c in cards}
        self.version = 1

    def cards(self, model=None, role=None):
        return [c for c in self._cards.values() if (model is None or c.model == model) and (role is None or c.role == role)]

    cards_of = cards

    def get(self, worker_id):
        return self._cards.get(worker_id)

    def vouches(self, worker_id, role, model):
        c = self._cards.get(worker_id)
        return c is not None and (c.role, c.model) == (role, model)

    def leave(self, worker_id):
        del self._cards[worker_id]
        self.version += 1


def card(w: str, **kw) -> WorkerCard:
    return WorkerCard(w, "decode", "m", 16, 4096, 1 << 16, "h", 1, 0.0, 0.0, **kw)


def frozen_clock(monkeypatch) -> None:
    """A clock that stands still: a worker's last load report never ages past SILENT_AFTER while a
    slow (loaded) machine runs the test, so both paths see the same live workers."""
    import mesh.router.router as router_module

    now = router_module.time.monotonic()
    monkeypatch.setattr(router_module.time, "monotonic", lambda: now)


async def test_the_decision_over_all_workers_is_pick_workers_decision(monkeypatch):
    frozen_clock(monkeypatch)
    rng = random.Random(11)
    seed = hash_seed(DEFAULT_HASH_KEY, "m")
    system = [rng.randrange(32000) for _ in range(16 * 12)]
    for trial in range(40):
        n = rng.choice([1, 3, 10, 70, 200])
        ids = [f"w{i:03d}" for i in range(n)]
        cards = Cards([card(w, status="ready" if rng.random() > 0.1 else "draining",
                            capacity=rng.choice([0, 1, 2, 2, 3, 64])) for w in ids])
        router = KvRouter(None, cards, RouterConfig(decode_weight=rng.choice([0.1, 0.1, 0.37])))
        router._spawn = lambda coro: coro.close()
        idx = router.index("m")
        convs = {}
        others = {w: rng.choice([0, 0, 1, 2]) for w in ids}  # other routers' sequences, from the reports
        opened = {w: set() for w in ids}  # what this test routed and did not end: a plain model of the slots
        for w in ids:
            await router._on_load(LoadReport(w, "m", "decode", 0.0, kv_blocks_used=rng.choice([0, 0, 5, 40]),
                                             pending_prefill_tokens=rng.choice([0, 0, 17, 160]),
                                             running=others[w]), None)
            idx.load_snapshot(w, 0, {})
            events = []
            if rng.random() < 0.6:  # the system prompt, on some tier
                events.append(KvEvent("stored", block_hashes(system, 16, seed), None, rng.choice(["device"] * 4 + ["host"])))
            conv = system + [rng.randrange(32000) for _ in range(16 * rng.randrange(1, 8))]
            convs[w] = conv
            hashes = block_hashes(conv, 16, seed)
            events.append(KvEvent("stored", hashes, None))
            if rng.random() < 0.3:  # part of it offloaded to disk
                cut = hashes[len(hashes) // 2:]
                events += [KvEvent("stored", cut, None, "disk"), KvEvent("removed", cut, None, "device")]
            assert idx.apply(KvEventBatch(w, "m", 1, events))
        for i in range(6):  # a few requests in flight, some past their prefill
            w = rng.choice(ids)
            router._count(w, f"x{i}", _inflight(rng))
            if rng.random() < 0.5:
                router.first_token(w, f"x{i}")
        if rng.random() < 0.3 and n > 1:
            router.suspect(rng.choice(ids))  # silent: no new work
        for k in range(8):
            kind = rng.random()
            if kind < 0.4:
                tokens = rng.choice(list(convs.values())) + [rng.randrange(32000) for _ in range(rng.randrange(1, 40))]
            elif kind < 0.7:
                tokens = system + [rng.randrange(32000) for _ in range(rng.randrange(1, 100))]
            else:
                tokens = [rng.randrange(32000) for _ in range(rng.randrange(1, 200))]
            exclude = set(rng.sample(ids, min(len(ids) - 1, rng.randrange(0, 3))))
            expect = _slow_decision(router, tokens, exclude, trial * 100 + k)
            router.rng = random.Random(trial * 100 + k)
            try:
                got = router.route("m", tokens, f"t{trial}-{k}", exclude=exclude)
            except LookupError:
                assert expect is None
                continue
            assert expect is not None
            assert (got.worker_id, got.new_blocks, got.hit_blocks) == (expect.worker_id, expect.new_blocks,
                                                                       expect.hit_blocks), (trial, k)
            assert abs(got.cost - expect.cost) < 1e-9 and abs(got.overlap_blocks - expect.overlap_blocks) < 1e-9
            seqs = {w: others[w] + len(opened[w]) for w in ids}
            capacity = {c.worker_id: c.capacity for c in cards.cards()}
            roomy = [c.worker_id for c in router.candidates("m") if c.worker_id not in exclude
                     and (not capacity[c.worker_id] or seqs[c.worker_id] < capacity[c.worker_id])]
            assert not roomy or got.worker_id in roomy, (trial, k)  # no wait for a slot while one is free
            opened[got.worker_id].add(f"t{trial}-{k}")
            if rng.random() < 0.4:  # some end, the others hold their slots
                w = rng.choice(ids)
                if opened[w]:
                    rid = opened[w].pop()
                    router.finished(w, rid)


def _inflight(rng):
    from mesh.router.router import _Inflight

    return _Inflight(0.0, rng.randrange(1, 20), rng.randrange(0, 20))


def _slow_decision(router: KvRouter, tokens, exclude, seed):
    """What ``route`` decided before (issue 51): a WorkerLoad per live worker, then ``pick_worker``."""
    live = router.candidates("m")
    cards = router._with_room([c for c in live if c.worker_id not in exclude])  # the sequence limit (its own test)
    if not cards:
        return None
    hashes = block_hashes(tokens, 16, hash_seed(DEFAULT_HASH_KEY, "m"))
    idx = router.index("m")
    idx.expire()
    matches = idx.match(hashes)
    workers = [router._load_of(c, 0.0) for c in cards]
    return pick_worker(RouteRequest(len(tokens), 16, tuple(hashes)), workers, matches, router.config,
                       random.Random(seed))


def test_the_index_masks_agree_with_a_plain_model_of_who_holds_what():
    rng = random.Random(5)
    idx = KvIndex(slots=Slots())
    held: dict[str, dict[int, int]] = {}  # worker -> hash -> tier bits
    tiers = {"device": DEVICE, "host": HOST, "disk": DISK}
    workers = [f"w{i}" for i in range(40)]
    seqs = dict.fromkeys(workers, 0)
    for w in workers:
        idx.load_snapshot(w, 0, {})
    for _ in range(3000):
        w = rng.choice(workers)
        hashes = rng.sample(range(60), rng.randrange(1, 6))
        tier = rng.choice(list(tiers))
        kind = rng.choice(["stored", "stored", "removed"])
        if rng.random() < 0.01:
            kind, hashes = "cleared", []
        seqs[w] += 1
        assert idx.apply(KvEventBatch(w, "m", seqs[w], [KvEvent(kind, hashes, None, tier)]))
        mine = held.setdefault(w, {})
        if kind == "cleared":
            mine.clear()
        for h in hashes:
            bits = mine.get(h, 0)
            bits = bits | tiers[tier] if kind == "stored" else bits & ~tiers[tier]
            if bits:
                mine[h] = bits
            else:
                mine.pop(h, None)
        if rng.random() < 0.02:  # a worker leaves and comes back empty
            gone = rng.choice(workers)
            idx.drop_worker(gone)
            held.pop(gone, None)
            idx.load_snapshot(gone, seqs[gone], {})
    for _ in range(300):
        query = [rng.randrange(60) for _ in range(rng.randrange(1, 8))]
        expect = {}
        for w, mine in held.items():
            n = 0
            while n < len(query) and query[n] in mine:
                n += 1
            if n:
                below = tuple((p, mine[query[p]]) for p in range(n) if not mine[query[p]] & DEVICE)
                expect[w] = PrefixMatch(n, below)
        assert idx.match(query) == expect
    for w, mine in held.items():
        assert idx.num_blocks(w) == len(mine)
        for h, bits in mine.items():
            assert idx.tiers_of(w, h) == {t for t, b in tiers.items() if bits & b}


async def test_a_worker_that_leaves_gives_back_its_slot_and_leaves_nothing_behind():
    cards = Cards([card("a"), card("b")])
    router = KvRouter(None, cards, RouterConfig())
    router._spawn = lambda coro: coro.close()
    idx = router.index("m")
    for w in ("a", "b"):
        router._on_member(w, cards.get(w))
        idx.load_snapshot(w, 0, {"device": [1, 2, 3]})
    assert router.route("m", list(range(64)), "r").worker_id in ("a", "b")
    slot_a = router.slots.get("a")
    cards.leave("a")
    router._on_member("a", None)
    assert router.slots.get("a") is None and idx.match([1, 2, 3]) == {"b": PrefixMatch(3)}
    assert {router.route("m", list(range(64)), f"r{i}").worker_id for i in range(5)} == {"b"}
    cards._cards["c"] = card("c")
    cards.version += 1
    router._on_member("c", cards.get("c"))
    assert router.slots.slot("c") == slot_a  # reused, and empty
    assert idx.match([1, 2, 3]) == {"b": PrefixMatch(3)}


async def test_at_1000_workers_with_many_blocks_the_router_still_picks_the_holder_and_the_idlest(monkeypatch):
    """1,000 workers, each caching a system prompt they all share and a conversation of its own
    (~100,000 blocks indexed): a continued conversation goes to the worker holding it, a prompt
    sharing only the system prompt to the least busy of all, and every decision is ``pick_worker``'s."""
    frozen_clock(monkeypatch)
    rng = random.Random(3)
    seed = hash_seed(DEFAULT_HASH_KEY, "m")
    ids = [f"w{i:04d}" for i in range(1000)]
    cards = Cards([card(w) for w in ids])
    router = KvRouter(None, cards, RouterConfig())
    router._spawn = lambda coro: coro.close()
    idx = router.index("m")
    system = [rng.randrange(32000) for _ in range(16 * 32)]
    shared = block_hashes(system, 16, seed)
    convs = {}
    for i, w in enumerate(ids):
        conv = system + [rng.randrange(32000) for _ in range(16 * 64)]
        convs[w] = conv
        idx.load_snapshot(w, 0, {"device": block_hashes(conv, 16, seed)})
        await router._on_load(LoadReport(w, "m", "decode", 0.0, kv_blocks_used=100 + (i * 7919) % 500), None)  # busier by < 64 blocks of prefill
    assert sum(idx.num_blocks(w) for w in ids) == 1000 * 96
    assert idx.match(shared + [1])["w0500"].depth == 32  # everyone holds the system prompt
    least = min(router.loads[w].kv_blocks_used for w in ids)
    idlest = {w for w in ids if router.loads[w].kv_blocks_used == least}
    for k in range(20):
        w = rng.choice(ids)
        tokens = convs[w] + [rng.randrange(32000) for _ in range(40)]
        expect = _slow_decision(router, tokens, set(), k)
        router.rng = random.Random(k)
        d = router.route("m", tokens, f"c{k}")
        assert (d.worker_id, d.hit_blocks) == (expect.worker_id, expect.hit_blocks) == (w, 96)
        router.finished(w, f"c{k}")
        tokens = system + [rng.randrange(32000) for _ in range(16 * 20)]
        expect = _slow_decision(router, tokens, set(), 100 + k)
        router.rng = random.Random(100 + k)
        d = router.route("m", tokens, f"s{k}")
        assert (d.worker_id, d.hit_blocks, d.cost) == (expect.worker_id, expect.hit_blocks, expect.cost)
        assert d.worker_id in idlest and d.hit_blocks == 32
        router.finished(d.worker_id, f"s{k}")


async def test_a_worker_at_its_sequence_limit_is_passed_over_while_another_has_room(monkeypatch):
    """A full worker (the requests routed to it that have not ended, plus what its last report showed
    beyond those: other routers' requests, at its card's capacity) would queue a request for a whole
    generation: the prefix's holder is passed over while another worker has a free slot, on both
    decision paths; when all are full, the one with the fewest queued is taken, and among equals the
    usual choice stands."""
    frozen_clock(monkeypatch)
    seed = hash_seed(DEFAULT_HASH_KEY, "m")
    prompt = [random.Random(3).randrange(32000) for _ in range(16 * 6)]
    for config in (RouterConfig(), RouterConfig(temperature=1e-9)):  # pick_kv; pick_worker
        router = KvRouter(None, Cards([card("a", capacity=2), card("b", capacity=2)]), config)
        router._spawn = lambda coro: coro.close()
        idx = router.index("m")
        for w in ("a", "b"):
            idx.load_snapshot(w, 0, {})
        assert idx.apply(KvEventBatch("a", "m", 1, [KvEvent("stored", block_hashes(prompt, 16, seed), None)]))

        async def report(w, running, router=router):
            await router._on_load(LoadReport(w, "m", "decode", 0.0, running=running), None)

        def route(rid, router=router):
            return router.route("m", prompt, rid).worker_id

        await report("a", 0)
        await report("b", 0)
        assert [route("r1"), route("r2"), route("r3")] == ["a", "a", "b"]  # the holder until it is full
        await report("a", 0)  # r1 and r2 still on their way: they count all the same
        assert route("r4") == "b"
        assert route("r5") == "a"  # both full, none queued: the prefix decides
        assert route("r6") == "b"  # a has one queued, b none
        router.finished("a", "r1")
        router.finished("a", "r1")  # ended once: a second word of it changes nothing
        router.finished("b", "nobody")
        assert route("r7") == "a"  # a: r2 and r5, none queued; b: one
        for w, done in (("a", ("r2", "r5", "r7")), ("b", ("r3", "r4", "r6"))):
            for rid in done:
                router.finished(w, rid)
        assert router.open == {"a": set(), "b": set()}
        await report("a", 2)  # another router's two requests: a is full
        assert route("r8") == "b"
        await report("a", 1)
        assert route("r9") == "a"
        assert router.open == {"a": {"r9"}, "b": {"r8"}}
