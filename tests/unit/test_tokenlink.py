"""The token link (``mesh.tokenlink``) over real loopback sockets: a worker's ``TokenLinks`` (alone,
or with the other workers of its process on one ``LinkPool``) and a gateway's ``LinkServer``,
without NATS. Who may send, what is refused, and the fallback."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mesh.protocol import LinkHello, TokenBatch, TokenChunk, encode
from mesh.subjects import max_bytes
from mesh.tokenlink import LinkPool, LinkServer, TokenLinks, frame, listen_address


async def until(cond, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


async def serving():
    got: list[tuple[bytes, frozenset[str]]] = []
    bound: list[int] = []
    server = LinkServer(lambda data, workers: got.append((data, frozenset(workers))), "127.0.0.1",
                        on_bound=bound.append)
    await server.start()
    return server, got, bound


def batch(worker: str, n: int = 3) -> bytes:
    return encode(TokenBatch(worker, [TokenChunk(f"r{i}", 0, [i], stream=format(i, "x")) for i in range(n)]))


async def test_a_worker_proves_its_id_then_its_batches_arrive_in_order():
    server, got, bound = await serving()
    links = TokenLinks("w-1")
    try:
        key = server.key_for("w-1")
        assert links.sender(server.address, key, "inbox.batch") is None  # not connected yet: the bus
        await until(lambda: links.sender(server.address, key, "inbox.batch") is not None)
        link = links.sender(server.address, key, "inbox.batch")
        assert link.subject == "inbox.batch"
        for n in (1, 2, 3):
            assert link.send(batch("w-1", n))
        await until(lambda: len(got) == 3)
        assert got == [(batch("w-1", n), {"w-1"}) for n in (1, 2, 3)]  # bound to the worker it proved
        assert bound == [1] and server.refused == 0 and links.sent == 3
    finally:
        links.close()
        await until(lambda: bound == [1, -1])
        await server.stop()


async def test_a_key_for_another_worker_is_refused_and_the_bus_stays():
    server, got, bound = await serving()
    links = TokenLinks("w-2")
    try:
        # w-2 presents the key the gateway gave w-1: it cannot speak for w-1, nor as itself
        assert links.sender(server.address, server.key_for("w-1"), "s") is None
        await until(lambda: links.failed == 1)
        assert server.refused == 1 and bound == [] and got == []
        assert links.sender(server.address, server.key_for("w-1"), "s") is None  # no retry before RETRY_AFTER
        await asyncio.sleep(0.05)
        assert links.failed == 1
    finally:
        links.close()
        await server.stop()


async def raw(server: LinkServer):
    return await asyncio.open_connection("127.0.0.1", server.port)


async def test_a_connection_that_says_anything_else_first_or_too_much_is_closed():
    server, got, _ = await serving()
    try:
        # a TokenBatch before any hello
        r, w = await raw(server)
        w.write(frame(batch("w-1")))
        assert await r.read() == b""  # closed
        # a hello frame claiming more bytes than a hello may have: closed before they come
        r, w = await raw(server)
        w.write((max_bytes("LinkHello") + 1).to_bytes(4, "big"))
        assert await r.read() == b""
        # after a good hello, a frame over a TokenBatch's bound
        r, w = await raw(server)
        w.write(frame(encode(LinkHello("w-1", server.key_for("w-1")))))
        assert len(await r.readexactly(4 + 16)) == 20  # LinkReady
        w.write((max_bytes("TokenBatch") + 1).to_bytes(4, "big"))
        assert await r.read() == b""
        assert server.refused == 3 and got == []
    finally:
        await server.stop()


async def test_a_silent_connection_is_closed(monkeypatch):
    monkeypatch.setattr("mesh.tokenlink.HELLO_TIMEOUT", 0.1)
    server, _, _ = await serving()
    try:
        r, _ = await raw(server)
        async with asyncio.timeout(5):
            assert await r.read() == b""
        assert server.refused == 1
    finally:
        await server.stop()


async def test_nobody_listening_means_the_bus():
    server, _, _ = await serving()
    address = server.address
    await server.stop()  # the port is closed now
    links = TokenLinks("w-1")
    try:
        assert links.sender(address, "k", "s") is None
        await until(lambda: links.failed == 1)
        assert links.sender(address, "k", "s") is None
    finally:
        links.close()


async def test_a_link_the_gateway_drops_stops_taking_frames():
    server, _, _ = await serving()
    links = TokenLinks("w-1")
    try:
        key = server.key_for("w-1")
        links.sender(server.address, key, "s")
        await until(lambda: links.sender(server.address, key, "s") is not None)
        link = links.sender(server.address, key, "s")
        for conn in list(server.connections):
            conn.close()
        await until(lambda: not link.ready)
        assert not link.send(batch("w-1")) and links.failed == 1
        assert links.sender(server.address, key, "s") is None  # the bus until RETRY_AFTER
    finally:
        links.close()
        await server.stop()


async def test_the_workers_of_one_process_share_one_connection_and_one_write_per_turn():
    server, got, bound = await serving()
    pool = LinkPool()
    workers = [TokenLinks(f"w-{i}", pool) for i in range(3)]
    try:
        def links():
            return [w.sender(server.address, server.key_for(w.worker_id), "s") for w in workers]

        assert links() == [None] * 3
        await until(lambda: all(links()))
        assert len(server.connections) == 1 and bound == [1, 1, 1]
        (conn,) = server.connections
        reads = []
        feed = conn.data_received
        conn.data_received = lambda data: (reads.append(len(data)), feed(data))
        for link, w in zip(links(), workers, strict=True):  # one turn of the loop: one write
            assert link.send(batch(w.worker_id, 2))
        await until(lambda: len(got) == 3)
        assert got == [(batch(f"w-{i}", 2), {"w-0", "w-1", "w-2"}) for i in range(3)]
        assert len(reads) == 1 and pool.sent == 3
        workers[0].close()  # a worker that stops leaves its process's connection to the others
        assert links()[1].send(batch("w-1"))
        await until(lambda: len(got) == 4)
        # a hello with a bad key on the shared connection closes it: every worker back to the bus
        workers.append(TokenLinks("w-9", pool))
        assert workers[-1].sender(server.address, server.key_for("w-1"), "s") is None
        await until(lambda: pool.failed == 1)
        assert server.refused == 1 and bound == [1, 1, 1, -3]
        assert links() == [None] * 4 and len(got) == 4
    finally:
        pool.close()
        await server.stop()


async def test_a_batch_naming_a_worker_not_proven_on_its_connection_is_refused():
    from gateway.choices.replies import ReplyStreams
    from mesh.metrics import REFUSED_MESSAGES

    server, _, _ = await serving()
    replies = ReplyStreams(SimpleNamespace(nc=SimpleNamespace(new_inbox=lambda: "_INBOX.t")))  # no NATS needed
    refused = REFUSED_MESSAGES.labels("gateway", "link_other_worker")
    before = refused._value.get()
    try:
        r, w = await raw(server)
        w.write(frame(encode(LinkHello("w-1", server.key_for("w-1")))))
        await r.readexactly(4 + 16)
        (conn,) = server.connections
        server.on_batch = replies.on_link_batch
        conn.data_received(frame(batch("w-2")))  # w-2 never said hello here
        assert replies.stray == 0 and refused._value.get() == before + 1  # refused before any chunk was looked up
        conn.data_received(frame(batch("w-1")))
        assert replies.stray == 3  # taken: its chunks looked up (no such streams here)
        w.close()
    finally:
        await server.stop()


def test_listen_addresses():
    assert listen_address("10.1.2.3") == ("10.1.2.3", 0)
    assert listen_address("10.1.2.3:9000") == ("10.1.2.3", 9000)
    assert listen_address("[::1]:80") == ("::1", 80)
    assert listen_address("::1") == ("::1", 0)
    for bad in ("", ":80", "a:b", "1.2.3.4:99999", "0.0.0.0", "[::]:5"):
        with pytest.raises(ValueError, match="--token-link"):
            listen_address(bad)


class _Replies:
    def on_link_batch(self, data: bytes, workers: set[str]) -> None:
        pass


def _gateway(token_link: str, nats_url: str = "nats://127.0.0.1:4222"):
    from gateway.service import Gateway, GatewayConfig

    gw = Gateway(GatewayConfig(nats_url=nats_url, token_link=token_link))
    gw.replies = _Replies()
    return gw


async def test_the_gateway_runs_a_link_as_configured_and_none_over_tls():
    assert await _gateway("off")._start_link() is None
    assert await _gateway("auto", "tls://127.0.0.1:4222")._start_link() is None  # the link is plain TCP
    link = await _gateway("127.0.0.1")._start_link()
    try:
        assert link is not None and link.host == "127.0.0.1" and link.port > 0
        assert link.address == f"127.0.0.1:{link.port}"
        # a port already taken: no link (a warning), the bus carries everything
        assert await _gateway(f"127.0.0.1:{link.port}")._start_link() is None
    finally:
        await link.stop()


async def test_connections_yet_to_say_who_they_are_are_capped(monkeypatch):
    monkeypatch.setattr("mesh.tokenlink.MAX_UNPROVEN", 2)
    server, _, bound = await serving()
    links = TokenLinks("w-1")
    try:
        held = [await raw(server), await raw(server)]
        r, _ = await raw(server)
        assert await r.read() == b""  # a third before the first two said anything: closed
        assert server.refused == 1
        # a worker with its key still gets in once the silent ones are gone
        for _, w in held:
            w.close()
        await until(lambda: not server.connections)
        key = server.key_for("w-1")
        links.sender(server.address, key, "s")
        await until(lambda: links.sender(server.address, key, "s") is not None)
        assert bound == [1]
    finally:
        links.close()
        await server.stop()
