"""nixl at several ranks: every rank of a worker runs its own NIXL agent and registers its own part
of the KV pool; rank 0's transport drives its helper ranks' agents over a channel of their own.

Why an agent per rank, not rank 0 registering every part (on a CPU it maps them all): on a GPU a
rank's part is VRAM of its own process, which rank 0 sees only through a CUDA IPC mapping, and
memory mapped that way is not what UCX can register for another host (GPUDirect RDMA pins
memory of the process that allocated it; open-mpi/ompi#14305: an inter-node receive into a
cudaIpcOpenMemHandle pointer fails), nor can UCX open an IPC handle the process already opened
(openucx/ucx#3192). And each GPU of a node has a NIC rail of its own: one agent per rank moves
each rank's bytes over its own. It is how the field does it (vLLM's and SGLang's NIXL
connectors: an agent per TP rank, each writing the heads it holds).

    rank 0 (the transport: NixlReceiver, NixlSender)        rank r (helper: RankAgentService)
    RankPart.start()        -- Start(worker) -->            agent made, its KV part registered
                            <-- Started(agent, metadata, region)
    (receiver) rank 0 answers the metadata requests for rank r's agent on the worker's subject
    (sender) ensure_peer()  -- AddPeer(agent, rev, md) -->  the receiving rank's agent added
    write()                 -- Write(peer, pieces, notif) -> posted, progressed until DONE/ERR
                            <-- Wrote(error)
    (receiver) a grant      -- Expect(key) / Unexpect -->   progress while the write may come
                            <-- Notified(notifications)     each one forwarded to rank 0's node

The channel is a socket pair rank 0 made when it started the helper (``engine.parallel``),
pickled messages of this module (the same trust as the step pipe: rank 0's own children). The
helper serves it on a thread of its own, with an event loop for its agent's progress; rank 0
reads it on a thread that hands replies and notifications to its event loop. A helper that is
gone fails every call in flight and every later one (``RuntimeError``): the write fails in one
line and the job is refused, never hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kvstore.transfer.nixl_progress import Notifs, Progress

if TYPE_CHECKING:  # imported where used: a helper rank of a worker without nixl never loads NIXL
    from kvstore.transfer.nixl_agent import NixlNode, Peer, Region

log = logging.getLogger(__name__)

START_TIMEOUT = 120.0  # seconds for a helper to make its agent and register its part (a large pool)
CALL_TIMEOUT = 10.0  # seconds for a helper to add a peer
WRITE_TIMEOUT = 300.0  # seconds for a helper's write (the sender's own deadline is usually shorter)


# -- the channel's messages -------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    worker_id: str  # the agent is named after the worker (``agent_name``): its writes are the worker's


@dataclass(frozen=True)
class Started:
    agent: str
    metadata: bytes
    region: Region


@dataclass(frozen=True)
class AddPeer:
    agent: str
    rev: int
    metadata: bytes


@dataclass(frozen=True)
class Write:
    peer: str
    src: Region
    local: Any  # [n, 2] (addr, len)
    dst: Region
    remote: Any
    notif: bytes


@dataclass(frozen=True)
class Expect:
    key: bytes
    fast_for: float


@dataclass(frozen=True)
class Unexpect:
    key: bytes


@dataclass(frozen=True)
class Notified:
    got: Notifs


@dataclass(frozen=True)
class Reply:
    value: Any = None
    error: str = ""


# -- the helper rank's side ---------------------------------------------------------------------
class RankAgentService:
    """A helper rank's NIXL agent, made and driven on rank 0's word. ``start()`` serves the channel
    on a daemon thread; no agent is made until rank 0 asks (a worker without nixl never does)."""

    def __init__(self, conn: Connection, tensor):
        self.conn, self.tensor = conn, tensor
        self.node: NixlNode | None = None
        self.region: Region | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="rank-agent", daemon=True)
        thread.start()
        return thread

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                call_id, msg = pickle.loads(await loop.run_in_executor(None, self.conn.recv_bytes))
            except (EOFError, OSError):
                return  # rank 0 is gone
            task = asyncio.ensure_future(self._answer(call_id, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, call_id: int | None, msg) -> None:
        try:
            reply = Reply(await self._handle(msg))
        except Exception as e:  # the call fails on rank 0, in one line
            reply = Reply(error=f"{type(e).__name__}: {e}")
        if call_id is not None:
            self._send(call_id, reply)

    async def _handle(self, msg):
        if isinstance(msg, Start):
            return await self._start(msg.worker_id)
        node = self.node
        if node is None:
            raise RuntimeError("this rank's agent was never started")
        if isinstance(msg, AddPeer):
            await asyncio.to_thread(node.add_peer, msg.agent, msg.rev, msg.metadata)
        elif isinstance(msg, Write):
            from kvstore.transfer.nixl_agent import Peer

            await node.write(Peer(msg.peer, 0, []), msg.src, msg.local, msg.dst, msg.remote, msg.notif)
        elif isinstance(msg, Expect):
            node.progress.expect(msg.key, msg.fast_for)
        elif isinstance(msg, Unexpect):
            node.progress.unexpect(msg.key)
        else:
            raise TypeError(f"unknown message {type(msg).__name__}")
        return None

    async def _start(self, worker_id: str) -> Started:
        if self.node is None:
            from kvstore.transfer.nixl_agent import NixlNode, region_of

            node = NixlNode(worker_id)
            # the notifications our agent gets go to rank 0; what is expected stays until it says
            node.progress = Progress(node.agent, lambda got: self._send(None, Notified(got)))
            self.region = await asyncio.to_thread(region_of, node, "kv", self.tensor)
            self.node = node
        return Started(self.node.name, self.node.agent.get_agent_metadata(), self.region)

    def _send(self, call_id: int | None, msg) -> None:
        with contextlib.suppress(OSError):  # rank 0 is gone: so are we, soon
            self.conn.send_bytes(pickle.dumps((call_id, msg), protocol=pickle.HIGHEST_PROTOCOL))


# -- rank 0's side ------------------------------------------------------------------------------
class RankAgentLink:
    """Rank 0's end of one helper rank's channel. Calls come from rank 0's event loop; a reader
    thread (started by the first) hands back replies, and notifications to ``on_notifs``."""

    def __init__(self, conn: Connection, rank: int):
        self.conn, self.rank = conn, rank
        self.on_notifs = None  # (Notifs) -> None, called on the loop: rank 0's node._deliver
        self.started: Started | None = None
        self.peers: dict[str, int] = {}  # remote agents the helper added, and their rev
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gone: str | None = None
        self._reader: threading.Thread | None = None

    async def call(self, msg, timeout: float):
        """Send ``msg`` and wait for the helper's answer (``RuntimeError`` if it failed or is gone)."""
        fut = self._open()
        call_id = next(self._ids)
        self._calls[call_id] = fut
        try:
            self._send(call_id, msg)
            reply: Reply = await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            self._calls.pop(call_id, None)
        if reply.error:
            raise RuntimeError(f"rank {self.rank}: {reply.error}")
        return reply.value

    def post(self, msg) -> None:
        """Send ``msg``, no answer (Expect, Unexpect); a helper that is gone is ignored here."""
        if self._gone is None:
            self._open()
            with contextlib.suppress(RuntimeError):
                self._send(None, msg)

    def _open(self) -> asyncio.Future:
        if self._gone is not None:
            raise RuntimeError(self._gone)
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = threading.Thread(target=self._read, name=f"rank{self.rank}-agent", daemon=True)
            self._reader.start()
        return self._loop.create_future()

    def _send(self, call_id: int | None, msg) -> None:
        try:
            self.conn.send_bytes(pickle.dumps((call_id, msg), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._fail(f"rank {self.rank} is gone")
            raise RuntimeError(self._gone) from None

    def _read(self) -> None:
        while True:
            try:
                call_id, msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    self._loop.call_soon_threadsafe(self._fail, f"rank {self.rank} is gone")
                return
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._deliver, call_id, msg)

    def _deliver(self, call_id: int | None, msg) -> None:
        if call_id is None:
            if isinstance(msg, Notified) and self.on_notifs is not None:
                self.on_notifs(msg.got)
            return
        fut = self._calls.get(call_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _fail(self, why: str) -> None:
        self._gone = self._gone or why
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(RuntimeError(why))


# -- a part of a pool, as the transport drives it ----------------------------------------------
@dataclass
class LocalPart:
    """A part in this process's memory, registered by this process's agent (rank 0's own part;
    every part of a pool whose parts are all mapped here, as tests build them)."""

    node: NixlNode
    tensor: Any
    region: Region | None = None

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def rev(self) -> int:
        return self.node.rev

    async def start(self) -> None:
        if self.region is None:
            from kvstore.transfer.nixl_agent import region_of

            self.region = await asyncio.to_thread(region_of, self.node, "kv", self.tensor)

    async def ensure_peer(self, peer: Peer) -> None:
        return None  # ``NixlNode.peer`` added it to our agent

    async def write(self, peer: Peer, local, dst: Region, remote, notif: bytes) -> None:
        await self.node.write(peer, self.region, local, dst, remote, notif)


@dataclass
class RankPart:
    """A part in a helper rank's memory, registered by that rank's agent over its ``link``."""

    link: RankAgentLink
    worker_id: str
    region: Region | None = None
    _adding: dict[str, asyncio.Lock] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.link.started.agent

    @property
    def rev(self) -> int:
        return 1  # one region: its part

    async def start(self) -> None:
        if self.link.started is None:
            self.link.started = await self.link.call(Start(self.worker_id), START_TIMEOUT)
        self.region = self.link.started.region

    def metadata(self):
        from kvstore.transfer.messages import NixlMetadata

        r = self.region
        return NixlMetadata(self.name, self.rev, self.link.started.metadata, [r.kind], [r.addr], [r.size],
                            [r.mem], [r.device])

    async def ensure_peer(self, peer: Peer) -> None:
        async with self._adding.setdefault(peer.agent, asyncio.Lock()):
            if self.link.peers.get(peer.agent, -1) < peer.rev:
                await self.link.call(AddPeer(peer.agent, peer.rev, peer.metadata), CALL_TIMEOUT)
                self.link.peers[peer.agent] = peer.rev

    async def write(self, peer: Peer, local, dst: Region, remote, notif: bytes) -> None:
        try:
            await self.link.call(Write(peer.agent, self.region, local, dst, remote, notif), WRITE_TIMEOUT)
        except RuntimeError:
            self.link.peers.pop(peer.agent, None)  # the helper dropped it: added anew next time
            raise

    # relays for the receiver's node: progress the helper's agent while a write into it may come
    def expect(self, key: bytes, fast_for: float) -> None:
        self.link.post(Expect(key, fast_for))

    def unexpect(self, key: bytes) -> None:
        self.link.post(Unexpect(key))


def part_agents(node: NixlNode, kv, worker_id: str) -> list[LocalPart | RankPart]:
    """One agent per part of ``kv`` (in ``parts()`` order): a helper rank's over its link (the
    part's cache names it: ``owner``), this process's for a part in its own memory."""
    out = []
    for part in kv.parts():
        owner = getattr(part.cache, "owner", None)
        out.append(LocalPart(node, part.cache.tensor) if owner is None else RankPart(owner, worker_id))
    return out
