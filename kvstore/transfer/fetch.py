"""Peer-fetch channels: how the blocks a holder read reach the worker that asked for them.

A peer fetch (``decode/peerfetch.py``) never writes into the requester's KV blocks. The
holder writes a buffer of the fetch's own; the requester stages those bytes
(``kvstore.peer.PeerStage``) and the admission copies them into fresh device blocks
like any hit below the device. Who frees what: the requester drops the buffer once the
fetch is over, however it ended (``forget``: the shm file unlinked, the nats assembly
forgotten), and never reuses it. So a transfer that timed out cannot corrupt anything:
a holder still writing writes into an unlinked file or to a subject nobody listens on.

    requester  params(fetch_id, max_bytes) -> what the holder needs (KvFetchRequest.transports)
               take(fetch_id, nbytes, lent) -> the bytes once KvFetchDone said they are written (or
                                             lent, below), or None
               forget(fetch_id)           -> drop the buffer (always)
    holder     usable(params)             -> can this process write there?
               send(fetch_id, params, payload) -> bytes written

Both the shm and the nats transports of prefill transfers have a channel here (same
mechanisms: a file in /dev/shm on one host, ``KvChunk``s with acked windows over NATS).

A holder on the requester's host whose KV pool and host tier are files in /dev/shm (a CPU
worker with the shm transport) writes nothing: it *lends* the pinned run (``KvFetchDone.lent``:
its files, and where each block is in them), and the requester copies the blocks out itself
(``take``), then releases the pins (``KvFetchRelease``). The holder's cores do no copying at
all, which is what keeps its own steps' pace (python -m bench peer-serve): a copy on the holder's
engine thread lengthens its steps, and a copy thread beside it takes a core from the step's
own threads. Only blocks of the holder's disk tier are written (into the requester's buffer,
on a thread), their bytes being in no shared file. The lent blocks are pinned until the
release or the lease (``until``); a read that ends past the lease is discarded, as its blocks
may have been reused meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import mmap
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Protocol

from kvstore.tiers import DeviceBlock, gather_blocks
from kvstore.transfer import Refused, host_id
from kvstore.transfer.messages import KvChunk
from kvstore.transfer.messenger import Messenger
from kvstore.transfer.shm import PREFIX, open_kv_file, shm_dir

log = logging.getLogger(__name__)


class FetchChannel(Protocol):
    name: str

    async def params(self, fetch_id: str, max_bytes: int) -> dict: ...

    async def take(self, fetch_id: str, nbytes: int, lent: dict | None = None) -> memoryview | None:
        """The fetch's ``nbytes``, block-major; ``lent``: the holder's ``KvFetchDone.lent`` (read from its files)."""

    async def forget(self, fetch_id: str) -> None: ...

    def usable(self, params: dict) -> bool: ...

    def target(self, params: dict, rows: int, block_shape: tuple, dtype) -> Any | None:
        """A tensor ``[rows, *block_shape]`` over the requester's buffer that the holder copies the
        blocks into directly (no staging copy, no ``send``), or None: read, then ``send``."""

    async def send(self, fetch_id: str, params: dict, payload: memoryview) -> int: ...


CHANNELS: dict[str, Callable[..., FetchChannel]] = {}


def register(name: str):
    def deco(cls):
        CHANNELS[name] = cls
        return cls

    return deco


CHANNELS["nixl"] = lambda **kw: import_module("kvstore.transfer.nixl_fetch").NixlChannel(**kw)  # between hosts


def make_channels(names, **kwargs) -> dict[str, FetchChannel]:
    """The channels of these transport names, in order (names without a channel are skipped)."""
    return {n: CHANNELS[n](**kwargs) for n in names if n in CHANNELS}


LEASE_MARGIN = 0.05  # seconds: a lent read must end this long before the holder's pins may lapse
MAPPED_FILES = 8  # holders' files kept mapped by a requester

_BUFFER = re.compile(r"kv-[A-Za-z0-9_.-]{1,120}-fetch-[A-Za-z0-9_.-]{1,120}")


def _buffer_file(params: dict) -> str | None:
    """The fetch buffer a message names, in the mesh's shm directory; None for any other name."""
    name = params.get("name")
    if not isinstance(name, str) or not _BUFFER.fullmatch(name) or name.startswith("."):
        return None
    return str(shm_dir() / name)


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11 lacks the name
_LIBC = ctypes.CDLL(None, use_errno=True)


def _populate_mapping(mapping: mmap.mmap, nbytes: int) -> bool:
    """Fill the page tables of ``mapping``'s first ``nbytes`` in one call, allocating and zeroing
    pages a file does not have yet (``MADV_POPULATE_WRITE``). Through ctypes, which lets go of
    the GIL: ``mmap``'s own ``madvise`` and ``MAP_POPULATE`` hold it, and every other thread of
    the process (an engine thread, the event loop) waits on it meanwhile. False: an older kernel
    (EINVAL); the pages are then faulted in by their first write."""
    view = (ctypes.c_char * nbytes).from_buffer(mapping)
    try:
        return _LIBC.madvise(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(nbytes),
                             MADV_POPULATE_WRITE) == 0
    finally:
        del view  # the mapping's export: a tensor over it may be the only one left


def map_populated(path: str, nbytes: int) -> mmap.mmap:
    """``path`` mapped shared, its pages allocated and page tables filled in one call, on the
    calling thread without the GIL (faulting them in a page at a time during the copy cost the
    copy more than the copy itself: 7.8 of a 24 MB fetch's 10 ms on a 2-core host)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # no O_CREAT: a buffer already dropped stays gone
    try:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    _populate_mapping(mapping, nbytes)  # on an older kernel the copy faults the pages in instead
    return mapping


@register("shm")
class ShmChannel:
    """A file in /dev/shm per fetch, named after this process (``remove_stale_files`` clears the
    files of a requester that died), sparse until written: by a holder that copies, through a
    populated mapping (``target``) or with one ``pwrite``; by one that lends, only its disk
    blocks (``write_rows``), the rest read out of its own files (``take``)."""

    name = "shm"

    def __init__(self, worker_id: str, **_):
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id)[:100]
        self._prefix = f"{PREFIX}{os.getpid()}-{safe}-fetch-"
        self._paths: dict[str, str] = {}
        self._mapped: OrderedDict[tuple, Any] = OrderedDict()  # holders' files we read lent runs from

    async def params(self, fetch_id: str, max_bytes: int) -> dict:
        name = f"{self._prefix}{re.sub(r'[^A-Za-z0-9_.-]', '_', fetch_id)}"
        path = str(shm_dir() / name)

        def create() -> None:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # sparse: a holder that lends writes only its disk blocks here (and one that copies
                # maps it populated, ``map_populated``), so most fetches never touch these pages
                os.ftruncate(fd, max_bytes)
            finally:
                os.close(fd)

        await asyncio.to_thread(create)
        self._paths[fetch_id] = path
        # "read": this requester reads a lent run from the holder's files (``take``)
        return {"name": name, "host": host_id(), "bytes": max_bytes, "read": True}  # a name, never a path

    async def take(self, fetch_id: str, nbytes: int, lent: dict | None = None) -> memoryview | None:
        path = self._paths.get(fetch_id)
        if path is None:
            return None
        if lent:
            return await asyncio.to_thread(self._read_lent, path, lent, nbytes)

        def read() -> bytes:
            with open(path, "rb") as f:
                return f.read(nbytes)

        data = await asyncio.to_thread(read)
        return memoryview(data) if len(data) == nbytes else None

    def _read_lent(self, path: str, lent: dict, nbytes: int) -> memoryview | None:
        """Copy a lent run out of the holder's files (and its disk blocks out of our buffer) into one
        block-major tensor; None if it does not add up or the pins' lease ran out before the end."""
        import torch

        from kvstore.cache import KVCacheSpec

        try:
            spec = KVCacheSpec.from_dict(lent["spec"])
            where, index, until = list(lent["where"]), list(lent["index"]), float(lent["until"])
        except (KeyError, TypeError, ValueError) as e:
            raise Refused(f"malformed lent run ({type(e).__name__}: {e})") from None
        bb = spec.block_bytes
        n = nbytes // bb if bb else 0
        if n <= 0 or n * bb != nbytes or len(where) < n or len(index) < n:
            raise Refused(f"a lent run of {len(where)} blocks of {bb} bytes does not make {nbytes} bytes")
        block_shape = spec.block_shape
        if any(not isinstance(index[i], int) for i in range(n)):
            raise Refused("a lent block's index is not an integer")
        files: dict[int, Any] = {}  # place -> the holder's file as blocks (the pool: layer-major)
        for kind in {where[i] for i in range(n)}:
            if kind == 2:
                if any(index[i] != i for i in range(n) if where[i] == 2):
                    raise Refused("a lent run's buffered block is not at its own row")
                continue
            if kind not in (0, 1):
                raise Refused(f"a lent block in unknown place {kind!r}")
            flat = self._holder_file(lent.get("kv" if kind == 0 else "slots"), bb, spec.dtype)
            count = flat.numel() * flat.element_size() // bb
            if any(not 0 <= index[i] < count for i in range(n) if where[i] == kind):
                raise Refused("a lent block is outside the holder's file")
            files[kind] = (flat.view(spec.num_layers, spec.num_planes, count, *block_shape[2:]) if kind == 0
                           else flat.view(count, *block_shape))
        sources: list = [DeviceBlock(index[i]) if where[i] == 0 else index[i] for i in range(n)]
        if 2 in where[:n]:  # the holder's disk blocks, written into our buffer at their rows
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                for i in range(n):
                    if where[i] == 2:
                        sources[i] = bytearray(os.pread(fd, bb, i * bb))
                        if len(sources[i]) != bb:
                            return None
            finally:
                os.close(fd)
        out = torch.empty((n, *block_shape), dtype=spec.dtype)
        gather_blocks(out, sources, files.get(0), files.get(1))
        if time.time() >= until - LEASE_MARGIN:
            return None  # the holder may have unpinned (and reused) them while we read
        return memoryview(out.view(-1).view(torch.uint8).numpy())

    def _holder_file(self, name, block_bytes: int, dtype):
        """A holder's KV or slots file, mapped shared (read only by us) as one flat tensor; the
        mappings of the last few files are kept, by (name, inode): a restarted holder's are new."""
        import torch

        fd, st = open_kv_file(name)  # Refused: not a KV file of this user in the mesh's directory
        try:
            key = (name, st.st_ino, st.st_size)
            flat = self._mapped.get(key)
            if flat is not None:
                self._mapped.move_to_end(key)
                return flat
            if st.st_size == 0 or st.st_size % block_bytes:
                raise Refused(f"{name} does not hold whole blocks of {block_bytes} bytes")
            flat = torch.frombuffer(mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED), dtype=dtype)
        finally:
            os.close(fd)
        self._mapped[key] = flat
        while len(self._mapped) > MAPPED_FILES:
            self._mapped.popitem(last=False)  # unmapped once no tensor over it is left
        return flat

    async def forget(self, fetch_id: str) -> None:
        path = self._paths.pop(fetch_id, None)
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)  # a holder still writing writes into pages nobody will read

    def usable(self, params: dict) -> bool:
        """Same host, and a fetch buffer file in the mesh's shm directory (a peer names no other file)."""
        path = _buffer_file(params)
        return params.get("host") == host_id() and path is not None and os.path.isfile(path) \
            and not os.path.islink(path)

    def target(self, params: dict, rows: int, block_shape: tuple, dtype) -> Any | None:
        """The requester's file mapped (shared) as blocks: the holder's one copy lands in it. Call
        it off the engine thread: the mapping fills its page tables (``map_populated``)."""
        import torch

        numel = rows * math.prod(block_shape)
        nbytes = numel * dtype.itemsize
        if nbytes > int(params.get("bytes", 0)):
            raise ValueError(f"the requester's buffer holds {params.get('bytes')} bytes, not {rows} blocks")
        if nbytes == 0:
            return torch.empty((0, *block_shape), dtype=dtype)
        # opened by name: a buffer the requester already dropped is gone (FileNotFoundError); the
        # tensor keeps the mapping alive, and it goes when the tensor does
        mapping = map_populated(_buffer_file(params), nbytes)
        return torch.frombuffer(mapping, dtype=dtype, count=numel).view(rows, *block_shape)

    async def write_rows(self, params: dict, rows: list[tuple[int, Any]], block_bytes: int) -> None:
        """The holder lending a run: the blocks that are in no shared file (its disk tier's) into
        the requester's buffer, each at its own row."""
        if any((i + 1) * block_bytes > int(params.get("bytes", 0)) or len(p) != block_bytes for i, p in rows):
            raise ValueError(f"the requester's buffer holds {params.get('bytes')} bytes, not these rows")

        def write() -> None:
            fd = os.open(_buffer_file(params), os.O_WRONLY | os.O_NOFOLLOW)
            try:
                for i, payload in rows:
                    os.pwrite(fd, payload, i * block_bytes)
            finally:
                os.close(fd)

        await asyncio.to_thread(write)

    async def send(self, fetch_id: str, params: dict, payload: memoryview) -> int:
        if len(payload) > int(params.get("bytes", 0)):
            raise ValueError(f"the requester's buffer holds {params.get('bytes')} bytes, not {len(payload)}")

        def write() -> int:
            fd = os.open(_buffer_file(params), os.O_WRONLY | os.O_NOFOLLOW)  # no O_CREAT: a buffer already dropped stays gone
            try:
                return os.pwrite(fd, payload, 0)
            finally:
                os.close(fd)

        return await asyncio.to_thread(write)


@dataclass
class _Assembly:
    cap: int
    buf: bytearray | None = None
    total: int = -1
    received: int = 0
    indexes: set[int] | None = None


@register("nats")
class NatsChannel:
    """``KvChunk``s on a subject of the fetch's own (``kv_fetch_data``), in acked windows
    (``NatsSender.send_bytes``); one subscription per fetch, closed by ``forget``."""

    name = "nats"

    def __init__(self, bus: Messenger, model: str, worker_id: str, **_):
        self.bus = bus
        self.model = model
        self.worker_id = worker_id
        self._pending: dict[str, tuple[_Assembly, object]] = {}

    async def params(self, fetch_id: str, max_bytes: int) -> dict:
        asm = _Assembly(max_bytes)
        subject = self.bus.subjects.kv_fetch_data(self.model, self.worker_id, fetch_id)

        async def on_chunk(chunk: KvChunk, raw) -> None:
            self._add(asm, chunk)
            if raw.reply:
                await raw.respond(b"")

        sub = await self.bus.subscribe(subject, on_chunk, KvChunk, pending_msgs_limit=1 << 16)
        self._pending[fetch_id] = (asm, sub)
        return {"subject": subject, "max_bytes": max_bytes}

    @staticmethod
    def _add(asm: _Assembly, chunk: KvChunk) -> None:
        end = chunk.offset + len(chunk.data)
        if (asm.total not in (-1, chunk.total_bytes) or not 0 < chunk.total_bytes <= asm.cap
                or chunk.offset < 0 or end > chunk.total_bytes):
            log.warning("dropping a peer-fetch chunk of %s that does not fit its buffer", chunk.request_id)
            return
        if asm.buf is None:
            asm.total, asm.buf, asm.indexes = chunk.total_bytes, bytearray(chunk.total_bytes), set()
        if chunk.index not in asm.indexes:
            asm.buf[chunk.offset : end] = chunk.data
            asm.indexes.add(chunk.index)
            asm.received += len(chunk.data)

    async def take(self, fetch_id: str, nbytes: int, lent: dict | None = None) -> memoryview | None:
        entry = self._pending.get(fetch_id)
        if entry is None:
            return None
        asm = entry[0]
        if asm.buf is None or asm.total != nbytes or asm.received != nbytes:
            return None
        return memoryview(asm.buf)

    async def forget(self, fetch_id: str) -> None:
        entry = self._pending.pop(fetch_id, None)
        if entry is not None:
            with contextlib.suppress(Exception):
                await entry[1].unsubscribe()  # late chunks go nowhere

    def usable(self, params: dict) -> bool:
        return isinstance(params.get("subject"), str) and bool(params["subject"])

    def target(self, params: dict, rows: int, block_shape: tuple, dtype) -> None:
        return None

    async def send(self, fetch_id: str, params: dict, payload: memoryview) -> int:
        from kvstore.transfer.nats_transport import NatsSender

        if len(payload) > int(params.get("max_bytes", 0)):
            raise ValueError(f"the requester's buffer holds {params.get('max_bytes')} bytes, not {len(payload)}")
        sent = await NatsSender(self.bus).send_bytes(fetch_id, {"subject": params["subject"]}, payload)
        return sent.bytes
