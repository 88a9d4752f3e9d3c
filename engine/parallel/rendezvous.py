"""How a worker's ranks on other hosts meet it: over NATS, under a group token.

The worker (``serve_joins``) answers ``RankJoin`` requests on its ``rank_join`` subject while it
loads, through its ``RemoteRanks`` (``engine.parallel.remote``); ``mesh rank --join WORKER``
(``join``) asks until it is admitted or refused, then connects its lifeline.

The group token is derived from the mesh secret (``--hash-key-file``, ``MESH_HASH_KEY``) and the
worker's namespace and id (``group_token``), so a host joins only with the mesh's secret, and
only the group of the worker it names. Proofs are HMAC-SHA256 under it, over a fresh nonce:

    join    HMAC(token, "pdmesh-rank-join"   | worker | rank | nonce | host)
    invite  HMAC(token, "pdmesh-rank-invite" | worker | rank | nonce | address | port)

The worker admits only a join whose proof it can check, and the joiner connects only to an
invite that proves the worker holds the token; the lifeline's own handshake proves it again,
both ways (``RemoteRanks``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from contextlib import AsyncExitStack

import nats.errors

from kvstore.hashing import HashKey
from mesh.bus import Bus
from mesh.protocol import RankInvite, RankJoin

log = logging.getLogger(__name__)

ASK_TIMEOUT = 5.0  # seconds one join request waits for the worker's answer
RETRY_S = 1.0  # between asks while no worker of that id answers (it may not have started yet)


class JoinError(Exception):
    """A join that cannot succeed: refused, or no such worker. One line."""


def group_token(key: HashKey, ns: str, worker: str) -> bytes:
    """The secret of worker ``worker``'s rank group: the mesh secret's subkey for it."""
    return key.subkey(f"rank-group/{ns}/{worker}")


def _mac(token: bytes, *fields) -> str:
    return hmac.new(token, "|".join(map(str, fields)).encode(), hashlib.sha256).hexdigest()


def join_proof(token: bytes, worker: str, rank: int, nonce: str, host: str) -> str:
    return _mac(token, "pdmesh-rank-join", worker, rank, nonce, host)


def invite_proof(token: bytes, worker: str, rank: int, nonce: str, address: str, port: int) -> str:
    return _mac(token, "pdmesh-rank-invite", worker, rank, nonce, address, port)


def answer(remote, token: bytes, join: RankJoin, tp: int, pp: int) -> RankInvite:
    """The worker's answer to ``join`` (``remote``: its ``RemoteRanks``)."""
    proof = join_proof(token, remote.worker, join.rank, join.nonce, join.host)
    if join.worker != remote.worker or not hmac.compare_digest(proof, join.proof):
        log.warning("refused a rank join from %s: wrong group token", join.host or "a host")
        return RankInvite(False, "wrong group token (the rank's mesh secret is not this worker's: "
                                 "--hash-key-file or MESH_HASH_KEY)")
    admitted = remote.admit(join.rank, join.nonce)
    if admitted.error:
        log.warning("refused a rank join from %s: %s", join.host or "a host", admitted.error)
        return RankInvite(False, admitted.error)
    port = remote.port
    return RankInvite(True, rank=admitted.rank, address=remote.addr, port=port, tp=tp, pp=pp,
                      proof=invite_proof(token, remote.worker, admitted.rank, join.nonce, remote.addr, port))


async def serve_joins(bus: Bus, remote, token: bytes, tp: int, pp: int, stack: AsyncExitStack) -> None:
    """Answer ``RankJoin`` requests for ``remote``'s worker until ``stack`` closes."""

    async def on_join(join: RankJoin, raw) -> None:
        await bus.respond(raw, answer(remote, token, join, tp, pp))

    sub = await bus.subscribe(bus.subjects.rank_join(remote.worker), on_join, RankJoin)
    stack.push_async_callback(sub.unsubscribe)


async def join(bus: Bus, worker: str, token: bytes, rank: int, host: str, timeout: float) -> tuple[RankInvite, str]:
    """Ask worker ``worker`` for rank ``rank`` (-1: any) until admitted: its invite and this
    join's nonce. JoinError when refused, when the answer does not prove the token, or when no
    worker of that id answers within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        nonce = secrets.token_hex(16)
        ask = RankJoin(worker, nonce, join_proof(token, worker, rank, nonce, host), rank, host)
        try:
            invite = await bus.request(bus.subjects.rank_join(worker), ask, RankInvite, ASK_TIMEOUT)
            break
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
            if time.monotonic() + RETRY_S > deadline:
                raise JoinError(f"no worker {worker} waits for ranks on namespace {bus.subjects.ns!r} "
                                f"(waited {timeout:g} s)") from None
            await asyncio.sleep(RETRY_S)
    if not invite.ok:
        raise JoinError(f"worker {worker} refused the join: {invite.error}")
    expected = invite_proof(token, worker, invite.rank, nonce, invite.address, invite.port)
    if not hmac.compare_digest(expected, invite.proof):
        raise JoinError(f"the answer from worker {worker} does not prove its group token: not joining it")
    return invite, nonce
