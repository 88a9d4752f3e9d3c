"""Rank 0's door for the ranks of its layout that run on other hosts.

A worker started with ``--local-ranks N`` runs ranks 0..N-1 on its own host and waits for the
others: each other host runs ``mesh rank --join WORKER``, which meets the worker over NATS
(``engine.parallel.rendezvous``) and then connects here:

    mesh rank (host B)                        the worker, rank 0 (host A)
    ------------------                        ---------------------------
    RankJoin(rank, nonce, proof)  --NATS-->   ``admit``: the proof under the group token, a rank
                                              it waits for and nobody holds: held for JOIN_GRACE_S
                                  <--NATS--   RankInvite(rank, this door's address, proof)
    connect, both prove the token <--TCP-->   (multiprocessing's HMAC challenge, both ways)
    RankHello(rank, nonce)        --TCP-->    the connection is that rank's lifeline
                                  <--TCP-->   RankSetup, "ready", steps, stats (as on one host)

The group token is the worker's own (``rendezvous.group_token``: derived from the mesh secret
and the worker's id), so a host without the mesh secret cannot take a rank, and a rank cannot
join another worker's group. The lifeline (``engine.parallel.lifeline``) is watched from the
moment the connection is accepted. The torch ``TCPStore`` the ranks then meet at to join
their process groups is not authenticated (torch's is not): it listens on the same address for
as long as the groups take to form.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import torch

from engine.parallel.lifeline import Lifeline
from kvstore.cache import KVCacheSpec

log = logging.getLogger(__name__)

JOIN_GRACE_S = 30.0  # an admitted join holds its rank this long for its connection
HANDSHAKE_S = 10.0  # a connection proves the token and says which rank it is within this long


@dataclass(frozen=True)
class RankHello:
    """A joining rank's first message on its lifeline, after the token handshake."""

    rank: int
    nonce: str  # the one of its admitted join


@dataclass(frozen=True)
class Admission:
    """``RemoteRanks.admit``'s answer: the rank held for the joiner, or why not."""

    rank: int = -1
    error: str = ""


class RemoteRanks:
    """The ranks ``ranks`` of worker ``worker``'s layout, joining from other hosts: admits their
    joins, accepts their lifelines on ``addr`` (a free port), and hands them to the rank group
    (``wait``). One per worker; ``close`` stops listening."""

    def __init__(self, worker: str, ranks: tuple[int, ...], token: bytes, addr: str):
        if not ranks:
            raise ValueError("no rank to wait for on another host")
        self.worker, self.ranks, self.addr = worker, tuple(sorted(ranks)), addr
        self._token = token
        self._held: dict[int, tuple[str, float]] = {}  # rank -> (nonce, until) of an admitted join
        self._joined: dict[int, Lifeline] = {}
        self._hosts: dict[int, str] = {}  # rank -> where it joined from, for logs
        self._taken = False  # the rank group took the lifelines: the group is complete for good
        self._cond = threading.Condition()
        self._server = socket.create_server((addr, 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, name="rank-door", daemon=True).start()

    # -- joins (over NATS: engine.parallel.rendezvous) -------------------------------
    def admit(self, rank: int, nonce: str) -> Admission:
        """Hold ``rank`` (-1: the lowest one free) for a joiner whose proof was checked."""
        with self._cond:
            now = time.monotonic()
            self._held = {r: h for r, h in self._held.items() if h[1] > now}
            free = [r for r in self.ranks if r not in self._joined and r not in self._held]
            if self._taken or (not free and rank in (-1, *self.ranks)):
                return Admission(error=f"worker {self.worker} has all its ranks")
            if rank == -1:
                rank = free[0]
            if rank not in self.ranks:
                return Admission(error=f"worker {self.worker} waits for no rank {rank} from another host "
                                       f"(it waits for ranks {', '.join(map(str, self.ranks))})")
            if rank not in free:
                return Admission(error=f"rank {rank} of worker {self.worker} is taken")
            self._held[rank] = (nonce, now + JOIN_GRACE_S)
            return Admission(rank)

    def waiting_for(self) -> list[int]:
        with self._cond:
            return [r for r in self.ranks if r not in self._joined]

    # -- lifelines -----------------------------------------------------------------
    def wait(self, timeout: float) -> dict[int, Lifeline]:
        """Every rank's lifeline, once all have joined (ValueError after ``timeout`` seconds); the
        group is then complete: later joins are refused."""
        deadline = time.monotonic() + timeout
        told = 0.0
        with self._cond:
            while len(self._joined) < len(self.ranks):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = ", ".join(map(str, self.waiting_for()))
                    raise ValueError(f"rank(s) {missing} of worker {self.worker} did not join within "
                                     f"{timeout:.0f} s (mesh rank --join {self.worker}, on their hosts)")
                if time.monotonic() - told > 30:
                    told = time.monotonic()
                    log.warning("waiting for rank(s) %s to join from other hosts: mesh rank --join %s",
                                ", ".join(map(str, self.waiting_for())), self.worker)
                self._cond.wait(min(left, 1.0))
            self._taken = True
            return dict(self._joined)

    def host_of(self, rank: int) -> str:
        return self._hosts.get(rank, "another host")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.close()
        with self._cond:
            if not self._taken:  # lifelines the group never took
                for link in self._joined.values():
                    link.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._greet, args=(sock, peer[0]), name="rank-greet", daemon=True).start()

    def _greet(self, sock: socket.socket, peer: str) -> None:
        """The token handshake and the hello, each bounded; then the connection is a lifeline."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(HANDSHAKE_S), 0))
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self._token)
            answer_challenge(conn, self._token)
            hello = pickle.loads(conn.recv_bytes(4096))  # from a peer that holds the token
        except (AuthenticationError, EOFError, OSError, pickle.UnpicklingError) as e:
            log.warning("a rank connection from %s was refused: %s", peer, e or type(e).__name__)
            conn.close()
            return
        with self._cond:  # matched and taken at once: two connections never take one rank
            why = self._match(hello)
            if not why:
                _unbound_reads(conn.fileno())
                self._joined[hello.rank] = Lifeline(conn, across_hosts=True, name=f"rank {hello.rank} ({peer})",
                                                    on_lost=lambda _why, r=hello.rank: self._left(r))
                self._hosts[hello.rank] = peer
                self._held.pop(hello.rank, None)
                self._cond.notify_all()
        if why:
            log.warning("a rank connection from %s was refused: %s", peer, why)
            with contextlib.suppress(OSError):
                conn.send(why)
            conn.close()
            return
        log.info("rank %d of worker %s joined from %s", hello.rank, self.worker, peer)

    def _match(self, hello) -> str:
        """Why this hello does not match an admitted join ("" when it does); under the lock."""
        if not isinstance(hello, RankHello):
            return "no RankHello"
        nonce, until = self._held.get(hello.rank, ("", 0.0))
        if self._taken or hello.rank in self._joined:
            return f"rank {hello.rank} is taken"
        if nonce != hello.nonce or until < time.monotonic():
            return f"rank {hello.rank} was not admitted to this connection (or its admission expired)"
        return ""

    def _left(self, rank: int) -> None:
        """A rank that joined was lost before the group took it: its place is free again."""
        with self._cond:
            if not self._taken:
                self._joined.pop(rank, None)


class RemoteKVPart:
    """A rank's part of the KV cache on another host, as rank 0 sees it: its spec, no bytes. No
    KV transport reaches it (a worker with ranks on other hosts prefills its own prompts)."""

    def __init__(self, spec: KVCacheSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.device = torch.device("cpu")
        self.shm_path = None

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        raise RuntimeError(f"rank {self.rank}'s KV is on another host: no transport moves it")

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.read_blocks(block_ids)

    def close(self, unlink: bool = False) -> None:
        pass


def _unbound_reads(fd: int) -> None:
    """The handshake's read timeout off: a lifeline waits for its next message as long as it takes."""
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
    finally:
        sock.detach()
