"""The token link: a decode worker's ``TokenBatch``es straight to the gateway over TCP.

Requests go out on the bus; their tokens come back once per engine step per gateway
(``TokenBatch``). Through NATS each batch crosses the server: one more process woken, one more
copy and parse per step. A gateway that runs a link advertises it in each ``GenerateRequest``
(``batch_link``: host:port, ``batch_link_key``: the worker's key), and the worker sends that
gateway's batches over one TCP connection instead (Dynamo's frontends take their response streams
over TCP from the workers the same way). The bus stays the fallback: a request whose first chunk
leaves while the worker has no ready link to its gateway keeps the bus for its whole life, so a
request's chunks never take two paths and arrive out of order.

One connection per process, not per worker: the workers of one process (``mesh worker mock
--num-workers``, as on one host) share one ``LinkPool``, so their batches to a gateway travel one
socket, and the frames every worker queues in one turn of the loop leave in one write. A gateway
then takes a process's step in one read, however many workers it holds, as it would from one
worker (at 1,000 workers: ~8 sockets instead of 1,000, each woken once a step).

Trust: the key is an HMAC of the worker's id under a secret the gateway drew at start, sent only in
requests on that worker's own subject. Each worker on a connection says ``LinkHello(worker, key)``
first; the gateway checks the key, adds the worker to the connection's proven ones and answers
``LinkReady`` (answers come in the order of the hellos); a batch naming a worker not proven on its
connection is refused, as on the bus (``gateway.choices.replies``). A connection that says
anything else first, sends a frame over its type's bound, or stays silent past ``HELLO_TIMEOUT``
is logged, counted and closed, as is any beyond ``MAX_UNPROVEN`` still to say who they are. The
link carries what the bus carries in the clear, so a gateway whose bus runs over TLS runs no link
unless told to (``GatewayConfig.token_link``).

Wire: each frame is a 4-byte big-endian length, then a ``mesh.protocol`` message.

    a process's workers (LinkPool)            gateway (LinkServer)
      | --- connect host:port --------------------> |
      | --- LinkHello(w1, key1) ------------------> |  key == hmac(secret, w1)?  else close
      | <-------------------------------- LinkReady |  w1 proven on this connection
      | --- TokenBatch(w1), LinkHello(w2, key2) --> |  on_batch(bytes, {w1}); w2 proven
      | <-------------------------------- LinkReady |
      | --- TokenBatch(w1) TokenBatch(w2) ... ----> |  one write per turn of the loop
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import os
import socket
import time
from collections.abc import Callable

from mesh.metrics import BUS_DROPPED, REFUSED_MESSAGES
from mesh.protocol import DecodeError, LinkHello, LinkReady, decode, encode
from mesh.subjects import max_bytes

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 5.0  # seconds a new connection has to say who it is
MAX_UNPROVEN = 256  # connections that have not said who they are yet; more are closed at once
CONNECT_TIMEOUT = 2.0  # a connect, or a hello's answer, before the link is given up (and the bus used)
RETRY_AFTER = 10.0  # seconds before a worker tries a link that failed again
MAX_BUFFERED = 16 << 20  # bytes a worker lets queue on a link (a gateway not reading) before dropping it
_HEADER = 4
_HELLO_HEAD = encode(LinkHello("", ""))[:16]  # a hello's map header and type tag (it always has its 3 fields)


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_HEADER, "big") + payload


def link_key(secret: bytes, worker_id: str) -> str:
    """The key ``worker_id`` proves itself with on a gateway's link."""
    return hmac.new(secret, worker_id.encode(), hashlib.sha256).hexdigest()[:32]


def local_address_toward(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (no packet is sent): where peers that reach
    the same NATS server can reach us. Resolves ``host``: call it off the event loop."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 4222))
        return s.getsockname()[0]


def listen_address(value: str) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT`` as (host, port); port 0: any free one."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ("" if not rest else None)
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    else:
        host, port = value, ""
    if not host or port is None or (port and not port.isdigit()) or int(port or 0) > 65535:
        raise ValueError(f"--token-link {value!r}: expected auto, off, HOST, HOST:PORT or [V6]:PORT")
    if host in ("0.0.0.0", "::"):
        raise ValueError(f"--token-link {value!r}: workers connect to the address given, so give one they reach")
    return host, int(port or 0)


class _Frames:
    """Splits a byte stream into frames; ``limit``: the largest payload taken (None: over it)."""

    __slots__ = ("buf",)

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes, limit: int) -> list[bytes] | None:
        buf = self.buf
        buf += data
        out, at = [], 0
        while len(buf) - at >= _HEADER:
            n = int.from_bytes(buf[at:at + _HEADER], "big")
            if n > limit:
                return None
            if len(buf) - at - _HEADER < n:
                break
            out.append(bytes(buf[at + _HEADER:at + _HEADER + n]))
            at += _HEADER + n
        if at:
            del buf[:at]
        return out


# -- the gateway's side --------------------------------------------------------------------------


class LinkServer:
    """A gateway's link listener. ``on_batch(data, workers)``: a TokenBatch's bytes from a
    connection on which ``workers`` (a set) proved who they are (the caller decodes it and checks
    that its ``worker`` field is one of them)."""

    def __init__(self, on_batch: Callable[[bytes, set[str]], None], host: str, port: int = 0,
                 on_bound: Callable[[int], None] | None = None):
        self.on_batch = on_batch
        self.on_bound = on_bound  # +1 when a worker proves itself on a connection, -n when one with n closes
        self.host = host
        self.port = port
        self.secret = os.urandom(32)
        self._keys: dict[str, str] = {}
        self._server: asyncio.AbstractServer | None = None
        self.connections: set[_GatewaySide] = set()
        self.batches = 0  # taken over links
        self.refused = 0  # connections closed for a bad hello, an oversized frame, or silence

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def key_for(self, worker_id: str) -> str:
        key = self._keys.get(worker_id)
        if key is None:
            key = self._keys[worker_id] = link_key(self.secret, worker_id)
        return key

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _GatewaySide(self), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("token link listening on %s", self.address)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.close()
            await self._server.wait_closed()
            self._server = None

    def refuse(self, reason: str, peer, detail: str = "") -> None:
        self.refused += 1
        REFUSED_MESSAGES.labels("gateway", f"link_{reason}").inc()
        log.warning("token link from %s closed: %s%s", peer, reason, f" ({detail})" if detail else "")


class _GatewaySide(asyncio.Protocol):
    def __init__(self, server: LinkServer):
        self.server = server
        self.frames = _Frames()
        self.workers: set[str] = set()  # proven by their hellos on this connection
        self.transport: asyncio.Transport | None = None
        self.peer = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._batch_limit = max_bytes("TokenBatch")
        self._hello_limit = max_bytes("LinkHello")

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        if sum(1 for c in self.server.connections if not c.workers) >= MAX_UNPROVEN:
            self.server.refuse("busy", self.peer, f"{MAX_UNPROVEN} connections yet to say who they are")
            transport.close()
            return
        self.server.connections.add(self)
        self._hello_timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT, self._silent)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self.workers:
            log.info("token link from %s closed (%d workers)", min(self.workers), len(self.workers))
            if self.server.on_bound is not None:
                self.server.on_bound(-len(self.workers))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _silent(self) -> None:
        if not self.workers:
            self.server.refuse("silent", self.peer)
            self.close()

    def data_received(self, data: bytes) -> None:
        workers = self.workers
        frames = self.frames.feed(data, self._batch_limit if workers else self._hello_limit)
        if frames is None:
            BUS_DROPPED.labels("TokenBatch" if workers else "LinkHello", "oversized").inc()
            self.server.refuse("oversized", self.peer, min(workers) if workers else "before its hello")
            self.close()
            return
        for payload in frames:
            if not workers or payload.startswith(_HELLO_HEAD):
                if not self._hello(payload):
                    self.close()
                    return
            else:
                self.server.batches += 1
                self.server.on_batch(payload, workers)

    def _hello(self, payload: bytes) -> bool:
        if len(payload) > self._hello_limit:  # a later hello is read under a batch's bound
            BUS_DROPPED.labels("LinkHello", "oversized").inc()
            self.server.refuse("oversized", self.peer, "a hello")
            return False
        try:
            hello = decode(payload, LinkHello)
        except DecodeError as e:
            self.server.refuse("bad_hello", self.peer, str(e))
            return False
        if not hmac.compare_digest(hello.key, self.server.key_for(hello.worker)):
            self.server.refuse("bad_key", self.peer, hello.worker)
            return False
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.transport.write(frame(encode(LinkReady())))
        if hello.worker not in self.workers:
            self.workers.add(hello.worker)
            if self.server.on_bound is not None:
                self.server.on_bound(1)
        return True


# -- the worker's side ---------------------------------------------------------------------------


class LinkPool:
    """The links of one process: one connection per gateway address, shared by the process's
    workers (``worker.host`` owns it; a worker alone has its own). ``link(address, worker, key,
    subject)`` is ``worker``'s ready link or None (then the connection, or the worker's hello on
    it, starts in the background; a connection that failed is retried after ``RETRY_AFTER``)."""

    def __init__(self):
        self._conns: dict[str, _Connection] = {}
        self._tasks: set[asyncio.Task] = set()
        self.sent = 0  # batches queued on links
        self.failed = 0  # connects that failed, links dropped

    def link(self, address: str, worker: str, key: str, subject: str) -> _Link | None:
        conn = self._conns.get(address)
        if conn is None or (conn.dead and time.monotonic() >= conn.retry_at):
            conn = self._conns[address] = _Connection(self, address)
            task = asyncio.get_running_loop().create_task(conn.connect())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif conn.dead:
            return None
        link = conn.links.get(worker)
        if link is None:
            conn.ask(worker, key, subject)
        return link

    def close(self) -> None:
        """Close every connection; frames queued in this turn of the loop are written first."""
        for conn in self._conns.values():
            conn.close()
        for task in self._tasks:
            task.cancel()


class TokenLinks:
    """One worker's view of its process's links (``LinkPool``; its own when given none):
    ``sender(address, key, subject)`` is its ready link to that gateway or None (the bus, for
    now); ``subject``: the gateway's batch subject, the link's fallback."""

    def __init__(self, worker_id: str, pool: LinkPool | None = None):
        self.worker_id = worker_id
        self.pool = pool if pool is not None else LinkPool()
        self._owned = pool is None

    def sender(self, address: str, key: str, subject: str) -> _Link | None:
        return self.pool.link(address, self.worker_id, key, subject)

    @property
    def sent(self) -> int:
        return self.pool.sent

    @property
    def failed(self) -> int:
        return self.pool.failed

    def close(self) -> None:
        """The worker is done: its own pool closes; a shared one is its process's to close."""
        if self._owned:
            self.pool.close()


class _Link:
    """A worker's way onto a connection its hello was answered on."""

    __slots__ = ("conn", "subject", "worker")

    def __init__(self, conn: _Connection, worker: str, subject: str):
        self.conn = conn
        self.worker = worker
        self.subject = subject

    @property
    def ready(self) -> bool:
        return self.conn.open

    def send(self, payload: bytes) -> bool:
        """Queue one frame; False (and the connection dropped) if the gateway has stopped reading."""
        return self.conn.send(payload)


class _Connection(asyncio.Protocol):
    """One TCP connection to a gateway, for every worker of the process that proves itself on it.
    Frames queued in one turn of the loop leave in one write."""

    def __init__(self, pool: LinkPool, address: str):
        self.pool = pool
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.frames = _Frames()
        self.open = False  # connected, and not dropped
        self.dead = False  # failed or dropped: the bus until ``retry_at``
        self.retry_at = 0.0
        self.links: dict[str, _Link] = {}  # the workers whose hellos were answered
        self._asking: set[str] = set()  # hellos sent or waiting for the connection
        self._unsent: list[tuple[str, str, str]] = []  # (worker, key, subject) asked before it was open
        self._asked: collections.deque[tuple[str, str, float]] = collections.deque()  # (worker, subject, sent at)
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush: asyncio.Handle | None = None

    async def connect(self) -> None:
        host, _, port = self.address.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await loop.create_connection(lambda: self, host.strip("[]"), int(port))
        except (OSError, TimeoutError, ValueError) as e:
            self._failed(f"{type(e).__name__}: {e}")
            return
        if self.dead:
            return
        self.open = True
        log.info("token link to %s open", self.address)
        unsent, self._unsent = self._unsent, []
        for worker, key, subject in unsent:
            self._hello(worker, key, subject)

    def ask(self, worker: str, key: str, subject: str) -> None:
        """``worker``'s hello, once: now if the connection is open, else once it is."""
        if worker in self._asking:
            return
        self._asking.add(worker)
        if self.open:
            self._hello(worker, key, subject)
        else:
            self._unsent.append((worker, key, subject))

    def _hello(self, worker: str, key: str, subject: str) -> None:
        self._asked.append((worker, subject, time.monotonic()))
        self._queue(encode(LinkHello(worker, key)))
        asyncio.get_running_loop().call_later(CONNECT_TIMEOUT, self._overdue)

    def _overdue(self) -> None:
        if self._asked and time.monotonic() - self._asked[0][2] >= CONNECT_TIMEOUT and not self.dead:
            self._failed(f"no answer to {self._asked[0][0]}'s hello in {CONNECT_TIMEOUT:.0f} s")

    def send(self, payload: bytes) -> bool:
        t = self.transport
        if not self.open or t is None or t.is_closing():
            return False
        if t.get_write_buffer_size() + self._out_bytes > MAX_BUFFERED:
            self._failed(f"over {MAX_BUFFERED} bytes queued")
            return False
        self._queue(payload)
        self.pool.sent += 1
        return True

    def _queue(self, payload: bytes) -> None:
        self._out.append(len(payload).to_bytes(_HEADER, "big"))
        self._out.append(payload)
        self._out_bytes += _HEADER + len(payload)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._write)

    def _write(self) -> None:
        self._flush = None
        out, self._out, self._out_bytes = self._out, [], 0
        t = self.transport
        if out and t is not None and not t.is_closing():
            t.write(b"".join(out))

    def close(self) -> None:
        self.open, self.dead, self.retry_at = False, True, float("inf")  # the process is done with it
        if self._flush is not None:
            self._flush.cancel()
            self._write()
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        frames = self.frames.feed(data, max_bytes("LinkReady"))
        if frames is None:
            self._failed("an answer over its bound")
            return
        for payload in frames:
            if not self._asked:
                self._failed("unexpected data from the gateway")  # nothing but answers to hellos
                return
            try:
                decode(payload, LinkReady)
            except DecodeError as e:
                self._failed(f"a bad answer: {e}")
                return
            worker, subject, _ = self._asked.popleft()
            self.links[worker] = _Link(self, worker, subject)

    def connection_lost(self, exc) -> None:
        if not self.dead:
            self._failed("closed by the gateway" if self.open else "closed before it opened")

    def _failed(self, why: str) -> None:
        was_open, self.open, self.dead = self.open, False, True
        self.retry_at = time.monotonic() + RETRY_AFTER
        self.pool.failed += 1
        self._out, self._out_bytes = [], 0
        log.warning("token link to %s %s: %s; the bus carries its batches", self.address,
                    "dropped" if was_open else "not made", why)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
