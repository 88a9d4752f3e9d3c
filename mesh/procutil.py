"""Child processes that never outlive their parent (Linux), signal plumbing, and the process's
tick grid for periodic work (``until_tick``, ``on_tick``).

Signals mean what they mean to gunicorn or nginx:

    SIGTERM  graceful: drain (finish in-flight work, up to the role's drain timeout), then exit
    SIGINT   quick (Ctrl-C): in-flight work gets ``QUICK_DRAIN`` seconds, then exit
    a second signal of either kind during a drain: exit now
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import random
import signal
import sys
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
QUICK_DRAIN = 2.0  # seconds in-flight work gets after SIGINT


def die_with_parent() -> None:
    """``preexec_fn`` for children: the kernel sends them SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class StopEvent(asyncio.Event):
    """Set by the first SIGINT or SIGTERM; remembers which signals came."""

    def __init__(self) -> None:
        super().__init__()
        self.signals: list[int] = []
        self.hurry = asyncio.Event()  # a second signal: stop draining

    def received(self, sig: int) -> None:
        self.signals.append(sig)
        if len(self.signals) > 1:
            self.hurry.set()
        self.set()

    def drain_seconds(self, graceful: float) -> float:
        """How long in-flight work may still run: ``graceful`` after SIGTERM, at most
        ``QUICK_DRAIN`` after SIGINT (or when no signal came: a programmatic stop is graceful)."""
        if self.hurry.is_set():
            return 0.0
        if self.signals and self.signals[0] == signal.SIGINT:
            return min(graceful, QUICK_DRAIN)
        return graceful


def stop_event_on_signals(loop: asyncio.AbstractEventLoop | None = None) -> StopEvent:
    """An Event set by SIGINT or SIGTERM (the asyncio way: signals only set a flag)."""
    loop = loop or asyncio.get_running_loop()
    stop = StopEvent()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.received, sig)
    return stop


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout: float = 2.0) -> None:
    """Cancel ``tasks`` and wait until they are done, cancelling again while they are not.

    Python 3.11's ``asyncio.wait_for`` drops a cancellation that arrives as its inner
    future completes; a task looping around such a call would then never end, and a
    shutdown awaiting it would hang. Re-cancelling makes the next cancellation land."""
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + timeout
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("%d tasks did not stop: %s", len(pending), ", ".join(t.get_name() for t in pending))
            return
        done, pending = await asyncio.wait(pending, timeout=min(0.2, left))
        for t in done:  # retrieved, so that a task's own error is not reported again at exit
            if not t.cancelled() and t.exception() is not None:
                log.debug("task %s ended with %r", t.get_name(), t.exception())


async def stop_processes(procs: Iterable, sig: int = signal.SIGTERM, timeout: float = 10.0,
                         signalled: Iterable = ()) -> list[int]:
    """Send ``sig`` to every ``subprocess.Popen`` in ``procs`` still running (except those in
    ``signalled``: already told, they are only waited for), wait (without blocking the event
    loop) up to ``timeout`` for them all, then SIGKILL and reap the rest. Returns the pids that
    had to be killed."""
    procs = [p for p in procs if p.poll() is None]
    told = set(signalled)
    for p in procs:
        if p not in told:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    killed = []
    for p in procs:
        if p.poll() is None:
            killed.append(p.pid)
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            await asyncio.to_thread(p.wait)
    return killed


def exit_now(code: int) -> None:
    """End the process once its own cleanup is done: run the atexit handlers (logging, span
    exporters), flush stdio, and skip the interpreter's teardown of every module, which costs a
    few hundred milliseconds of CPU per process (32 workers stopping at once on a small host:
    seconds). What gunicorn's and multiprocessing's workers do."""
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


GC_GEN0 = 20_000  # allocations between young-generation collections (CPython's default: 700)


def settle_heap() -> None:
    """Once a long-running process has built its state (models, tokenizers, subscriptions): move
    what exists now out of the collector's view (``gc.freeze``) and collect the young generation
    less often. A serving process allocates a few objects per token and keeps most of what it
    built at start; with the defaults the collector ran every 700 allocations and its older
    generations rescanned the whole start-up heap (python -m bench host-overhead, batch 256: 2.6 -> 1.2 ms
    of host work per step). vLLM's engine freezes its start-up heap the same way."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0, gen1, gen2)


_PHASE = random.random()  # this process's offset on every tick grid, as a fraction of the interval


def until_tick(interval: float) -> float:
    """Seconds to the next tick of ``interval`` on this process's grid. Periodic messages of the
    workers one process holds (``worker.host``: their load reports, card refreshes) then leave in
    the same turn of its loop, in one write, and a reader takes them in one read, not one wake-up
    each (a gateway reading 1,000 workers' in 8 processes: ~70 us a message arriving alone, ~25 in
    a burst). Each process draws its own phase, so separate processes (hosts) do not tick together."""
    return interval - (time.monotonic() - _PHASE * interval) % interval


def on_tick(t: float, interval: float) -> float:
    """``t`` (a monotonic time) moved to the nearest tick of ``interval`` on this process's grid:
    the mocker's steps (``engine.loop.InlineEngineLoop``), so that the workers one process holds end
    theirs in the same turn of its loop."""
    base = _PHASE * interval
    return base + round((t - base) / interval) * interval
