"""Child processes that never outlive their parent (Linux), and signal plumbing."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for children: the kernel sends them SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_event_on_signals(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Event:
    """An Event set by SIGINT or SIGTERM (the asyncio way: signals only set a flag)."""
    loop = loop or asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
