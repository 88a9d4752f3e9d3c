"""One NIXL agent per worker: the memory it registered, its metadata, the peers it knows, its
notifications, and the handshake that grants a peer one write into its memory.

    receiver (decode)                               sender (prefill, or a peer-fetch holder)
    register(kind, tensor): the whole region, once
    params: agent, rev, region, job gen ----------> usable(params): flat, well formed
                                                    peer(): NixlMetadataRequest (once per agent and
    <--------------- nixl.md ---------------------  rev) -> add_remote_agent; the params' region must
                                                    be one the reply lists (else ``Refused``)
    grant(kind, job, gen, agent): armed, not <----  NixlBegin on nixl.begin
    revoked -> writing
                                                    one-sided WRITE of the descriptors, with the
                                                    notification "{kind}:{job}:{gen}"
    notification from the granted agent -> done <-  (UCX delivers it after the bytes)

Progress: the agent has no progress thread (UCX's busy-polls a core per worker, idle or not).
UCX over TCP moves bytes and notifications only while each side's worker is progressed, the
target's too: the writer drives its side by polling its transfer's state (``_wait_done``), the
receiver from each grant until that write's notification (``_progress``, an asyncio task that
runs only while a granted write may still land). An idle worker costs no CPU.

Nothing here blocks the event loop: registration and posting run in a thread (the agent
serializes its calls: ``NIXL_THREAD_SYNC_STRICT``); a transfer's state is polled with short
asyncio sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from prometheus_client import Counter

from kvstore.transfer import Refused, run_to_end
from kvstore.transfer.messages import NixlBegin, NixlMetadata, NixlMetadataRequest, NixlReply
from kvstore.transfer.messenger import Messenger

log = logging.getLogger(__name__)

try:  # the ``nixl`` extra; without it the mesh moves KV between hosts over nats
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # pragma: no cover - depends on the environment
    nixl_agent = nixl_agent_config = nixl_thread_sync_t = None

REFUSED = Counter("pdmesh_nixl_refused", "nixl transport messages refused (logged and dropped)", ["reason"])
PEERS_KEPT = 64  # remote agents a sender keeps added (least recently used dropped first)
NOTIFS_KEPT = 4096
MD_TIMEOUT = 5.0  # seconds for a peer's metadata or grant
POLL_MIN, POLL_MAX = 0.0001, 0.001  # seconds between polls of a transfer's state (a late look costs a 1 MB write a third)
POST_INLINE = 256  # descriptors posted on the event loop; more are built in a thread
SLOW_AFTER, POLL_SLOW = 10.0, 0.02  # a granted write this old (its writer likely gone): polled gently
AWAIT_MAX = 300.0  # seconds after which an awaited notification is given up (the fence still holds)


def available() -> bool:
    return nixl_agent is not None


def refuse(reason: str, detail: str) -> Refused:
    """Log and count a refusal; the caller raises (or drops) it."""
    log.warning("nixl: refused (%s): %s", reason, detail)
    REFUSED.labels(reason).inc()
    return Refused(detail)


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


Grant = Callable[[str, int, str], str | None]  # (job id, gen, writer agent) -> None, or why not


def notif_key(kind: str, job_id: str, gen: int) -> bytes:
    """The notification that ends a granted write (the writer sends it after its bytes)."""
    return f"{kind}:{job_id}:{gen}".encode()


async def pause(polls: int, since: float) -> None:
    """The wait between two polls of a transfer in flight: ``POLL_MIN`` growing to ``POLL_MAX``
    (never none: a spinning poll takes the CPU the other side needs to move the bytes: measured,
    a 1 MB write 3-5x slower on two busy cores), ``POLL_SLOW`` once it is old."""
    await asyncio.sleep(POLL_SLOW if time.monotonic() - since > SLOW_AFTER else
                        min(POLL_MAX, POLL_MIN * 1.5 ** min(polls, 8)))


class NixlNode:
    """A worker's agent. ``for_worker`` gives every part of one worker (its receiver, its fetch
    channel, its sender) the same node."""

    _nodes: dict[str, NixlNode] = {}

    def __init__(self, worker_id: str):
        if not available():
            raise RuntimeError("NIXL is not installed (pip install 'pdmesh[nixl]')")
        self.name = f"{worker_id}-{secrets.token_hex(4)}"  # a restarted worker is a new agent
        # no progress thread (it spins a core); calls from threads and the loop serialized
        self.agent = nixl_agent(self.name, nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        self.regions: list[Region] = []
        self._reg: dict[int, object] = {}  # addr -> its registration (kept alive)
        self._registering = threading.Lock()  # registration runs in threads
        self.peers: OrderedDict[str, Peer] = OrderedDict()  # remote agents added, by name
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self.grants: dict[str, Grant] = {}  # kind -> the part that arms its jobs
        self.notifs: dict[bytes, str] = {}  # notification -> the agent it came from, until taken
        self.awaited: dict[bytes, float] = {}  # notifications of granted writes -> when granted
        self._progressing: asyncio.Task | None = None
        self._served = False
        self.bus: Messenger | None = None  # the one that serves our handshake

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
        if msg.agent != self.name:  # the asker sees our name and refuses its job
            log.info("nixl: metadata asked of agent %r, this is %r", msg.agent, self.name)
        await self.bus.respond(raw, self.metadata())

    async def _on_begin(self, msg: NixlBegin, raw) -> None:
        grant = self.grants.get(msg.kind)
        why = "no such kind of job" if grant is None else grant(msg.job_id, msg.gen, msg.agent)
        if why is not None:
            log.info("nixl: no write grant for %s %s: %s", msg.kind, msg.job_id, why)
        else:
            self.expect(notif_key(msg.kind, msg.job_id, msg.gen))
        await self.bus.respond(raw, NixlReply(why is None, why or ""))

    # -- progress ------------------------------------------------------------------
    def expect(self, key: bytes) -> None:
        """A write was granted: progress the agent until its notification ``key`` comes."""
        self.awaited[key] = time.monotonic()
        if self._progressing is None or self._progressing.done():
            self._progressing = asyncio.get_running_loop().create_task(self._progress())

    async def _progress(self) -> None:
        polls, newest = 0, 0.0
        while self.awaited:
            self.poll_notifs()
            now = time.monotonic()
            for key, at in list(self.awaited.items()):
                if now - at > AWAIT_MAX:  # its writer is long gone; its blocks stay fenced
                    log.warning("nixl: no notification %r in %.0f s: no longer awaited", key, AWAIT_MAX)
                    del self.awaited[key]
            latest = max(self.awaited.values(), default=now)
            if latest > newest:  # a new grant: poll it promptly, whatever older ones wait for
                polls, newest = 0, latest
            await pause(polls, newest)
            polls += 1

    # -- notifications -------------------------------------------------------------
    def poll_notifs(self) -> None:
        """Move the agent's new notifications into ``notifs`` (a quick call: no waiting)."""
        for agent, msgs in self.agent.get_new_notifs().items():
            who = agent.decode() if isinstance(agent, bytes) else str(agent)
            for m in msgs:
                self.notifs[bytes(m)] = who
                self.awaited.pop(bytes(m), None)
        while len(self.notifs) > NOTIFS_KEPT:  # late ones of jobs long forgotten
            self.notifs.pop(next(iter(self.notifs)))

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
            self.peers[agent] = peer = Peer(agent, md.rev, regions)
            while len(self.peers) > PEERS_KEPT:
                self.drop_peer(next(iter(self.peers)))
            return peer

    def _add(self, md: NixlMetadata) -> None:
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(md.agent)  # it registered more: its metadata anew
        self.agent.add_remote_agent(md.metadata)

    def drop_peer(self, agent: str) -> None:
        """Forget a remote agent (it left, or a transfer to it failed): asked anew next time."""
        if self.peers.pop(agent, None) is not None:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(agent)

    async def ask_grant(self, bus: Messenger, begin_subject: str, kind: str, job_id: str, gen: int) -> None:
        reply = await bus.request(begin_subject, NixlBegin(kind, job_id, gen, self.name), NixlReply, MD_TIMEOUT)
        if not reply.ok:
            raise RuntimeError(f"the receiver gave no write grant: {reply.error}")

    # -- writing -------------------------------------------------------------------
    async def write(self, peer: Peer, src: Region, local: list[tuple[int, int]], dst: Region,
                    remote: list[tuple[int, int]], notif: bytes) -> None:
        """One-sided WRITE of ``local`` (addr, len) pieces into ``remote``'s, then ``notif`` to the
        peer. Returns once the transfer is done; the wait outlives a cancellation (the bytes may
        still be landing: the receiver's fence holds the memory until the notification)."""
        if len(local) <= POST_INLINE:  # a few descriptors post in microseconds: no thread hop
            handle = self._post(peer, src, local, dst, remote, notif)
        else:
            handle = await asyncio.to_thread(self._post, peer, src, local, dst, remote, notif)
        await run_to_end(self._wait_done(peer, handle))

    def _post(self, peer: Peer, src: Region, local, dst: Region, remote, notif: bytes):
        src_descs = self.agent.get_xfer_descs([(a, n, src.device) for a, n in local], src.mem)
        dst_descs = self.agent.get_xfer_descs([(a, n, dst.device) for a, n in remote], dst.mem)
        handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer.agent, notif)
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused to post the transfer")
        return handle

    async def _wait_done(self, peer: Peer, handle) -> None:
        polls, since = 0, time.monotonic()
        try:
            while True:
                state = self.agent.check_xfer_state(handle)  # progresses our side of it
                if state == "DONE":
                    return
                if state == "ERR":
                    self.drop_peer(peer.agent)
                    raise RuntimeError(f"the NIXL transfer to {peer.agent} failed")
                await pause(polls, since)
                polls += 1
        finally:
            with contextlib.suppress(Exception):
                self.agent.release_xfer_handle(handle)


# -- the receiving side of a kind of write -----------------------------------------
class JobState(Enum):
    ARMED = 1  # params handed out: no write granted yet
    WRITING = 2  # a writer has its grant: bytes may land until its notification
    DONE = 3  # the notification came
    REVOKED = 4  # given up before any grant: none will be given


@dataclass
class WriteJob:
    gen: int
    state: JobState = JobState.ARMED
    writer: str = ""


J = TypeVar("J", bound=WriteJob)


class Grants(Generic[J]):
    """The writes of one kind into a node's memory ("kv": the decode worker's pool; "fetch": a
    requester's fetch buffer). A job is armed with a fresh generation (``arm``), granted once to
    one writer (``NixlBegin``: the node asks ``_grant``), and done when that writer's
    notification came (``landed``). Who holds the memory: the caller, until ``landed`` or a
    revoke before any grant (``revoke``)."""

    def __init__(self, node: NixlNode, kind: str):
        self.node, self.kind = node, kind
        self.jobs: dict[str, J] = {}
        self._gen = 0
        node.grants[kind] = self._grant

    def next_gen(self) -> int:
        self._gen = self._gen % (1 << 62) + 1
        return self._gen

    def _grant(self, job_id: str, gen: int, agent: str) -> str | None:
        job = self.jobs.get(job_id)
        if job is None or job.gen != gen:
            return f"no such {self.kind} job armed (late, or forged)"
        if job.state is not JobState.ARMED:
            return f"the {self.kind} job is {job.state.name.lower()}"
        job.state, job.writer = JobState.WRITING, agent
        return None

    def landed(self, job_id: str, job: J) -> bool:
        """Has the writer's notification come (then the job is DONE)?"""
        if job.state is JobState.WRITING:
            who = self.node.take_notif(notif_key(self.kind, job_id, job.gen))
            if who is not None and who != job.writer:
                refuse("unknown_agent", f"a completion of {self.kind} {job_id} from {who!r}, not its writer")
            elif who is not None:
                job.state = JobState.DONE
        return job.state is JobState.DONE

    async def wait(self, job_id: str, job: J, timeout: float) -> bool:
        """Wait (up to ``timeout``) for a granted job's notification; False if it was never
        granted or did not come in time."""
        end, polls, since = time.monotonic() + timeout, 0, time.monotonic()
        while not self.landed(job_id, job):
            if job.state is not JobState.WRITING or time.monotonic() > end:
                return False
            await pause(polls, since)
            polls += 1
        return True

    def revoke(self, job_id: str) -> bool:
        """No write will land any more: True for a job never granted (its grant is refused from
        now on) or one whose notification came; False while a granted write may still land."""
        job = self.jobs.get(job_id)
        if job is None:
            return True
        if job.state is JobState.ARMED:
            job.state = JobState.REVOKED
        return job.state is not JobState.WRITING or self.landed(job_id, job)
