"""``mesh rank --join WORKER``: run one rank of a worker's layout on this host.

The worker (``mesh worker decode --tp T --pp P --local-ranks N --worker-id WORKER``) runs ranks
0..N-1 on its host and waits for the others. This process asks it for a rank over NATS, proving
the group token (derived from the mesh secret and the worker's id), connects its lifeline, loads
its part of the model (its stage's layers, its share of the heads) from the model directory on
this host, and serves steps until the worker closes the group (exit 0). It exits non-zero when
the worker is lost (dead or cut off), and with one line when the join is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

from cli.flags import CliError, add_bus_flags, hash_key, nats_config

log = logging.getLogger("mesh.rank")
LIFELINE_CONNECT_S = 10.0


def add_parser(sub) -> None:
    p = sub.add_parser("rank", help="run one rank of a worker whose ranks span hosts")
    p.add_argument("--join", required=True, metavar="WORKER", help="the worker's id (its --worker-id)")
    add_bus_flags(p)
    p.add_argument("--rank", type=int, default=-1, help="the rank to take (default: the lowest the worker waits for)")
    p.add_argument("--model", default=None,
                   help="the model directory on this host (default: the path the worker loads it from)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the worker's kind, its first one)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, from this host's cores)")
    p.add_argument("--join-timeout", type=float, default=300.0,
                   help="seconds to keep asking while no worker of that id answers (it may start later)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.parallel.rendezvous import JoinError, group_token, join
    from mesh.bus import Bus
    from mesh.config import settings

    key = hash_key(args)
    if key.is_default:
        raise CliError("mesh rank needs the mesh secret (--hash-key-file or MESH_HASH_KEY): the group token is "
                       "derived from it")
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be >= 1")
    ns = args.ns or settings().ns
    nats = nats_config(args, "decode")  # a rank is a part of a decode worker: its NATS user is the worker's
    token = group_token(key, ns, args.join)
    host = socket.gethostname()

    async def ask():
        bus = await Bus.connect(nats.url, name=f"rank-{args.join}-{host}", ns=ns, config=nats)
        try:
            return await join(bus, args.join, token, args.rank, host, args.join_timeout)
        finally:
            await bus.close()

    try:
        invite, nonce = asyncio.run(ask())
    except JoinError as e:
        raise CliError(str(e)) from None
    log.info("worker %s (tp %d x pp %d) admitted this host as rank %d; its lifeline: %s:%d", args.join, invite.tp,
             invite.pp, invite.rank, invite.address, invite.port)
    return _serve(args, invite, nonce, token)


def _serve(args: argparse.Namespace, invite, nonce: str, token: bytes) -> int:
    """Connect the lifeline (the token proven both ways), say which rank this is, and serve."""
    import os
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

    from engine.parallel.lifeline import Lifeline
    from engine.parallel.rank import RankHost, RankRefused, serve_joined
    from engine.parallel.remote import RankHello

    try:
        sock = socket.create_connection((invite.address, invite.port), timeout=LIFELINE_CONNECT_S)
    except OSError as e:
        raise CliError(f"cannot reach worker {args.join}'s lifeline at {invite.address}:{invite.port}: {e}") from None
    addr = sock.getsockname()[0]  # this host's address toward rank 0: where its process groups listen
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, token)
        deliver_challenge(conn, token)
        conn.send(RankHello(invite.rank, nonce))
    except (AuthenticationError, EOFError, OSError) as e:
        raise CliError(f"worker {args.join}'s lifeline refused this rank: {e or type(e).__name__}") from None

    def lost(why: str) -> None:  # rank 0 is gone mid-step: nothing here is worth finishing
        log.error("rank %d of worker %s: %s; exiting", invite.rank, args.join, why)
        logging.shutdown()
        os._exit(1)

    link = Lifeline(conn, across_hosts=True, name=f"worker {args.join}", on_lost=lost)
    try:
        return serve_joined(link, RankHost(addr, args.model, args.device, args.threads))
    except RankRefused as e:
        raise CliError(f"worker {args.join}: {e}") from None
