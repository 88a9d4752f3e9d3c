"""A registry view on a real nats-server: one replay through the KV watch, then the cards' puts and
deletes followed on the bucket's subjects (``mesh.registry``), refreshes taken without a decode."""

from __future__ import annotations

import asyncio
import time

from mesh.bus import Bus
from mesh.protocol import WorkerCard
from mesh.registry import CardPublisher, Membership

STARTED = time.time()


def card(wid: str, status: str = "ready") -> WorkerCard:
    return WorkerCard(wid, "decode", "m", 16, 100, 1024, "h", 1, STARTED, STARTED, status=status)


async def until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_view_follows_puts_refreshes_and_deletes_after_its_replay(nats_server, monkeypatch):
    import mesh.registry as registry

    bus = await Bus.connect(nats_server.url, "registry-follow", ns="follow")
    other = await Bus.connect(nats_server.url, "registry-follow-w", ns="follow")
    status = {"a": "ready"}
    early = CardPublisher(other, lambda: card("a", status["a"]), ttl=1.5)  # refreshes every 0.5 s
    await early.start()
    m = Membership(bus, ttl=1.5)
    heard = []
    m.on_change(lambda wid, c: heard.append((wid, None if c is None else c.status)))
    decoded = []
    real = registry.decode
    monkeypatch.setattr(registry, "decode", lambda data, t: decoded.append(1) or real(data, t))
    late = CardPublisher(other, lambda: card("b"), ttl=1.5)
    try:
        await m.start(wait=5.0)
        assert [c.worker_id for c in m.cards()] == ["a"]  # from the replay
        assert m._watch_task.done()  # the watch stopped after it: the subscription follows
        await late.start()  # a join after the replay
        await until(lambda: m.get("b") is not None)
        first, n = m.get("a").updated, len(decoded)
        await until(lambda: m.get("a").updated > first + 0.9)  # two refreshes of each card...
        assert len(decoded) == n  # ...and none decoded
        status["a"] = "draining"
        await until(lambda: m.get("a").status == "draining")  # a change is decoded and heard
        await late.stop()  # a clean exit deletes the card
        await until(lambda: m.get("b") is None)
        assert heard == [("a", "ready"), ("b", "ready"), ("a", "draining"), ("b", None)]
    finally:
        await early.stop()
        await late.stop()
        await m.stop()
        await other.close()
        await bus.close()
