"""Progress for one NIXL agent: a thread that drives the agent while a transfer of it is in flight,
and tells the event loop when a transfer is done or a notification came.

UCX over TCP moves bytes only while each side's worker is progressed (the target's too), and the
agent runs without UCX's progress thread (it spins a core, idle or not). Polling from the event
loop cannot be fine enough: ``asyncio.sleep`` waits in ``epoll_wait``, whose timeout is whole
milliseconds (0.1 ms sleeps took 1.1 ms), so every poll of a 1 MB write cost a millisecond
(in the mesh a 1 MB write took 1.5-2.1 ms; NIXL alone between the same two namespaces, polled
every 0.05-0.1 ms from a plain loop on a quiet machine, 0.43-0.74 ms: ``bench/nixl_bound.py``, a probe kept in git at 95db059).
This thread waits on a condition between polls (a futex: microseconds; a new transfer, grant or
``kick`` ends the wait at once). Its timer slack is 1 us (``TIMER_SLACK_NS``): Linux lets a
thread's timed wait run 50 us late by default, so a 0.05 ms wait took 0.10-0.16 ms and every
poll of a write came twice as late (``nixl_bound.py --slack-ns``: a 1 MB write 0.85-5.5 ms
median at load 6 with the default slack, 0.49-0.97 ms with 1 us):

    POLL_FAST    for FAST_FOR seconds after the newest transfer, arrival or kick (a write in
                 flight moves at the link's pace), and for GRANT_FAST_FOR after a write grant
                 (a short prefill's write comes within it)
    POLL_WAIT    after that, while a granted write has not started (a long prefill still
                 computes: about 1000 cheap polls a second; its first bytes wait in the socket
                 until the writer's kick, one NATS hop, ends the pause)
    POLL_SLOW    once the newest is SLOW_AFTER old (its writer is likely gone)

Why a grant's window: the writer's kick crosses nats-server (two process wake-ups: 0.3-1 ms on a
busy machine) while its bytes already wait in the receiver's socket; a 1 MB write whose grant
was given 50 ms earlier took 2.4-4.9 ms with the kick alone against 1.4-2.1 ms when the receiver
was still polling fast (``python -m bench transfer --hosts 2 --mb 1 --compute-ms 50`` and ``0``, load 14).
Its cost: ~14% of a core while it lasts (0.05 ms polls at load 13: 6,000 a second, 22 us of
CPU each), at most GRANT_FAST_FOR per grant, less when the write lands sooner (the thread parks
once nothing is in flight).

It polls only while something is in flight and waits on the condition otherwise (it is started
once, on the agent's first transfer, not per transfer): an idle worker costs no CPU.
Every agent call it makes is a quick one (no waiting), serialized with the event loop's
(``NIXL_THREAD_SYNC_STRICT``). What it finds goes to the loop with ``call_soon_threadsafe``;
all other state stays on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

POLL_FAST, FAST_FOR = 0.00005, 0.02
GRANT_FAST_FOR = 0.1  # seconds of fast polls after a write grant (a short prefill's compute)
POLL_WAIT = 0.001
POLL_SLOW, SLOW_AFTER = 0.02, 10.0
clock = time.monotonic  # (tests move it)
TIMER_SLACK_NS = 1000  # this thread's timer slack (Linux's default: 50 us)
AWAIT_MAX = 300.0  # seconds after which an awaited notification is given up (the fence still holds)

Notifs = dict[str, list[bytes]]  # writer agent -> its notifications, as ``get_new_notifs`` gives them


class Progress:
    """``watch(handle)``: a future, done when the transfer is (``RuntimeError`` when it failed).
    ``expect(key)``/``unexpect(key)``: the notifications awaited; while any is, the thread polls
    the agent's notifications and hands each batch to ``deliver`` on the loop (one awaited
    ``AWAIT_MAX`` seconds is given up: its writer is long gone); ``fast_for``: seconds of fast polls
    from now. ``kick()``: poll fast again."""

    def __init__(self, agent, deliver: Callable[[Notifs], None]):
        self.agent = agent
        self.deliver = deliver
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified when something is in flight
        self._xfers: dict[int, tuple[object, asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._expected: dict[bytes, float] = {}  # notification -> monotonic time it was first awaited
        self._loop: asyncio.AbstractEventLoop | None = None
        self._newest = 0.0  # monotonic: the newest transfer, expectation or arrival
        self._fast_until = 0.0  # monotonic: poll fast until then
        self._thread: threading.Thread | None = None

    def watch(self, handle) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            self._xfers[id(done)] = (handle, done, loop)
            self._start(loop)
        return done

    def expect(self, key: bytes, fast_for: float = FAST_FOR) -> None:
        with self._lock:
            self._expected.setdefault(key, clock())
            self._start(asyncio.get_running_loop(), fast_for)

    def unexpect(self, key: bytes) -> None:
        with self._lock:
            self._expected.pop(key, None)

    def expected(self, key: bytes) -> bool:
        with self._lock:
            return key in self._expected

    def kick(self) -> None:
        with self._lock:
            self._fresh(FAST_FOR)
            self._work.notify()  # cut its pause short

    def _fresh(self, fast_for: float) -> None:
        """Under the lock: something new; poll fast for ``fast_for`` seconds (at least)."""
        self._newest = now = clock()
        self._fast_until = max(self._fast_until, now + fast_for)

    def _start(self, loop: asyncio.AbstractEventLoop, fast_for: float = FAST_FOR) -> None:
        """Under the lock: a new thing in flight; wake the thread (start it the first time)."""
        self._loop = loop
        self._fresh(fast_for)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nixl-progress", daemon=True)
            self._thread.start()
        self._work.notify()

    def _run(self) -> None:
        fine_timers()
        while True:
            with self._lock:
                self._give_up(clock())
                while not self._xfers and not self._expected:
                    self._work.wait()  # idle: no CPU until something is in flight
                xfers, expected, loop = list(self._xfers.values()), bool(self._expected), self._loop
            try:
                self._poll(xfers, expected, loop)
            except Exception:  # never leave a waiter hanging on a dead thread
                log.exception("nixl: progress failed")
            with self._lock:  # a futex wait: microseconds, and a kick or a new transfer ends it
                self._work.wait(self.pace())

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
                    self._fresh(FAST_FOR)
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    xloop.call_soon_threadsafe(_settle, fut, state)
        if expected:
            got = self.agent.get_new_notifs()
            if got:
                with self._lock:
                    self._fresh(FAST_FOR)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self.deliver, got)

    def pace(self) -> float:
        """Seconds until the next poll, as things stand."""
        now = clock()
        return POLL_FAST if now < self._fast_until else POLL_WAIT if now - self._newest < SLOW_AFTER else POLL_SLOW


def fine_timers(ns: int = TIMER_SLACK_NS) -> bool:
    """Make the calling thread's timed waits end within ``ns`` of their timeout (Linux:
    ``prctl(PR_SET_TIMERSLACK)``, per thread). False where it cannot (another OS): waits then end
    up to the system's slack late, which slows small transfers but breaks nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(29, ns, 0, 0, 0) == 0:  # PR_SET_TIMERSLACK
            return True
        log.info("nixl: no fine timers for the progress thread (errno %d)", ctypes.get_errno())
    except (OSError, AttributeError) as e:
        log.info("nixl: no fine timers for the progress thread (%s)", e)
    return False


def _settle(fut: asyncio.Future, state: str) -> None:
    if fut.done():
        return
    if state == "DONE":
        fut.set_result(None)
    else:
        fut.set_exception(RuntimeError("the NIXL transfer failed"))
