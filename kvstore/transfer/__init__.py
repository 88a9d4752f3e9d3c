"""KV transfer transports: how a prefill worker's blocks reach a decode worker's blocks.

Two sides, one name per transport:

    decode side  KvReceiver.params(request_id) -> what a sender needs (goes into the PrefillJob)
                 KvReceiver.finish(request_id)  -> True once the bytes are in the destination blocks
                 KvReceiver.revoke(request_id)  -> True once no late write can land (a timed-out job)
    prefill side KvSender.usable(params)        -> can this process reach the decode worker this way?
                 KvSender.send(target, params, src, src_blocks) -> TransferResult

``src`` (and the receiver's ``kv``) is the worker's ``engine.kv_cache``: a
``KVCache``, or for a tensor-parallel worker a ``ShardedKVCache`` (the full head
set over one cache per rank, no single tensor). ``shm`` and ``nats`` re-shard
heads between any two TP degrees; ``cuda_ipc``, ``nccl`` and ``nixl`` take one tensor
and do not serve TP > 1 yet.

Two workers' pools may hold different dtypes (``--kv-cache-dtype``): ``shm``, ``nats``,
``cuda_ipc`` and ``nccl`` cast the blocks to the receiver's dtype on the way; ``nixl`` writes
bytes in place and refuses such a job in one line (the decode worker then prefills it).

The decode worker lists the transports it accepts, best first; the prefill
worker uses the first one it can. Coordination (job, completion) is always a
NATS message; only the bytes take the transport's path. A sender writes into a
``TransferTarget`` (what the prefill worker's job names); the transports that
talk over NATS take a ``Messenger`` (``kvstore.transfer.messenger``: the mesh's bus)
as their ``bus`` argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib import import_module
from pathlib import Path
from typing import Any, Protocol, TypeVar


@lru_cache(maxsize=1)
def host_id() -> str:
    """Same value in every process that shares this kernel (so /dev/shm, and CUDA IPC).
    ``MESH_HOST_ID`` overrides it (read here only): workers of one machine that should act as
    different hosts (tests, the multi-host bed) then use the transports between hosts."""
    override = os.environ.get("MESH_HOST_ID", "").strip()
    if override:
        return override
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}:{boot}"


# Same-host paths first (cuda_ipc, nccl, shm: their ``usable`` says False on another host), then
# nixl between hosts, nats as the fallback that always works.
PREFERENCE = ("cuda_ipc", "nccl", "shm", "nixl", "nats", "mock")


@dataclass(frozen=True)
class TransferTarget:
    """Where a sender writes one request's KV: blocks of a decode worker (its ``PrefillJob`` names them)."""

    request_id: str
    decode_worker: str  # the decode worker's id
    dest_block_ids: list[int]  # its blocks, one for each of the sender's source blocks, in order
    block_size: int  # tokens per block


@dataclass(frozen=True)
class TransferResult:
    transport: str
    bytes: int
    seconds: float
    chunks: int = 0


class Refused(ValueError):
    """The params name a resource this process must not touch (a file outside its transport's own
    directory, blocks out of range): the job is refused, never passed to another worker."""


T = TypeVar("T")


async def run_to_end(work: Awaitable[T]) -> T:
    """``work``'s result; if the caller is cancelled meanwhile (a timeout), ``work`` still runs to
    its end before the cancellation goes on: a copy or write into another worker's blocks must be
    over before anyone is told the job ended (a PrefillDone, a revoke), or it could land in blocks
    handed to someone else."""
    running = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await running
        raise


class KvSender(Protocol):
    """``usable(params)``: can this process reach the destination (False: another worker of the
    pool might); raises ``Refused`` when the params are not to be trusted.

    Optional: ``prepare(target, params, src)``, called (not awaited) when the prefill worker
    takes the job, before it computes: a transport starts there what its ``send`` would wait for
    (nixl: the write grant).

    Optional: ``carries_done = True``: ``send`` takes ``done=bytes``, the job's encoded
    ``PrefillDone``, and delivers it with the bytes (nixl: in the notification that follows
    them), so that the receiver learns of the completion without another message (its
    ``on_done``). The PrefillDone over NATS is sent as well (failures, and fences, rely on it)."""

    name: str

    def usable(self, params: dict) -> bool: ...

    async def send(self, target: TransferTarget, params: dict, src: Any, src_blocks: list[int]) -> TransferResult: ...


class KvReceiver(Protocol):
    name: str

    def params(self, request_id: str, dest_blocks: list[int]) -> dict: ...

    async def finish(self, request_id: str) -> bool: ...

    def forget(self, request_id: str) -> None: ...

    def revoke(self, request_id: str) -> bool:
        """The job is given up (too late): True once no write into its blocks is running or can
        start, so they may be reused; False while a sender may still be writing them (ask again
        later, or wait for its PrefillDone)."""
        ...

    # Optional: ``writer_left(worker_id)``, the registry's "worker left" (its card deleted or
    # expired): a transport whose fence waits for a writer's word (nixl) lets that writer's jobs go.
    # Optional: ``on_done``, set by the worker to a callable ``(request_id, payload)``: the
    # transport calls it on the event loop when a sender's ``done`` came with the job's bytes
    # (they have landed; the payload is as the sender gave it, not yet checked or decoded).


SENDERS: dict[str, Callable[..., KvSender]] = {}
RECEIVERS: dict[str, Callable[..., KvReceiver]] = {}


def register_sender(name: str):
    def deco(factory):
        SENDERS[name] = factory
        return factory

    return deco


def register_receiver(name: str):
    def deco(factory):
        RECEIVERS[name] = factory
        return factory

    return deco


_MODULES = {
    "shm": "kvstore.transfer.shm",
    "nats": "kvstore.transfer.nats_transport",
    "mock": "kvstore.transfer.mock",
    "cuda_ipc": "kvstore.transfer.cuda_ipc",
    "nccl": "kvstore.transfer.nccl",
    "nixl": "kvstore.transfer.nixl",
}


def nixl_available() -> bool:
    """NIXL (the ``nixl`` extra) imports here: workers offer the ``nixl`` transport by default."""
    from importlib.util import find_spec

    try:
        return find_spec("nixl_cu12") is not None
    except (ImportError, ValueError):
        return False


def _load(name: str) -> None:
    # Imported on first use: the mock transport must not drag torch into mocker processes.
    if name not in SENDERS and name in _MODULES:
        import_module(_MODULES[name])


def make_receiver(name: str, **kwargs) -> KvReceiver:
    _load(name)
    if name not in RECEIVERS:
        raise ValueError(f"unknown transport {name!r}")
    return RECEIVERS[name](**kwargs)


def make_sender(name: str, **kwargs) -> KvSender:
    _load(name)
    if name not in SENDERS:
        raise ValueError(f"unknown transport {name!r}")
    return SENDERS[name](**kwargs)


def ordered(names: list[str] | tuple[str, ...]) -> list[str]:
    """Transport names in preference order (fastest first)."""
    unknown = [n for n in names if n not in PREFERENCE]
    if unknown:
        raise ValueError(f"unknown transport {unknown[0]!r} (choose from {', '.join(PREFERENCE)})")
    return [n for n in PREFERENCE if n in names]
