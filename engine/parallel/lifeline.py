"""A rank's lifeline: the one connection between rank 0 and a helper rank that carries the
helper's setup, every step and its stats, and says when the other end is gone.

On rank 0's host it is a socket pair, and the other end's death is its EOF: nothing more is
needed. Across hosts (``engine.parallel.remote``) it is a TCP connection, and a host that is cut
off closes nothing, so the kernel watches it: keepalive probes once a second while it is idle,
and a limit on how long sent bytes (a step, a probe) may go unacknowledged. A host that is cut
off, dead or powered down stops acknowledging, and its lifeline fails (ETIMEDOUT) after
``LOSS_S``; a process that dies closes it at once. Probes are answered by the peer's kernel, so a
peer busy for seconds in one call (holding the GIL, say) is not taken for a lost one, as
heartbeats sent by its Python threads would be.

Each end reads in a thread of its own (messages wait in a queue for ``recv``), so that a loss is
noticed at once even while the rank's main thread is in a step, or stuck in a collective on the
lost peer: ``on_lost`` is called once, from that thread. Rank 0 fails its worker (whose card is
withdrawn well inside its lease); a rank on another host exits.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import pickle
import queue
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

# A peer whose host acknowledges nothing for this long is lost: well inside a worker's card lease
# (mesh.registry.DEFAULT_TTL, 6 s).
LOSS_S = 3.0
_GONE = object()  # the queue's end: the peer closed the lifeline or was lost
_NOTHING = object()


class Lifeline:
    """One end of a rank's lifeline: pickled messages both ways (``send``, ``send_bytes`` of a
    message pickled once for several ranks, ``poll``/``recv``). ``across_hosts``: a TCP lifeline,
    watched by the kernel and read by a thread (see the module doc); ``on_lost(why)`` is called
    once when the other end is gone, unless this end closed it first or the other end said
    goodbye (a ``None`` message)."""

    def __init__(self, conn: Connection, across_hosts: bool = False, name: str = "rank",
                 on_lost: Callable[[str], None] | None = None):
        self.conn, self.name = conn, name
        self.on_lost = on_lost
        self.lost: str | None = None  # why the other end is gone
        self._send_lock = threading.Lock()
        self._closing = False
        self._inbox: queue.Queue | None = None
        self._next = _NOTHING  # a message ``poll`` took from the inbox for ``recv``
        if across_hosts:
            watch_socket(conn.fileno())
            self._inbox = queue.Queue()
            threading.Thread(target=self._read, name=f"{name}-lifeline", daemon=True).start()

    def send(self, message) -> None:
        self.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, data: bytes) -> None:
        """OSError when the other end is gone."""
        if self.lost:
            raise BrokenPipeError(self.lost)
        with self._send_lock:
            self.conn.send_bytes(data)

    def poll(self, timeout: float) -> bool:
        """A message (or the end) is waiting."""
        if self._inbox is None:
            return self.conn.poll(timeout)
        if self._next is _NOTHING:
            try:
                self._next = self._inbox.get(timeout=timeout)
            except queue.Empty:
                return False
        return True

    def recv(self):
        """The next message (blocking); EOFError when the other end is gone."""
        if self._inbox is None:
            return pickle.loads(self.conn.recv_bytes())
        message, self._next = (self._inbox.get() if self._next is _NOTHING else self._next), _NOTHING
        if message is _GONE:
            self._inbox.put(_GONE)  # every later recv sees the end too
            raise EOFError(self.lost or "the lifeline is closed")
        return message

    def messages(self):
        """Rank 0's messages, in order, until it closes the group (None) or is gone (EOF)."""
        while True:
            try:
                message = self.recv()
            except EOFError:
                return
            if message is None:
                return
            yield message

    def close(self) -> None:
        self._closing = True
        if self._inbox is not None:
            self._shut_down()  # the reader's wait ends at once
        with contextlib.suppress(OSError):
            self.conn.close()

    def _read(self) -> None:
        try:
            while True:
                message = pickle.loads(self.conn.recv_bytes())
                if message is None:  # goodbye: the other end closes next
                    self._closing = True
                self._inbox.put(message)
        except (EOFError, OSError, TypeError, pickle.UnpicklingError) as e:  # TypeError: closed under the read
            self._lose(f"the lifeline of {self.name} {'timed out' if _timed_out(e) else 'closed'}")

    def _shut_down(self) -> None:
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=self.conn.fileno())
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()

    def _lose(self, why: str) -> None:
        self.lost = why
        self._inbox.put(_GONE)
        if self._closing:
            return
        log.error("%s", why)
        self._shut_down()  # a send stuck on it ends now
        if self.on_lost is not None:
            self.on_lost(why)


def watch_socket(fd: int) -> None:
    """The kernel watches this TCP socket (see the module doc): keepalive probes after 1 s idle, one
    a second, and no sent byte unacknowledged for longer than ``LOSS_S``; no Nagle delay on a
    step's message."""
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, int(LOSS_S))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(LOSS_S * 1000))
    finally:
        sock.detach()  # the Connection owns the descriptor


def _timed_out(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno == errno.ETIMEDOUT
