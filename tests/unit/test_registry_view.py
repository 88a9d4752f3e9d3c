"""The registry view (``mesh.registry.Membership``) fed entries as its KV watch delivers them."""

from __future__ import annotations

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
