"""One NIXL agent per worker: the memory it registered, its metadata, the peers it knows, its
notifications, and the handshake that grants a peer one write into its memory.

    receiver (decode)                               sender (prefill, or a peer-fetch holder)
    register(kind, tensor): the whole region, once
    params: agent, rev, region, job gen ----------> usable(params): flat, well formed
                                                    peer(): NixlMetadataRequest (once per agent and
    <--------------- nixl.md ---------------------  rev) -> add_remote_agent; the params' region must
                                                    be one the reply lists (else ``Refused``)
    grant(kind, job, gen, agent): armed, not <----  NixlBegin on nixl.begin (a kv job's when the
    revoked -> writing                              prefill worker takes it: ``NixlSender.prepare``)
    progress fast for GRANT_FAST_FOR, then gently   (a write that starts later than that:)
    progress fast <-------------------------------  NixlBegin(writing=True), published: the write
                                                    of a grant asked ahead starts
                                                    one-sided WRITE of the descriptors, with the
                                                    notification "{kind}:{job}:{gen}"
    notification from the granted agent -> done <-  (UCX delivers it after the bytes)
    (with a carried payload: on_done(job, payload))  (the writer's PrefillDone, ``carrying``)

Progress: the agent has no progress thread (UCX's busy-polls a core per worker, idle or not).
UCX over TCP moves bytes and notifications only while each side's worker is progressed, the
target's too: ``nixl_progress.Progress`` polls the writer's transfers until they are done and
the receiver's notifications from each grant until that write's notification came, in a thread
that runs only while one is in flight. An idle worker costs no CPU.

Nothing here blocks the event loop: registration and posting run in a thread (the agent
serializes its calls: ``NIXL_THREAD_SYNC_STRICT``); completions come from the progress thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from prometheus_client import Counter

from kvstore.transfer import Refused, run_to_end
from kvstore.transfer.messages import NixlBegin, NixlMetadata, NixlMetadataRequest, NixlReply
from kvstore.transfer.messenger import Messenger
from kvstore.transfer.nixl_parts import PairNotifs, split_part_key
from kvstore.transfer.nixl_progress import FAST_FOR, GRANT_FAST_FOR, Notifs, Progress

log = logging.getLogger(__name__)

try:  # the ``nixl`` extra; without it the mesh moves KV between hosts over nats
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # pragma: no cover - depends on the environment
    nixl_agent = nixl_agent_config = nixl_thread_sync_t = None

REFUSED = Counter("pdmesh_nixl_refused", "nixl transport messages refused (logged and dropped)", ["reason"])
PEERS_KEPT = 64  # remote agents a sender keeps added (least recently used dropped first)
NOTIFS_KEPT = 4096
MD_TIMEOUT = 5.0  # seconds for a peer's metadata or grant
POST_INLINE = 256  # descriptors posted on the event loop; more are built in a thread
CARRY_MAX = 4096  # bytes a notification may carry besides its key (a PrefillDone: ~100-300)
# UCX settings a worker's agent gets, each group only when its environment names none of them (UCX
# reads them when the agent is made; an RX segment smaller than the TX one fails the backend):
# TCP copy-out segments of 256k, not 8k/64k (16 MB writes ran at half the speed with those;
# irrelevant over RDMA). docs/operations.md, "NIXL/UCX between hosts".
UCX_DEFAULTS = ({"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"},)


def available() -> bool:
    return nixl_agent is not None


def refuse(reason: str, detail: str) -> Refused:
    """Log and count a refusal; the caller raises (or drops) it."""
    log.warning("nixl: refused (%s): %s", reason, detail)
    REFUSED.labels(reason).inc()
    return Refused(detail)


def agent_name(worker_id: str) -> str:
    """A worker's agent: its id and a fresh suffix (a restarted worker is a new agent)."""
    return f"{worker_id}-{secrets.token_hex(4)}"


def agent_worker(agent: str) -> str:
    """The worker id in an agent's name (``agent_name``'s inverse)."""
    return agent.rpartition("-")[0]


class Writes(Protocol):
    """The writes of one kind into a node's memory, as the node sees them (``nixl_grants.Grants``)."""

    on_done: object  # None, or what takes a carried payload

    def grant(self, job_id: str, gen: int, agent: str) -> str | None: ...

    def carried(self, key: bytes, who: str, payload: bytes) -> None: ...


@dataclass(frozen=True)
class Region:
    kind: str  # "kv" | "fetch"
    addr: int
    size: int
    mem: str = "DRAM"  # VRAM on a GPU
    device: int = 0

    def holds(self, addr: int, size: int) -> bool:
        return self.addr <= addr and size >= 0 and addr + size <= self.addr + self.size


@dataclass
class Peer:
    agent: str
    rev: int
    regions: list[Region]
    metadata: bytes = b""  # its agent metadata (a helper rank's agent adds it too: ``nixl_ranks``)


def notif_key(kind: str, job_id: str, gen: int) -> bytes:
    """The notification that ends a granted write (the writer sends it after its bytes)."""
    return f"{kind}:{job_id}:{gen}".encode()


def carrying(key: bytes, payload: bytes) -> bytes:
    """Notification ``key`` with ``payload`` after it: a NUL, the key's length (2 bytes), the key,
    the payload (a plain key never starts with NUL; job ids and payloads may hold any byte)."""
    if not payload:
        return key
    return b"\0" + len(key).to_bytes(2, "little") + key + payload


def carried(notif: bytes) -> tuple[bytes, bytes]:
    """(key, payload) of a notification (``carrying``'s inverse; payload b"" when none)."""
    if not notif.startswith(b"\0"):
        return notif, b""
    n = int.from_bytes(notif[1:3], "little")
    return notif[3: 3 + n], notif[3 + n:]


class NixlNode:
    """A worker's agent. ``for_worker`` gives every part of one worker (its receiver, its fetch
    channel, its sender) the same node."""

    _nodes: dict[str, NixlNode] = {}

    def __init__(self, worker_id: str):
        if not available():
            raise RuntimeError("NIXL is not installed (pip install 'pdmesh[nixl]')")
        self.name = agent_name(worker_id)
        for group in UCX_DEFAULTS:
            if not any(key in os.environ for key in group):
                os.environ.update(group)
        # no progress thread (it spins a core); calls from threads and the loop serialized
        self.agent = nixl_agent(self.name, nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        self.regions: list[Region] = []
        self._reg: dict[int, object] = {}  # addr -> its registration (kept alive)
        self._registering = threading.Lock()  # registration runs in threads
        self.peers: OrderedDict[str, Peer] = OrderedDict()  # remote agents added, by name
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self.writes: dict[str, Writes] = {}  # kind -> the writes of that kind into our memory
        self.notifs: dict[bytes, str] = {}  # notification -> the agent it came from, until taken
        self._arrived: dict[bytes, asyncio.Event] = {}  # notifications someone waits for
        self.progress = Progress(self.agent, self._deliver)
        self._served = False
        self.bus: Messenger | None = None  # the one that serves our handshake
        # A worker of several ranks: its helper ranks' agents, whose metadata we answer for on our
        # subject, and whose notifications they forward to us (``nixl_ranks``); ``relays`` progress
        # them while a write into their part is expected.
        self.proxies: dict[str, NixlMetadata] = {}
        self.relays: list = []
        self.pairs = PairNotifs()

    @classmethod
    def for_worker(cls, worker_id: str) -> NixlNode:
        node = cls._nodes.get(worker_id)
        if node is None:
            node = cls._nodes[worker_id] = cls(worker_id)
        return node

    @property
    def rev(self) -> int:
        return len(self.regions)

    # -- our memory ----------------------------------------------------------------
    def registered(self, addr: int, size: int) -> Region | None:
        return next((r for r in self.regions if r.addr == addr and r.size == size), None)

    def register(self, kind: str, addr: int, size: int, mem: str = "DRAM", device: int = 0) -> Region:
        """Register one region (once per address: the whole KV pool, or the fetch buffers)."""
        with self._registering:
            for r in self.regions:
                if r.addr == addr and r.size == size:
                    return r
            self._reg[addr] = self.agent.register_memory([(addr, size, device, "")], mem)
            region = Region(kind, addr, size, mem, device)
            self.regions.append(region)
            return region

    def metadata(self) -> NixlMetadata:
        rs = self.regions
        return NixlMetadata(self.name, self.rev, self.agent.get_agent_metadata(), [r.kind for r in rs],
                            [r.addr for r in rs], [r.size for r in rs], [r.mem for r in rs], [r.device for r in rs])

    async def serve(self, bus: Messenger, model: str, worker_id: str) -> None:
        """Answer metadata requests and write grants (once per worker; its parts share it)."""
        if self._served:
            return
        self._served = True
        self.bus = bus
        s = bus.subjects
        await bus.subscribe(s.nixl(model, worker_id, "md"), self._on_md, NixlMetadataRequest)
        await bus.subscribe(s.nixl(model, worker_id, "begin"), self._on_begin, NixlBegin)
        await bus.flush(timeout=5)  # subscribed at the server before a job names them

    async def _on_md(self, msg: NixlMetadataRequest, raw) -> None:
        md = self.proxies.get(msg.agent)
        if md is None and msg.agent != self.name:  # the asker sees our name and refuses its job
            log.info("nixl: metadata asked of agent %r, this is %r", msg.agent, self.name)
        await self.bus.respond(raw, md or self.metadata())

    async def _on_begin(self, msg: NixlBegin, raw) -> None:
        if msg.writing:  # a granted writer starts its bytes: poll for them fast (no answer)
            key = notif_key(msg.kind, msg.job_id, msg.gen)
            if self.progress.expected(key):
                self.progress.kick()
                for relay in self.relays:
                    relay.expect(key, FAST_FOR)  # (again: fast polls from now)
            return
        writes = self.writes.get(msg.kind)
        why = "no such kind of job" if writes is None else writes.grant(msg.job_id, msg.gen, msg.agent)
        if why is not None:
            log.info("nixl: no write grant for %s %s: %s", msg.kind, msg.job_id, why)
        else:  # its write may come soon (a short prefill's): poll fast for a while
            self.expect(notif_key(msg.kind, msg.job_id, msg.gen), GRANT_FAST_FOR)
        await self.bus.respond(raw, NixlReply(why is None, why or ""))

    # -- notifications -------------------------------------------------------------
    def expect(self, key: bytes, fast_for: float = FAST_FOR) -> None:
        """A write was granted: progress the agent (and our helper ranks') until its notification
        ``key`` comes (all of its pairs' notifications, for a write of several: ``nixl_parts``)."""
        self.progress.expect(key, fast_for)
        for relay in self.relays:
            relay.expect(key, fast_for)

    def unexpect(self, key: bytes) -> None:
        """The write of ``key`` will not land (its writer is gone), or it has: stop progressing for it."""
        self.progress.unexpect(key)
        self.pairs.forget(key)
        for relay in self.relays:
            relay.unexpect(key)

    def poll_notifs(self) -> None:
        """Move the agent's new notifications into ``notifs`` (a quick call: no waiting)."""
        self._deliver(self.agent.get_new_notifs())

    def _deliver(self, got: Notifs) -> None:
        """Notifications from our agent's progress, or forwarded by a helper rank's (on the loop)."""
        for agent, msgs in got.items():
            who = agent.decode() if isinstance(agent, bytes) else str(agent)
            for m in msgs:
                key, payload = carried(bytes(m))
                if split_part_key(key) is not None:  # one pair of a write of several
                    try:
                        whole = self.pairs.add(key, who, payload)
                    except ValueError as e:
                        refuse("malformed", f"a notification from {who!r}: {e}")
                        continue
                    if whole is None:
                        continue  # more pairs to come
                    key, who, payload = whole
                self.notifs[key] = who
                self.unexpect(key)
                if (event := self._arrived.pop(key, None)) is not None:
                    event.set()
                if payload:
                    self._carried(key, who, payload)
        while len(self.notifs) > NOTIFS_KEPT:  # late ones of jobs long forgotten
            self.notifs.pop(next(iter(self.notifs)))

    def _carried(self, key: bytes, who: str, payload: bytes) -> None:
        kind = key.partition(b":")[0].decode(errors="replace")
        writes = self.writes.get(kind)
        if writes is None:
            return  # no writes of this kind: the notification alone counts
        if len(payload) > CARRY_MAX:
            refuse("oversized", f"a {kind} notification from {who!r} carries {len(payload)} bytes")
            return
        if writes.on_done is None:
            return  # nobody takes payloads of this kind
        try:
            writes.carried(key, who, payload)
        except Exception:  # the sender's message over NATS still comes
            log.exception("nixl: a carried payload of %r was not taken", key)

    async def arrival(self, key: bytes, timeout: float) -> bool:
        """Wait (up to ``timeout``) until notification ``key`` has come; it stays in ``notifs``."""
        if key in self.notifs:
            return True
        event = self._arrived.setdefault(key, asyncio.Event())
        self.expect(key)
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except TimeoutError:
            return key in self.notifs
        finally:
            if self._arrived.get(key) is event and not event.is_set():
                del self._arrived[key]

    def take_notif(self, key: bytes) -> str | None:
        """The agent that sent notification ``key`` (and forget it), or None if it has not come."""
        if key not in self.notifs:
            self.poll_notifs()
        return self.notifs.pop(key, None)

    # -- peers ---------------------------------------------------------------------
    async def peer(self, bus: Messenger, md_subject: str, agent: str, rev: int) -> Peer:
        """The remote agent ``agent`` added (its metadata asked on ``md_subject`` the first time, or
        when it has registered more since); ``Refused`` when the subject's worker is another agent."""
        peer = self.peers.get(agent)
        if peer is not None and peer.rev >= rev:
            self.peers.move_to_end(agent)
            return peer
        async with self._peer_locks.setdefault(agent, asyncio.Lock()):
            peer = self.peers.get(agent)
            if peer is not None and peer.rev >= rev:
                return peer
            try:
                md = await bus.request(md_subject, NixlMetadataRequest(agent), NixlMetadata, MD_TIMEOUT)
            except Exception as e:  # no responders, a timeout: the peer left (or never was)
                self.drop_peer(agent)
                raise RuntimeError(f"no agent answers on {md_subject} ({type(e).__name__})") from None
            if md.agent != agent:
                raise refuse("unknown_agent", f"{md_subject} is agent {md.agent!r}, not {agent!r}")
            if not len(md.kinds) == len(md.addrs) == len(md.sizes) == len(md.mems) == len(md.devices):
                raise refuse("malformed", f"agent {agent!r} lists regions of unequal parts")
            await asyncio.to_thread(self._add, md)
            regions = [Region(*r) for r in zip(md.kinds, md.addrs, md.sizes, md.mems, md.devices, strict=True)]
            self.peers[agent] = peer = Peer(agent, md.rev, regions, md.metadata)
            while len(self.peers) > PEERS_KEPT:
                self.drop_peer(next(iter(self.peers)))
            return peer

    def _add(self, md: NixlMetadata) -> None:
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(md.agent)  # it registered more: its metadata anew
        self.agent.add_remote_agent(md.metadata)

    def add_peer(self, agent: str, rev: int, metadata: bytes) -> None:
        """Add a remote agent whose metadata came another way (a helper rank's, from its rank 0)."""
        self._add(NixlMetadata(agent, rev, metadata, [], [], [], [], []))
        self.peers[agent] = Peer(agent, rev, [], metadata)

    def drop_peer(self, agent: str) -> None:
        """Forget a remote agent (it left, or a transfer to it failed): asked anew next time."""
        if self.peers.pop(agent, None) is not None:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(agent)

    async def ask_grant(self, bus: Messenger, begin_subject: str, kind: str, job_id: str, gen: int) -> None:
        reply = await bus.request(begin_subject, NixlBegin(kind, job_id, gen, self.name), NixlReply, MD_TIMEOUT)
        if not reply.ok:
            raise RuntimeError(f"the receiver gave no write grant: {reply.error}")

    async def writing(self, bus: Messenger, begin_subject: str, kind: str, job_id: str, gen: int) -> None:
        """Tell the receiver (one way) that the granted write starts now."""
        await bus.publish(begin_subject, NixlBegin(kind, job_id, gen, self.name, writing=True), traced=False)
        # one turn of the loop: the client's flusher sends it now, before posting holds the loop
        # (a 1 MB post pushes its bytes into the socket: 0.4-1.3 ms on a busy machine)
        await asyncio.sleep(0)

    # -- writing -------------------------------------------------------------------
    async def write(self, peer: Peer, src: Region, local: list[tuple[int, int]], dst: Region,
                    remote: list[tuple[int, int]], notif: bytes) -> None:
        """One-sided WRITE of ``local`` (addr, len) pieces into ``remote``'s, then ``notif`` to the
        peer. Returns once the transfer is done; the wait outlives a cancellation (the bytes may
        still be landing: the receiver's fence holds the memory until the notification)."""
        # posting pushes what the socket takes at once (a 1 MB write: 0.4-1.3 ms measured on a
        # busy machine), as long as a thread hop would cost there; many descriptors: in a thread.
        # Inline, the post and the watch happen before this coroutine first yields (no task made
        # first, no loop turn before the progress thread drives the rest of the bytes), so a
        # cancellation can only come once the wait is shielded.
        if len(local) <= POST_INLINE:
            handle = self._post(peer, src, local, dst, remote, notif)
            await run_to_end(self._wait_done(peer, handle, self.progress.watch(handle)))
        else:
            await run_to_end(self._post_in_thread(peer, src, local, dst, remote, notif))

    async def _post_in_thread(self, peer: Peer, src: Region, local, dst: Region, remote, notif: bytes) -> None:
        handle = await asyncio.to_thread(self._post, peer, src, local, dst, remote, notif)
        await self._wait_done(peer, handle, self.progress.watch(handle))

    def _post(self, peer: Peer, src: Region, local, dst: Region, remote, notif: bytes):
        src_descs = self.agent.get_xfer_descs(_descs(local, src.device), src.mem)
        dst_descs = self.agent.get_xfer_descs(_descs(remote, dst.device), dst.mem)
        handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer.agent, notif)
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused to post the transfer")
        return handle

    async def _wait_done(self, peer: Peer, handle, done: asyncio.Future) -> None:
        try:
            await done  # the progress thread drives it to DONE or ERR
        except RuntimeError:
            self.drop_peer(peer.agent)
            raise RuntimeError(f"the NIXL transfer to {peer.agent} failed") from None
        finally:
            with contextlib.suppress(Exception):
                self.agent.release_xfer_handle(handle)


def region_of(node: NixlNode, kind: str, tensor) -> Region:
    """Register a contiguous tensor (a KV pool, or a rank's part of one) with ``node``'s agent."""
    if not tensor.is_contiguous():
        raise ValueError("the nixl transport registers contiguous KV tensors only")
    mem = "VRAM" if tensor.is_cuda else "DRAM"
    return node.register(kind, tensor.data_ptr(), tensor.numel() * tensor.element_size(), mem,
                         tensor.device.index or 0 if tensor.is_cuda else 0)


def _descs(pieces, device: int):
    """(addr, len) pieces, a list or an ``[n, 2]`` array, as NIXL takes them: (addr, len, device)."""
    if isinstance(pieces, np.ndarray):
        rows = np.empty((len(pieces), 3), dtype=np.uint64)
        rows[:, :2] = pieces
        rows[:, 2] = device
        return rows
    return [(a, n, device) for a, n in pieces]
