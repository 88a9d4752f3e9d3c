"""The NCCL side of the ``nccl`` transport (``kvstore.transfer.nccl``): CuPy's NCCL module,
two-rank communicators, and running their blocking calls where a dead peer cannot hang the
event loop (a daemon thread each; completion polled from the loop against a deadline).

CuPy (``cupy.cuda.nccl``) is imported on first use, so this module imports on machines
without CUDA or CuPy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from functools import lru_cache

import torch

from kvstore.transfer import host_id

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def nccl_module():
    """``cupy.cuda.nccl``, or None where CuPy or NCCL is missing."""
    try:
        from cupy.cuda import nccl
    except Exception:
        return None
    return nccl if getattr(nccl, "available", False) else None


def nccl_host() -> str:
    """The host as NCCL tells hosts apart: NCCL_HOSTID (NCCL's own variable) overrides hostname + boot id."""
    return os.environ.get("NCCL_HOSTID") or host_id()


def multi_rank_gpu_allowed() -> bool:
    """NCCL >= 2.30 runs two ranks on one GPU when NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental)."""
    nccl = nccl_module()
    return bool(nccl) and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" and nccl.get_version() >= 23000


def unique_id() -> bytes:
    uid = nccl_module().get_unique_id()
    # CuPy >= 14 returns bytes; before, a tuple of C chars (signed on x86, unsigned on ARM)
    return uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)


def new_communicator(uid: bytes, rank: int, device: int):
    """Join the two-rank communicator named by ``uid``; blocks until the peer joins too."""
    nccl = nccl_module()
    signed = tuple(b - 256 if b > 127 else b for b in uid)
    with torch.cuda.device(device):  # NCCL binds the communicator to the current device
        for form in (uid, signed, tuple(uid)):  # bytes (CuPy >= 14), else a tuple of C chars
            try:
                return nccl.NcclCommunicator(2, form, rank)
            except (TypeError, OverflowError):  # refused before NCCL was called: try the next form
                continue
    raise TypeError("this CuPy takes an NCCL unique id in no form known here")


def abort_soon(comm) -> None:
    """ncclCommAbort, in a daemon thread (it waits for the communicator's kernels to stop)."""
    if comm is not None:
        threading.Thread(target=_abort_quietly, args=(comm,), name="nccl-abort", daemon=True).start()


def _abort_quietly(comm) -> None:
    try:
        comm.abort()
    except Exception as e:
        log.debug("nccl abort: %s", e)


def in_daemon_thread(fn: Callable, *args, on_orphan: Callable | None = None) -> asyncio.Future:
    """Run ``fn(*args)`` in a daemon thread; a future for its result.

    For calls that may block on the peer: if it never answers, the thread hangs,
    but neither the event loop nor interpreter exit waits for it. If nobody
    awaits the result any more (a timeout cancelled the future), ``on_orphan``
    gets it, on the event loop.
    """
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def deliver(ok: bool, value) -> None:
        if fut.done():
            if ok and on_orphan is not None:
                on_orphan(value)
        elif ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as e:
            value, ok = e, False
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            loop.call_soon_threadsafe(deliver, ok, value)

    threading.Thread(target=target, name=f"nccl-{fn.__name__}", daemon=True).start()
    return fut


async def wait_event(event: torch.cuda.Event, timeout: float, what: str, comm=None,
                     aborted: Callable[[], bool] = lambda: False) -> None:
    """Poll a CUDA event from the event loop until it completes; raise on timeout, abort or NCCL error."""
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while True:
        if aborted():
            raise RuntimeError(f"{what}: the communicator was aborted")
        if event.query():
            if aborted():  # an abort also ends the kernels; asked for before we looked: not our bytes
                raise RuntimeError(f"{what}: the communicator was aborted")
            return
        if comm is not None:
            comm.check_async_error()  # raises NcclError, e.g. when the peer's connection broke
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete in {timeout:.0f}s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1e-3)
