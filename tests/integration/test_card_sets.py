"""A process's cards under its set keys (``mesh.cardset``) on a real nats-server: every view sees each
worker as its own card, refreshes are not decoded, a worker that stops or changes is heard alone,
a worker moving between parts never looks gone, and a process that dies leaves every view within
the TTL, all its workers together."""

from __future__ import annotations

import asyncio
import time

import msgspec

from mesh.bus import Bus
from mesh.cardset import CardSet
from mesh.protocol import WorkerCard
from mesh.registry import CardPublisher, Membership

STARTED = time.time()


def card(wid: str, role: str = "decode", status: str = "ready", adapters: list[str] | None = None) -> WorkerCard:
    return WorkerCard(wid, role, "m", 16, 100, 1024, "h", 1, STARTED, STARTED, status=status,
                      adapters=adapters or [])


async def until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def set_puts(bus: Bus, seconds: float) -> dict[str, int]:
    """Puts a second on the registry's subjects, by key, over ``seconds``."""
    seen: dict[str, int] = {}
    prefix = f"$KV.{bus.subjects.workers_bucket()}."

    async def count(msg) -> None:
        key = msg.subject[len(prefix):]
        seen[key] = seen.get(key, 0) + 1

    sub = await bus.nc.subscribe(prefix + ">", cb=count)
    await asyncio.sleep(seconds)
    await sub.unsubscribe()
    return seen


async def test_a_process_cards_are_seen_one_by_one_and_refreshed_as_a_few_keys(nats_server, monkeypatch):
    import mesh.registry as registry

    bus = await Bus.connect(nats_server.url, "sets", ns="sets")
    host = await Bus.connect(nats_server.url, "sets-host", ns="sets")
    status = {f"w{i}": "ready" for i in range(10)}
    cards = CardSet(host, "proc-a", ttl=1.5, max_cards=4)  # refreshes every 0.5 s; 3 parts for 10 workers
    await cards.start()
    pubs = [cards.member(lambda w=w: card(w, status=status[w])) for w in status]
    await asyncio.gather(*(p.start() for p in pubs[:6]))  # before the view: its replay reads them
    view = Membership(bus, ttl=1.5)
    prefill_view = Membership(bus, ttl=1.5, role="prefill")  # a view of the other role sees none of them
    heard = []
    view.on_change(lambda wid, c: heard.append((wid, None if c is None else c.status)))
    decoded = []
    real = registry.decode
    monkeypatch.setattr(registry, "decode", lambda data, t: decoded.append(t.__name__) or real(data, t))
    try:
        await view.start(wait=5.0)
        await prefill_view.start(wait=1.0)
        assert sorted(c.worker_id for c in view.cards()) == [f"w{i}" for i in range(6)]
        await asyncio.gather(*(p.start() for p in pubs[6:]))  # joins after the replay
        await until(lambda: len(view.cards()) == 10)
        assert all(view.vouches(w, "decode", "m") for w in status)
        puts = await set_puts(bus, 1.6)  # three refresh periods
        assert sorted(puts) == ["decode.set.proc-a-0", "decode.set.proc-a-1", "decode.set.proc-a-2"]
        assert max(puts.values()) <= 4, puts  # each part once a refresh, not once a worker
        first, n = view.get("w0").updated, len(decoded)
        await until(lambda: view.get("w0").updated > first + 0.9)  # refreshed twice...
        assert len(decoded) == n  # ...and no card decoded
        assert heard.count(("w0", "ready")) == 1  # a refresh is no news
        status["w5"] = "draining"
        await pubs[5].put()  # a worker's card changed (a drain): its part put now
        await until(lambda: view.get("w5").status == "draining")
        await pubs[2].stop()  # a worker leaves: only it is heard leaving
        await until(lambda: view.get("w2") is None)
        assert [h for h in heard if h[1] in (None, "draining")] == [("w5", "draining"), ("w2", None)]
        assert prefill_view.cards() == []
        assert cards.age() < 1.5
        # the process dies: no delete, its refreshes stop; every worker leaves within the TTL. A
        # worker of its own keeps refreshing (were every card silent, the view would take it for a
        # stalled registry and expire none: Membership._check_stall)
        keep = CardPublisher(bus, lambda: card("keep"), ttl=1.5)
        await keep.start()
        await until(lambda: view.get("keep") is not None)
        cards._task.cancel()
        t0 = time.monotonic()
        await until(lambda: [c.worker_id for c in view.cards()] == ["keep"], timeout=5.0)
        assert time.monotonic() - t0 < 1.5 + 1.2  # the TTL, and a sweep's period
        await keep.stop()
    finally:
        for p in pubs:
            await p.stop()
        await cards.stop()
        await view.stop()
        await prefill_view.stop()
        await host.close()
        await bus.close()


async def test_a_card_outgrowing_its_part_moves_without_looking_gone_and_the_last_out_deletes_it(nats_server):
    import mesh.cardset as cardset

    bus = await Bus.connect(nats_server.url, "sets-move", ns="move")
    host = await Bus.connect(nats_server.url, "sets-move-host", ns="move")
    adapters: dict[str, list[str]] = {"a": [], "b": [], "c": []}
    cards = CardSet(host, "proc-b", ttl=3.0)
    await cards.start()
    pubs = {w: cards.member(lambda w=w: card(w, adapters=adapters[w])) for w in adapters}
    for p in pubs.values():
        await p.start()
    view = Membership(bus, ttl=3.0)
    heard = []
    view.on_change(lambda wid, c: heard.append((wid, None if c is None else len(c.adapters))))
    try:
        await view.start(wait=5.0)
        assert cards._part_of == {w: ("decode", 0) for w in adapters}
        # "b" loads adapters until the three no longer fit one part: it moves to part 1
        one = len(msgspec.msgpack.encode(card("x")))
        many = [f"adapter-{i:05d}" for i in range((cardset.MAX_PART_BYTES - one * 3 // 2) // 14)]
        adapters["b"] = many
        await pubs["b"].put()
        assert cards._part_of["b"] == ("decode", 1)
        await until(lambda: len(view.get("b").adapters) == len(many))
        await asyncio.sleep(0.3)
        assert ("b", None) not in heard  # never looked gone between the two puts
        assert view.get("a") is not None and view.get("c") is not None
        for w in ("a", "c"):  # its part's last one out deletes that key
            await pubs[w].stop()
        await until(lambda: view.get("a") is None and view.get("c") is None)
        keys = await (await host.js.key_value(host.subjects.workers_bucket())).keys()
        assert keys == ["decode.set.proc-b-1"]
        assert view.get("b") is not None
    finally:
        for p in pubs.values():
            await p.stop()
        await cards.stop()
        await view.stop()
        await host.close()
        await bus.close()
