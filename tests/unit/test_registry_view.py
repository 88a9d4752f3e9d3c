"""The registry view (``mesh.registry.Membership``) fed entries as its KV watch delivers them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import msgspec

from mesh.protocol import WorkerCard, encode
from mesh.registry import Membership


@dataclass
class Entry:
    key: str
    value: bytes
    operation: str = "PUT"


async def entries(*items):
    for item in items:
        yield item


def card(wid: str, role: str = "decode", **kw) -> WorkerCard:
    now = time.time()
    return WorkerCard(wid, role, "m", 16, 100, 1024, "h", 1, now, now, **kw)


def refreshed(c: WorkerCard, **kw) -> WorkerCard:
    return msgspec.structs.replace(c, updated=c.updated + 1.0, **kw)


async def test_listeners_hear_joins_changes_and_leaves_but_not_refreshes():
    m = Membership(bus=None)
    heard = []
    m.on_change(lambda wid, c: heard.append((wid, None if c is None else c.status)))
    a, b = card("a"), card("b", role="prefill")
    await m._watch(entries(Entry("a", encode(a)), Entry("b", encode(b)), Entry("a", encode(refreshed(a))),
                           Entry("a", encode(refreshed(a, status="draining"))), Entry("b", b"", "DEL")))
    assert heard == [("a", "ready"), ("b", "ready"), ("a", "draining"), ("b", None)]
    assert m.get("a").status == "draining" and m.get("b") is None


async def test_a_cached_view_is_rebuilt_only_when_the_membership_changes():
    m = Membership(bus=None)
    a, b = card("a"), card("b")
    await m._watch(entries(Entry("a", encode(a)), Entry("b", encode(b))))
    view = m.cards_of("m", "decode")
    assert [c.worker_id for c in view] == ["a", "b"]
    await m._watch(entries(Entry("a", encode(refreshed(a)))))
    assert m.cards_of("m", "decode") is view  # a refresh changes nothing a view holds
    assert m.get("a").updated == a.updated + 1.0  # though the card itself is the newest
    await m._watch(entries(Entry("c", encode(card("c"))), Entry("a", b"", "DEL")))
    assert [c.worker_id for c in m.cards_of("m", "decode")] == ["b", "c"]
    assert m.cards_of("m", "prefill") == [] and m.cards("m", "decode") == m.cards_of("m", "decode")


async def test_a_view_that_reads_the_registry_late_expires_nobody_until_it_catches_up(monkeypatch):
    """The cards this process reads are all older than a refresh period: it is behind (its loop was
    busy), not the workers silent. Its lag expires none of them; their silence still does."""
    import mesh.registry as registry

    clock = [1000.0]
    monkeypatch.setattr(registry.time, "monotonic", lambda: clock[0])
    turns = []

    async def one_turn(seconds):  # each _sweep() call below runs its loop body once
        turns.append(seconds)
        if len(turns) % 2 == 0:
            raise asyncio.CancelledError

    async def sweep():
        monkeypatch.setattr(registry.asyncio, "sleep", one_turn)
        with contextlib.suppress(asyncio.CancelledError):
            await m._sweep()
        monkeypatch.undo()
        monkeypatch.setattr(registry.time, "monotonic", lambda: clock[0])

    m = Membership(bus=None, ttl=6.0)
    a, b = card("a"), card("b")
    await m._watch(entries(Entry("a", encode(a)), Entry("b", encode(b))))
    await sweep()
    clock[0] += 7.0  # nothing read for 7 s...
    late = msgspec.structs.replace(a, updated=time.time() - 4.0)  # ...then a's card, 4 s old when read
    await m._watch(entries(Entry("a", encode(late))))
    await sweep()
    assert m.get("a") is not None and m.get("b") is not None  # b kept too: we are the ones behind
    clock[0] += 7.0  # and then nothing at all for 7 more seconds: silence, not lag
    await sweep()
    assert m.get("a") is None and m.get("b") is None


async def test_a_view_of_one_role_keeps_that_roles_cards_under_role_keys():
    """Keys are ``{role}.{worker id}``: a decode worker watches ``prefill.>``, the prefill pool only
    (watching every decode worker's refreshes was N x N / 2 deliveries a second across the mesh)."""
    from mesh.registry import card_key

    p, d = card("p1", role="prefill"), card("d1")
    assert (card_key(p), card_key(d)) == ("prefill.p1", "decode.d1")
    m = Membership(bus=None, role="prefill")
    await m._watch(entries(Entry(card_key(p), encode(p)), Entry("d1", encode(d))))  # a card under a bare key
    assert [c.worker_id for c in m.cards()] == ["p1"]
    await m._watch(entries(Entry(card_key(p), b"", "DEL")))
    assert m.cards() == []
    every = Membership(bus=None)  # a gateway's: every key, bare ones too (an older writer's)
    await every._watch(entries(Entry(card_key(p), encode(p)), Entry("d1", encode(d))))
    await every._watch(entries(Entry("d1", b"", "DEL")))
    assert [c.worker_id for c in every.cards()] == ["p1"]
