"""The ``nixl`` peer-fetch channel: a holder on another host WRITEs the blocks it read into a slice
of the requester's fetch buffer, one region registered once (``BUFFER_BYTES``) and handed out a
slice per fetch.

    requester  params(fetch_id, max_bytes) -> a slice of the buffer, armed with a generation
                                              (``bytes`` 0 when none is free: the holder then uses
                                              the next channel, nats)
    holder     send(fetch_id, params, payload): the payload registered for the write, the grant
               (``NixlBegin`` kind "fetch"), one WRITE with the notification "fetch:{id}:{gen}"
    requester  take: the notification from the granted writer -> a copy of the slice's bytes
               forget: the slice is free again once no granted write may still land into it
               (its notification came, or none was granted); until then it stays out of use

Who frees what: the requester's slices, ``forget`` (or a later ``params`` that finds the late
write's notification); the holder's payload registration, the holder, once the write is done.
Trust: the holder writes only inside a ``fetch`` region the requester's agent lists, at the
slice the params name, and only with the requester's grant (``Refused`` otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from kvstore.transfer import host_id
from kvstore.transfer.messenger import Messenger
from kvstore.transfer.nixl_agent import NixlNode, Region, notif_key, refuse
from kvstore.transfer.nixl_grants import Grants, JobState, WriteJob

log = logging.getLogger(__name__)

BUFFER_BYTES = 256 << 20  # the requester's fetch buffer (its fetches in flight share it)
TAKE_TIMEOUT = 2.0  # seconds for the notification once the holder's KvFetchDone said it wrote
_INT = ("rev", "addr", "size", "offset", "bytes", "gen")
_STR = ("agent", "md", "begin", "fetch")


@dataclass
class _Slice(WriteJob):
    offset: int = 0
    size: int = 0


class NixlChannel:
    """Registered in ``kvstore.transfer.fetch.CHANNELS`` (imported on first use)."""

    name = "nixl"

    def __init__(self, bus: Messenger, model: str, worker_id: str, buffer_bytes: int = BUFFER_BYTES, **_):
        import torch

        self.bus, self.model, self.worker_id = bus, model, worker_id
        self.node = NixlNode.for_worker(worker_id)
        self.buffer = torch.zeros(buffer_bytes, dtype=torch.uint8)  # allocated on first touch (sparse)
        self.region: Region | None = None
        self.grants: Grants[_Slice] = Grants(self.node, "fetch")
        self.slices = self.grants.jobs  # fetch id -> its slice, armed until forgotten
        self.fenced: dict[str, _Slice] = {}  # forgotten while a granted write may still land

    # -- requester -----------------------------------------------------------------------------
    async def params(self, fetch_id: str, max_bytes: int) -> dict:
        if self.region is None:
            b = self.buffer
            self.region = await asyncio.to_thread(self.node.register, "fetch", b.data_ptr(), b.numel())
            await self.node.serve(self.bus, self.model, self.worker_id)
        self._unfence()
        offset = self._room(max_bytes)
        s = self.bus.subjects
        out = {"agent": self.node.name, "host": host_id(), "rev": self.node.rev, "md": s.nixl(self.model, self.worker_id, "md"),
               "begin": s.nixl(self.model, self.worker_id, "begin"), "fetch": fetch_id, "addr": self.region.addr,
               "size": self.region.size, "offset": 0, "bytes": 0, "gen": 0}
        if offset is None:
            return out  # no room: "bytes" 0, not usable; the holder takes the next channel
        gen = self.grants.next_gen()
        self.slices[fetch_id] = _Slice(gen, offset=offset, size=max_bytes)
        return {**out, "offset": offset, "bytes": max_bytes, "gen": gen}

    def _room(self, size: int) -> int | None:
        """First fit among the slices in use (armed or fenced)."""
        taken = sorted((s.offset, s.offset + s.size) for s in (*self.slices.values(), *self.fenced.values()))
        at = 0
        for lo, hi in taken:
            if lo - at >= size:
                return at
            at = max(at, hi)
        return at if self.buffer.numel() - at >= size and size > 0 else None

    def _unfence(self) -> None:
        for fid, sl in list(self.fenced.items()):
            if self.grants.landed(fid, sl):
                del self.fenced[fid]

    async def take(self, fetch_id: str, nbytes: int, lent: dict | None = None) -> memoryview | None:
        sl = self.slices.get(fetch_id)
        if sl is None or nbytes > sl.size:
            return None
        if not await self.grants.wait(fetch_id, sl, TAKE_TIMEOUT):
            return None
        return memoryview(self.buffer[sl.offset : sl.offset + nbytes].numpy().tobytes())  # a copy: the slice is reused

    async def forget(self, fetch_id: str) -> None:
        sl = self.slices.pop(fetch_id, None)
        if sl is not None and sl.state is JobState.WRITING and not self.grants.landed(fetch_id, sl):
            self.fenced[fetch_id] = sl  # a granted write may still land here: out of use until it has

    # -- holder --------------------------------------------------------------------------------
    def usable(self, params: dict) -> bool:
        try:
            bad = [k for k in _INT if type(params[k]) is not int or params[k] < 0] + \
                  [k for k in _STR if not isinstance(params[k], str) or not params[k]]
        except (KeyError, TypeError):
            return False
        return not bad and params["bytes"] > 0

    def target(self, params: dict, rows: int, block_shape: tuple, dtype) -> None:
        return None  # the holder reads into its own memory, then ``send``

    async def send(self, fetch_id: str, params: dict, payload: memoryview) -> int:
        import numpy as np

        if not self.usable(params):
            raise refuse("malformed", "nixl fetch params")
        if len(payload) > params["bytes"]:
            raise ValueError(f"the requester's buffer holds {params['bytes']} bytes, not {len(payload)}")
        peer = await self.node.peer(self.bus, params["md"], params["agent"], params["rev"])
        dst = next((r for r in peer.regions if r.kind == "fetch" and r.addr == params["addr"]
                    and r.size == params["size"]), None)
        where = params["addr"] + params["offset"]
        if dst is None or not dst.holds(where, len(payload)):
            raise refuse("unregistered_memory", f"a fetch buffer agent {params['agent']!r} never registered")
        addr = int(np.frombuffer(payload, dtype=np.uint8).ctypes.data)
        reg = await asyncio.to_thread(self.node.agent.register_memory, [(addr, len(payload), 0, "")], "DRAM")
        try:
            await self.node.ask_grant(self.bus, params["begin"], "fetch", params["fetch"], params["gen"])
            await self.node.write(peer, Region("payload", addr, len(payload)), [(addr, len(payload))], dst,
                                  [(where, len(payload))], notif_key("fetch", params["fetch"], params["gen"]))
        finally:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.node.agent.deregister_memory, reg)
        return len(payload)
