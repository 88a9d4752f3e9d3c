"""Progress for one NIXL agent: a thread that drives the agent while a transfer of it is in flight,
and tells the event loop when a transfer is done or a notification came.

UCX over TCP moves bytes only while each side's worker is progressed (the target's too), and the
agent runs without UCX's progress thread (it spins a core, idle or not). Polling from the event
loop cannot be fine enough: ``asyncio.sleep`` waits in ``epoll_wait``, whose timeout is whole
milliseconds (0.1 ms sleeps took 1.1 ms), so every poll of a 1 MB write cost a millisecond
(in the mesh a 1 MB write took 1.5-2.1 ms; NIXL alone between the same two namespaces, polled
every 0.05-0.1 ms from a plain loop on a quiet machine, 0.43-0.74 ms: ``bench/nixl_bound.py``).
This thread waits on a condition between polls (a futex: microseconds; a new transfer, grant or
``kick`` ends the wait at once):

    POLL_FAST    for FAST_FOR seconds after the newest transfer, expected notification or
                 arrival (a write in flight moves at the link's pace)
    POLL_WAIT    after that, while a granted write has not started (the prefill still computes:
                 about 1000 cheap polls a second; its first bytes wait in the socket until then)
    POLL_SLOW    once the newest is SLOW_AFTER old (its writer is likely gone)

It polls only while something is in flight and waits on the condition otherwise (it is started
once, on the agent's first transfer, not per transfer): an idle worker costs no CPU.
Every agent call it makes is a quick one (no waiting), serialized with the event loop's
(``NIXL_THREAD_SYNC_STRICT``). What it finds goes to the loop with ``call_soon_threadsafe``;
all other state stays on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

POLL_FAST, FAST_FOR = 0.00005, 0.02
POLL_WAIT = 0.001
POLL_SLOW, SLOW_AFTER = 0.02, 10.0
AWAIT_MAX = 300.0  # seconds after which an awaited notification is given up (the fence still holds)

Notifs = dict[str, list[bytes]]  # writer agent -> its notifications, as ``get_new_notifs`` gives them


class Progress:
    """``watch(handle)``: a future, done when the transfer is (``RuntimeError`` when it failed).
    ``expect(key)``/``unexpect(key)``: the notifications awaited; while any is, the thread polls
    the agent's notifications and hands each batch to ``deliver`` on the loop (one awaited
    ``AWAIT_MAX`` seconds is given up: its writer is long gone). ``kick()``: poll fast again."""

    def __init__(self, agent, deliver: Callable[[Notifs], None]):
        self.agent = agent
        self.deliver = deliver
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified when something is in flight
        self._xfers: dict[int, tuple[object, asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._expected: dict[bytes, float] = {}  # notification -> monotonic time it was first awaited
        self._loop: asyncio.AbstractEventLoop | None = None
        self._newest = 0.0  # monotonic: the newest transfer, expectation or arrival
        self._thread: threading.Thread | None = None

    def watch(self, handle) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            self._xfers[id(done)] = (handle, done, loop)
            self._start(loop)
        return done

    def expect(self, key: bytes) -> None:
        with self._lock:
            self._expected.setdefault(key, time.monotonic())
            self._start(asyncio.get_running_loop())

    def unexpect(self, key: bytes) -> None:
        with self._lock:
            self._expected.pop(key, None)

    def expected(self, key: bytes) -> bool:
        with self._lock:
            return key in self._expected

    def kick(self) -> None:
        with self._lock:
            self._newest = time.monotonic()
            self._work.notify()  # cut its pause short

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Under the lock: a new thing in flight; wake the thread (start it the first time)."""
        self._loop, self._newest = loop, time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nixl-progress", daemon=True)
            self._thread.start()
        self._work.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._give_up(time.monotonic())
                while not self._xfers and not self._expected:
                    self._work.wait()  # idle: no CPU until something is in flight
                xfers, expected, loop = list(self._xfers.values()), bool(self._expected), self._loop
            try:
                self._poll(xfers, expected, loop)
            except Exception:  # never leave a waiter hanging on a dead thread
                log.exception("nixl: progress failed")
            with self._lock:  # a futex wait: microseconds, and a kick or a new transfer ends it
                self._work.wait(self._pause())

    def _give_up(self, now: float) -> None:
        for key in [k for k, since in self._expected.items() if now - since > AWAIT_MAX]:
            log.warning("nixl: no notification %r in %.0f s: no longer awaited", key, AWAIT_MAX)
            del self._expected[key]

    def _poll(self, xfers, expected: bool, loop: asyncio.AbstractEventLoop) -> None:
        for handle, fut, xloop in xfers:
            state = self.agent.check_xfer_state(handle)  # progresses the agent
            if state in ("DONE", "ERR"):
                with self._lock:
                    self._xfers.pop(id(fut), None)
                    self._newest = time.monotonic()
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    xloop.call_soon_threadsafe(_settle, fut, state)
        if expected:
            got = self.agent.get_new_notifs()
            if got:
                with self._lock:
                    self._newest = time.monotonic()
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self.deliver, got)

    def _pause(self) -> float:
        age = time.monotonic() - self._newest
        return POLL_FAST if age < FAST_FOR else POLL_WAIT if age < SLOW_AFTER else POLL_SLOW


def _settle(fut: asyncio.Future, state: str) -> None:
    if fut.done():
        return
    if state == "DONE":
        fut.set_result(None)
    else:
        fut.set_exception(RuntimeError("the NIXL transfer failed"))
