"""``nccl``: GPU, any node. One two-rank NCCL communicator per (prefill, decode)
pair, prefill rank 0, decode rank 1. The prefill worker gathers a request's
blocks block-major and sends them; the decode worker receives them into a
staging buffer and scatters them into the destination blocks.

The rendezvous and the per-request handshake are NATS requests to the decode
worker (CuPy's ``cupy.cuda.nccl``, imported on first use; the communicators and
the daemon threads around them are ``kvstore.transfer.nccl_comm``):

    prefill                                       decode
    first use of a decode worker:
      NcclConnect(session, unique id) ---------->  reply, then join as rank 1 (a thread)
      join as rank 0 (a thread)                    (both joins return once both ranks are in)
    each transfer, one at a time per communicator:
      NcclBegin(session, request, bytes, chunk) ->  check it against params(), allocate the
                                                    staging buffer, reply, post the recvs
      gather + send chunk by chunk, wait
      PrefillDone (kv_ready) ------------------->  finish(): wait for the recvs, scatter, True

The decode side replies before it posts (or joins): NCCL connects a pair lazily
inside the first send/recv, which returns only once the peer takes part.
NCCL matches one pair's sends and recvs in order, so a communicator carries one
transfer at a time (an asyncio.Lock on the sender).

Every call that can block on the peer runs in a daemon thread (a dead peer
must hang neither the event loop nor interpreter exit); completion is polled
from the event loop against a deadline. A transfer that fails or times out
aborts its communicator on both sides, and the next one connects anew. An
aborted recv also "completes", so the decode side scatters only a recv it saw
complete before any abort was asked for.

Who frees what: the staging buffer lives from NcclBegin to ``finish()`` or
``forget()``; the destination blocks belong to the decode worker (see
decode/worker.py), which calls ``forget()`` once it stops waiting, and a
``forget()`` during a transfer aborts the communicator, so nothing lands after.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected") unless the two
processes look like different hosts to it (different ``NCCL_HOSTID``) or NCCL
>= 2.30 is told to allow it (``NCCL_MULTI_RANK_GPU_ENABLE=1``); ``usable()``
says no otherwise. On one node ``cuda_ipc`` is the transport to use anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.cache import KVCache, KVCacheSpec
from kvstore.transfer import TransferResult, TransferTarget, register_receiver, register_sender
from kvstore.transfer.cuda_ipc import device_uuid
from kvstore.transfer.messages import NcclBegin, NcclConnect, NcclReply
from kvstore.transfer.messenger import Messenger
from kvstore.transfer.nccl_comm import (
    abort_soon,
    in_daemon_thread,
    multi_rank_gpu_allowed,
    nccl_host,
    nccl_module,
    new_communicator,
    unique_id,
    wait_event,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 20  # the sender gathers and sends this much at a time (whole blocks)
UNIQUE_ID_BYTES = 128
CONNECT_TIMEOUT = 5.0  # NcclConnect request/reply
INIT_TIMEOUT = 60.0  # both ranks joined
READY_TIMEOUT = 10.0  # decode side: NcclBegin waits this long for its own join to finish
BEGIN_TIMEOUT = READY_TIMEOUT + 5.0
SEND_TIMEOUT = 120.0  # the prefill worker's deadline usually ends a transfer first
RECV_TIMEOUT = 300.0  # a posted recv whose bytes never come is aborted after this
FINISH_TIMEOUT = 30.0  # PrefillDone came: the sends are done, the recvs are about to be
SCATTER_TIMEOUT = 30.0
UNKNOWN_SESSION = "unknown session"  # the decode side dropped the communicator (a timeout, a restart)


def _same_gpu_refused(params: dict, device: int) -> bool:
    """Would NCCL refuse this pair as two ranks on one GPU?"""
    return (
        params.get("nccl_host") == nccl_host()
        and params.get("device_uuid") == device_uuid(device)
        and not multi_rank_gpu_allowed()
    )


# -- decode side -----------------------------------------------------------------


@dataclass
class _Peer:
    """Our end of the communicator with one prefill worker."""

    session: str
    sender: str
    joined: asyncio.Future  # -> True once both ranks are in
    comm: Any = None
    stream: torch.cuda.Stream | None = None
    aborted: bool = False
    post_lock: threading.Lock = field(default_factory=threading.Lock)  # recvs posted in order


@dataclass
class _Incoming:
    """One request's bytes: expected at params(), begun by NcclBegin, scattered by finish()."""

    dest_blocks: list[int]
    nbytes: int
    peer: _Peer | None = None
    staging: torch.Tensor | None = None
    received: asyncio.Task | None = None  # done once every recv completed (or failed)


@register_receiver("nccl")
class NcclReceiver:
    name = "nccl"

    def __init__(self, kv: KVCache, bus: Messenger, model: str, worker_id: str, **_):
        if kv.device.type != "cuda":
            raise ValueError("the nccl transport needs a KV cache on a CUDA device")
        if nccl_module() is None:
            raise ValueError("the nccl transport needs CuPy with NCCL")
        self.kv = kv
        self.bus = bus
        self.device = kv.tensor.device.index
        self.connect_subject = bus.subjects.nccl(model, worker_id, "connect")
        self.begin_subject = bus.subjects.nccl(model, worker_id, "begin")
        self._static = {
            "connect": self.connect_subject, "begin": self.begin_subject,
            "incarnation": secrets.token_hex(8),  # a restarted worker is a new peer
            "spec": kv.spec.to_dict(), "nccl_host": nccl_host(), "device_uuid": device_uuid(self.device),
        }
        self._peers: dict[str, _Peer] = {}  # session -> peer
        self._incoming: dict[str, _Incoming] = {}  # request id -> its transfer
        self._scatter_stream = torch.cuda.Stream(device=kv.tensor.device)
        self._subs: list = []

    async def start(self) -> None:
        self._subs = [
            await self.bus.subscribe(self.connect_subject, self._on_connect, NcclConnect),
            await self.bus.subscribe(self.begin_subject, self._on_begin, NcclBegin),
        ]
        await self.bus.flush(timeout=5)  # subscribed at the server before anyone can ask

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for peer in list(self._peers.values()):
            self._drop(peer, "closing")

    def params(self, request_id: str, dest_blocks: list[int]) -> dict:
        nbytes = len(dest_blocks) * self.kv.spec.block_bytes
        self._incoming[request_id] = _Incoming(list(dest_blocks), nbytes)
        return {**self._static, "bytes": nbytes}

    # -- rendezvous ---------------------------------------------------------------
    async def _on_connect(self, msg: NcclConnect, raw) -> None:
        if len(msg.unique_id) != UNIQUE_ID_BYTES or msg.session in self._peers:
            await self.bus.respond(raw, NcclReply(False, "bad unique id or session"))
            return
        for old in [p for p in self._peers.values() if p.sender == msg.sender]:
            self._drop(old, "replaced by a new session of its sender")
        loop = asyncio.get_running_loop()
        peer = _Peer(msg.session, msg.sender, loop.create_future())
        self._peers[msg.session] = peer
        await self.bus.respond(raw, NcclReply(True))
        with contextlib.suppress(Exception):
            await self.bus.flush(timeout=2)  # the reply is out before a join could hold the GIL
        joining = in_daemon_thread(self._join, msg.unique_id)
        joining.add_done_callback(lambda f: self._joined(peer, f))
        loop.call_later(INIT_TIMEOUT, self._join_timeout, peer)

    def _join(self, uid: bytes) -> tuple[Any, torch.cuda.Stream]:
        comm = new_communicator(uid, 1, self.device)
        return comm, torch.cuda.Stream(device=torch.device("cuda", self.device))

    def _joined(self, peer: _Peer, f: asyncio.Future) -> None:
        if f.cancelled():
            return
        if f.exception() is not None:
            log.warning("nccl: joining session %s failed: %s", peer.session, f.exception())
            self._drop(peer, "join failed")
            return
        peer.comm, peer.stream = f.result()
        if peer.aborted:  # dropped while joining
            abort_soon(peer.comm)
        elif not peer.joined.done():
            peer.joined.set_result(True)
            log.info("nccl: session %s joined (rank 1 on cuda:%s)", peer.session, self.device)

    def _join_timeout(self, peer: _Peer) -> None:
        if not peer.joined.done():
            self._drop(peer, "the sender never joined")  # a join that ends later is aborted in _joined

    def _drop(self, peer: _Peer, why: str) -> None:
        """Abort a peer's communicator; its pending recvs fail, and the sender must connect anew."""
        if self._peers.get(peer.session) is peer:
            del self._peers[peer.session]
        if peer.aborted:
            return
        peer.aborted = True  # before the abort, so a completion seen from now on is not trusted
        log.info("nccl: dropping session %s (%s)", peer.session, why)
        if not peer.joined.done():
            peer.joined.set_exception(RuntimeError(f"session dropped: {why}"))
            peer.joined.exception()  # retrieved: no "never retrieved" warning
        abort_soon(peer.comm)

    # -- transfers ------------------------------------------------------------------
    async def _on_begin(self, msg: NcclBegin, raw) -> None:
        inc = self._incoming.get(msg.request_id)
        error = await self._prepare(msg, inc)
        if error is None and (self._incoming.get(msg.request_id) is not inc or inc.peer.aborted):
            error = "forgotten or dropped while preparing"
        await self.bus.respond(raw, NcclReply(error is None, error or ""))
        if error is None:
            # posted after the reply: the first recv of a pair waits inside NCCL for the first send
            inc.received = asyncio.create_task(self._receive(inc, msg.chunk_bytes))
            inc.received.add_done_callback(_retrieve)

    async def _prepare(self, msg: NcclBegin, inc: _Incoming | None) -> str | None:
        peer = self._peers.get(msg.session)
        if peer is None:
            return UNKNOWN_SESSION
        if inc is None or inc.peer is not None:
            return "no transfer expected for this request"
        if msg.nbytes != inc.nbytes or msg.chunk_bytes <= 0 or msg.chunk_bytes % self.kv.spec.block_bytes:
            return f"expected {inc.nbytes} bytes in whole blocks, got {msg.nbytes} in chunks of {msg.chunk_bytes}"
        inc.peer = peer  # taken: a second NcclBegin for this request is refused
        try:
            await asyncio.wait_for(asyncio.shield(peer.joined), READY_TIMEOUT)
        except Exception as e:
            return f"communicator not ready: {e}"
        try:
            inc.staging = await asyncio.to_thread(
                torch.empty, inc.nbytes, dtype=torch.uint8, device=torch.device("cuda", self.device)
            )
        except torch.cuda.OutOfMemoryError:
            return f"no GPU memory for a {inc.nbytes}-byte staging buffer"
        return None

    async def _receive(self, inc: _Incoming, chunk_bytes: int) -> None:
        peer = inc.peer
        try:
            posted = await asyncio.wait_for(in_daemon_thread(self._post_recvs, inc, chunk_bytes), RECV_TIMEOUT)
            await wait_event(posted, RECV_TIMEOUT, "the NCCL recv", peer.comm, lambda: peer.aborted)
        except BaseException as e:
            self._drop(peer, f"recv failed: {e!r}")
            raise

    def _post_recvs(self, inc: _Incoming, chunk_bytes: int) -> torch.cuda.Event:
        peer, uint8 = inc.peer, nccl_module().NCCL_UINT8
        with peer.post_lock, torch.cuda.device(self.device):
            if peer.aborted:
                raise RuntimeError("the communicator was aborted")
            base = inc.staging.data_ptr()
            for offset in range(0, inc.nbytes, chunk_bytes):
                n = min(chunk_bytes, inc.nbytes - offset)
                peer.comm.recv(base + offset, n, uint8, 0, peer.stream.cuda_stream)
            done = torch.cuda.Event()
            done.record(peer.stream)
        return done

    async def finish(self, request_id: str) -> bool:
        """Wait for the recvs, scatter into the destination blocks; False if the bytes did not all come."""
        inc = self._incoming.pop(request_id, None)
        if inc is None or inc.received is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(inc.received), FINISH_TIMEOUT)
        except Exception as e:
            log.warning("nccl: %s: bytes did not arrive: %s", request_id, e)
            self._drop(inc.peer, "recv did not complete")
            return False
        scattered = await asyncio.to_thread(self._scatter, inc)
        await wait_event(scattered, SCATTER_TIMEOUT, "the scatter")
        return True

    def _scatter(self, inc: _Incoming) -> torch.cuda.Event:
        spec = self.kv.spec
        data = inc.staging.view(spec.dtype).view(len(inc.dest_blocks), *spec.block_shape)
        with torch.cuda.device(self.device), torch.cuda.stream(self._scatter_stream):
            self.kv.write_block_major(inc.dest_blocks, data)
            done = torch.cuda.Event()
            done.record(self._scatter_stream)
        return done

    def forget(self, request_id: str) -> None:
        inc = self._incoming.pop(request_id, None)
        if inc is not None and inc.received is not None and not inc.received.done():
            # a posted recv cannot be withdrawn, only its communicator: no byte lands after this
            inc.received.cancel()
            self._drop(inc.peer, f"{request_id} forgotten mid-transfer")

    def revoke(self, request_id: str) -> bool:
        self.forget(request_id)  # its communicator dropped: no byte of it lands any more
        return True


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # logged by _receive's drop; finish() reports it


# -- prefill side ----------------------------------------------------------------


@dataclass
class _Link:
    """Our end of the communicator with one decode worker."""

    key: tuple[str, str]  # (connect subject, incarnation)
    session: str
    comm: Any
    device: int
    stream: torch.cuda.Stream
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one transfer at a time
    aborted: bool = False


class _SessionGone(Exception):
    """The decode worker no longer knows our communicator; nothing was sent on it."""


@register_sender("nccl")
class NcclSender:
    name = "nccl"

    def __init__(self, bus: Messenger, **_):
        self.bus = bus
        self._me = secrets.token_hex(6)
        self._links: dict[str, _Link] = {}  # connect subject -> link
        self._connecting: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def usable(self, params: dict) -> bool:
        if not (params.get("connect") and params.get("begin") and params.get("incarnation")):
            return False
        if not torch.cuda.is_available() or nccl_module() is None:
            return False
        return not _same_gpu_refused(params, torch.cuda.current_device())

    async def send(self, target: TransferTarget, params: dict, src: KVCache, src_blocks: list[int]) -> TransferResult:
        if src.device.type != "cuda":
            raise ValueError("the nccl transport sends from a KV cache on a CUDA device")
        spec = KVCacheSpec.from_dict(params["spec"])
        if not src.spec.same_layout(spec):
            raise ValueError("the decode worker's KV layout differs from ours")
        nbytes = len(src_blocks) * spec.block_bytes
        if nbytes != params.get("bytes") or len(src_blocks) != len(target.dest_block_ids):
            raise ValueError(f"the decode worker expects {params.get('bytes')} bytes, we have {nbytes}")
        per_chunk = max(1, CHUNK_BYTES // spec.block_bytes)
        t0 = time.perf_counter()
        for _attempt in range(2):  # a link dropped on either side before any byte moved is replaced once
            link = await self._link(params, src.tensor.device.index)
            async with link.lock:
                if link.aborted:
                    continue
                with contextlib.suppress(_SessionGone):
                    await self._transfer(link, target, params, src, src_blocks, per_chunk, spec)
                    return TransferResult(self.name, nbytes, time.perf_counter() - t0, -(-len(src_blocks) // per_chunk))
        raise RuntimeError("the NCCL communicator was dropped twice in a row")

    async def _transfer(self, link: _Link, target: TransferTarget, params: dict, src: KVCache, src_blocks: list[int],
                        per_chunk: int, spec: KVCacheSpec) -> None:
        try:
            nbytes = len(src_blocks) * spec.block_bytes
            begin = NcclBegin(link.session, target.request_id, nbytes, per_chunk * spec.block_bytes)
            reply = await self.bus.request(params["begin"], begin, NcclReply, timeout=BEGIN_TIMEOUT)
            if reply.error == UNKNOWN_SESSION:
                raise _SessionGone()
            if not reply.ok:
                raise RuntimeError(f"the decode worker refused the transfer: {reply.error}")
            sent = await asyncio.wait_for(
                in_daemon_thread(self._post_sends, link, src, src_blocks, per_chunk, spec.dtype), SEND_TIMEOUT
            )
            await wait_event(sent, SEND_TIMEOUT, "the NCCL send", link.comm, lambda: link.aborted)
        except BaseException as e:  # cancelled by the deadline too: the send may be half done
            self._drop(link, f"transfer failed: {e!r}")
            raise

    def _post_sends(self, link: _Link, src: KVCache, src_blocks: list[int], per_chunk: int,
                    dtype: torch.dtype) -> torch.cuda.Event:
        uint8 = nccl_module().NCCL_UINT8
        with torch.cuda.device(link.device), torch.cuda.stream(link.stream):
            link.stream.wait_stream(torch.cuda.default_stream(link.device))  # the engine's KV writes
            for i in range(0, len(src_blocks), per_chunk):
                # allocated on this stream, so a freed chunk is reused only after its send
                chunk = src.read_block_major(src_blocks[i : i + per_chunk]).to(dtype)
                link.comm.send(chunk.data_ptr(), chunk.numel() * chunk.element_size(), uint8, 1,
                               link.stream.cuda_stream)
            sent = torch.cuda.Event()
            sent.record(link.stream)
        return sent

    async def close(self) -> None:
        for link in list(self._links.values()):
            self._drop(link, "closing")

    async def _link(self, params: dict, device: int) -> _Link:
        subject = params["connect"]
        key = (subject, params["incarnation"])
        async with self._connecting[subject]:
            link = self._links.get(subject)
            if link is not None and link.key == key and not link.aborted:
                return link
            if link is not None:
                self._drop(link, "the decode worker restarted")
            link = await self._connect(key, device)
            self._links[subject] = link
            return link

    async def _connect(self, key: tuple[str, str], device: int) -> _Link:
        uid = await asyncio.to_thread(unique_id)
        session = f"{self._me}-{secrets.token_hex(4)}"
        reply = await self.bus.request(key[0], NcclConnect(session, self._me, uid), NcclReply, timeout=CONNECT_TIMEOUT)
        if not reply.ok:
            raise RuntimeError(f"the decode worker refused the NCCL connection: {reply.error}")
        comm = await asyncio.wait_for(
            in_daemon_thread(new_communicator, uid, 0, device, on_orphan=abort_soon), INIT_TIMEOUT
        )
        log.info("nccl: session %s joined (rank 0 on cuda:%s)", session, device)
        return _Link(key, session, comm, device, torch.cuda.Stream(device=torch.device("cuda", device)))

    def _drop(self, link: _Link, why: str) -> None:
        if self._links.get(link.key[0]) is link:
            del self._links[link.key[0]]
        if not link.aborted:
            link.aborted = True
            log.info("nccl: dropping session %s (%s)", link.session, why)
            abort_soon(link.comm)
