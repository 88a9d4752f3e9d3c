"""The token link: a decode worker's ``TokenBatch``es straight to the gateway over TCP.

Requests go out on the bus; their tokens come back once per engine step per gateway
(``TokenBatch``). Through NATS each batch crosses the server: one more process woken, one more
copy and parse per step. A gateway that runs a link advertises it in each ``GenerateRequest``
(``batch_link``: host:port, ``batch_link_key``: the worker's key), and the worker sends that
gateway's batches over one TCP connection instead (Dynamo's frontends take their response streams
over TCP from the workers the same way). The bus stays the fallback: a request whose first chunk
leaves while the worker has no ready link to its gateway keeps the bus for its whole life, so a
request's chunks never take two paths and arrive out of order.

Trust: the key is an HMAC of the worker's id under a secret the gateway drew at start, sent only in
requests on that worker's own subject. A connection opens with ``LinkHello(worker, key)``; the
gateway checks the key, binds the connection to that worker and answers ``LinkReady``; a batch
naming another worker is refused, as on the bus (``gateway.choices.replies``). A connection that says
anything else first, sends a frame over its type's bound, or stays silent past ``HELLO_TIMEOUT``
is logged, counted and closed, as is any beyond ``MAX_UNPROVEN`` still to say who they are. The
link carries what the bus carries in the clear, so a gateway whose bus runs over TLS runs no link
unless told to (``GatewayConfig.token_link``).

Wire: each frame is a 4-byte big-endian length, then a ``mesh.protocol`` message.

    worker                                    gateway (LinkServer)
      | --- connect host:port --------------------> |
      | --- LinkHello(worker, key) ---------------> |  key == hmac(secret, worker)?  else close
      | <-------------------------------- LinkReady |
      | --- TokenBatch, TokenBatch, ... ----------> |  on_batch(bytes, worker)
"""

from __future__ import annotations

import asyncio
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
CONNECT_TIMEOUT = 2.0  # a worker's connect and hello, before it gives up (and uses the bus)
RETRY_AFTER = 10.0  # seconds before a worker tries a link that failed again
MAX_BUFFERED = 16 << 20  # bytes a worker lets queue on a link (a gateway not reading) before dropping it
_HEADER = 4


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
    """A gateway's link listener. ``on_batch(data, worker)``: a TokenBatch's bytes from a
    connection bound to ``worker`` (the caller decodes it and checks its ``worker`` field)."""

    def __init__(self, on_batch: Callable[[bytes, str], None], host: str, port: int = 0,
                 on_bound: Callable[[int], None] | None = None):
        self.on_batch = on_batch
        self.on_bound = on_bound  # +1 when a connection proves its worker, -1 when a bound one closes
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
        self.worker: str | None = None  # bound by a good hello
        self.transport: asyncio.Transport | None = None
        self.peer = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._batch_limit = max_bytes("TokenBatch")
        self._hello_limit = max_bytes("LinkHello")

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        if sum(1 for c in self.server.connections if c.worker is None) >= MAX_UNPROVEN:
            self.server.refuse("busy", self.peer, f"{MAX_UNPROVEN} connections yet to say who they are")
            transport.close()
            return
        self.server.connections.add(self)
        self._hello_timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT, self._silent)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self.worker is not None:
            log.info("token link from %s closed", self.worker)
            if self.server.on_bound is not None:
                self.server.on_bound(-1)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _silent(self) -> None:
        if self.worker is None:
            self.server.refuse("silent", self.peer)
            self.close()

    def data_received(self, data: bytes) -> None:
        frames = self.frames.feed(data, self._batch_limit if self.worker is not None else self._hello_limit)
        if frames is None:
            BUS_DROPPED.labels("TokenBatch" if self.worker else "LinkHello", "oversized").inc()
            self.server.refuse("oversized", self.peer, self.worker or "before its hello")
            self.close()
            return
        for payload in frames:
            if self.worker is None:
                if not self._hello(payload):
                    self.close()
                    return
            else:
                self.server.batches += 1
                self.server.on_batch(payload, self.worker)

    def _hello(self, payload: bytes) -> bool:
        try:
            hello = decode(payload, LinkHello)
        except DecodeError as e:
            self.server.refuse("bad_hello", self.peer, str(e))
            return False
        if not hmac.compare_digest(hello.key, self.server.key_for(hello.worker)):
            self.server.refuse("bad_key", self.peer, hello.worker)
            return False
        self.worker = hello.worker
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.transport.write(frame(encode(LinkReady())))
        if self.server.on_bound is not None:
            self.server.on_bound(1)
        return True


# -- the worker's side ---------------------------------------------------------------------------


class TokenLinks:
    """A worker's links, one per gateway address. ``sender(address, key, subject)`` is the ready
    link or None (then a connect starts in the background, at most once per ``RETRY_AFTER``);
    ``subject``: the gateway's batch subject, the link's fallback."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._links: dict[str, _WorkerSide] = {}
        self._tasks: set[asyncio.Task] = set()
        self.sent = 0  # batches sent over links
        self.failed = 0  # connects that failed, links dropped

    def sender(self, address: str, key: str, subject: str) -> _WorkerSide | None:
        link = self._links.get(address)
        if link is not None:
            if link.ready:
                return link
            if link.connecting or time.monotonic() < link.retry_at:
                return None
        link = self._links[address] = _WorkerSide(self, address, key, subject)
        task = asyncio.get_running_loop().create_task(link.connect())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return None

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        for task in self._tasks:
            task.cancel()


class _WorkerSide(asyncio.Protocol):
    def __init__(self, links: TokenLinks, address: str, key: str, subject: str):
        self.links = links
        self.address = address
        self.key = key
        self.subject = subject
        self.transport: asyncio.Transport | None = None
        self.frames = _Frames()
        self.connecting = True
        self.ready = False
        self.retry_at = 0.0
        self._answered: asyncio.Future | None = None

    async def connect(self) -> None:
        host, _, port = self.address.rpartition(":")
        loop = asyncio.get_running_loop()
        self._answered = loop.create_future()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await loop.create_connection(lambda: self, host.strip("[]"), int(port))
                self.transport.write(frame(encode(LinkHello(self.links.worker_id, self.key))))
                await self._answered
        except (OSError, TimeoutError, ValueError, DecodeError) as e:
            self._failed(f"{type(e).__name__}: {e}")
            return
        finally:
            self.connecting = False
        self.ready = True
        log.info("token link to %s ready", self.address)

    def send(self, payload: bytes) -> bool:
        """Queue one frame; False (and the link dropped) if the gateway has stopped reading."""
        t = self.transport
        if not self.ready or t is None or t.is_closing():
            return False
        if t.get_write_buffer_size() > MAX_BUFFERED:
            self._failed(f"over {MAX_BUFFERED} bytes queued")
            return False
        t.write(frame(payload))
        self.links.sent += 1
        return True

    def close(self) -> None:
        self.ready = False
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        answered = self._answered
        if answered is None or answered.done():
            self._failed("unexpected data from the gateway")  # nothing follows its LinkReady
            return
        frames = self.frames.feed(data, max_bytes("LinkReady"))
        if frames is None:
            answered.set_exception(DecodeError("an answer over its bound", "oversized"))
        elif frames:
            try:
                decode(frames[0], LinkReady)
            except DecodeError as e:
                answered.set_exception(e)
                return
            answered.set_result(None)

    def connection_lost(self, exc) -> None:
        if self._answered is not None and not self._answered.done():
            self._answered.set_exception(ConnectionError("closed by the gateway before it answered"))
        if self.ready:
            self._failed("closed")

    def _failed(self, why: str) -> None:
        was_ready, self.ready = self.ready, False
        self.retry_at = time.monotonic() + RETRY_AFTER
        self.links.failed += 1
        log.warning("token link to %s %s: %s; the bus carries its batches", self.address,
                    "dropped" if was_ready else "not made", why)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
