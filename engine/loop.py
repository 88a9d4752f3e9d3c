"""Runs an engine in a thread of its own, driven from asyncio.

The event loop never waits on a model step. It hands the engine thread
closures (``call``); the thread runs them between steps, in order, and
resolves their futures on the event loop. Step outputs wait in order until the
loop takes them (``await outputs()``); only the first step to end after the
loop last took them wakes it, so a loop busy sending one step's tokens takes
every step that ended meanwhile in one go (one wake-up, one message per
destination for all of them).

    asyncio side                      engine thread
    ------------                      -------------
    await loop.call(fn) --queue-->    fn(engine) between two steps
                      <--future--     result / exception
    await outputs()   <--pending--    engine.step() (wakes the loop only if it waits)
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from engine.scheduler import StepOutput
from mesh.procutil import on_tick

log = logging.getLogger(__name__)

CHAIN_S = 0.0005  # InlineEngineLoop: longest run of back-to-back steps before the event loop's turn


class Steppable(Protocol):
    @property
    def has_work(self) -> bool: ...

    def step(self) -> list: ...


class EngineLoop:
    def __init__(
        self,
        engine: Steppable,
        loop: asyncio.AbstractEventLoop,
        after_work: Callable[[Any], None] | None = None,
        name: str = "engine",
        on_failure: Callable[[BaseException], None] | None = None,
    ):
        self.engine = engine
        self.loop = loop
        self.after_work = after_work  # engine thread, after every step and every batch of commands
        self.on_failure = on_failure  # event loop: the engine thread died
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: deque[list] = deque()  # step outputs the event loop has not taken yet
        self._signalled = True  # the loop was woken (or is not waiting): later emits need not wake it
        self._ready = asyncio.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.step_seconds = 0.0  # duration of the last step
        self.failure: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run ``fn(engine)`` in the engine thread between steps."""
        fut = self.loop.create_future()
        self._commands.put((fn, fut))
        return fut

    def emit(self, outs: list) -> None:
        """From the engine thread (also inside a ``call``): deliver outputs in order with the step
        outputs. Only the first emit after the loop started waiting wakes it."""
        if outs:
            self._pending.append(outs)  # before reading the flag: a waiter that resets it
            if not self._signalled:  # after we read it finds this list
                self._signalled = True
                self.loop.call_soon_threadsafe(self._ready.set)

    @property
    def has_outputs(self) -> bool:
        """On the event loop: outputs are waiting (``outputs()`` returns at once)."""
        return bool(self._pending)

    async def outputs(self) -> list:
        """On the event loop: every output emitted since the last call, in order (waits for one)."""
        pending = self._pending
        while True:
            self._signalled = False  # before looking: an emit that sees it unset wakes us
            self._ready.clear()
            if pending:
                break
            await self._ready.wait()
        outs: list = []
        while pending:
            outs.extend(pending.popleft())
        return outs

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work)
                if self._stop.is_set() or not self.engine.has_work:
                    continue
                t0 = time.perf_counter()
                try:
                    outs = self.engine.step()
                except Exception as e:
                    # One bad step fails the requests in it, not the worker...
                    log.exception("engine step failed; failing the running requests")
                    outs = self._fail_running()
                    if getattr(e, "fatal", False):  # ...unless the engine can never step again
                        self.failure = e  # before its requests' outputs: they fail with the worker
                        self.emit(outs)
                        raise
                self.step_seconds = time.perf_counter() - t0
                self.emit(outs)
                self._after_work()
        except BaseException as e:  # a broken engine must be visible, not a silent dead thread
            self.failure = e
            log.exception("engine thread died")
            if self.on_failure is not None:
                self.loop.call_soon_threadsafe(self.on_failure, e)

    def _fail_running(self) -> list:
        outs = []
        for seq in list(self.engine.scheduler.running):
            self.engine.abort(seq.request_id)
            outs.append(StepOutput(seq.request_id, [], [], "error", seq.num_prompt_tokens,
                                   seq.num_cached_tokens, seq.num_output_tokens))
        return outs

    def _drain(self, block: bool) -> None:
        if not block and self._commands.empty():  # between two steps, most of the time
            return
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            try:
                result = fn(self.engine)
            except Exception as e:
                self.loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self.loop.call_soon_threadsafe(_set_result, fut, result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
        self._after_work()

    def _after_work(self) -> None:
        if self.after_work is not None:
            try:
                self.after_work(self.engine)
            except Exception:
                log.exception("after-work hook failed")


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class InlineEngineLoop(EngineLoop):
    """``EngineLoop`` without the thread, for engines whose step never blocks: the mocker, whose
    timing model is a pause this loop awaits (``MockEngine.paced``) rather than a sleep.

    The steps run in a task on the event loop itself, so a step's outputs reach the worker with
    no GIL hand-over and no wake-up through the loop's self-pipe, and a paused engine costs
    nothing: per step, the worker spends on scheduling, bookkeeping and emission only, which is
    what the mocker is there to measure (python -m bench host-overhead, ../shared/peers). Same
    contract: commands run in order between steps, outputs come in order from ``outputs()``.

    The pace: each step's simulated seconds are added to a due time and awaited, so over many
    steps the engine runs at its timing model even though the loop's timers are millisecond
    grained; a host slower than the model (more than 10 ms behind) runs the steps back to back.
    A step's outputs and KV events leave at its due time, as a GPU step's leave when it ends
    (sent when the step started, a first token skipped its own prefill's time: TTFT without
    the prefill, and no prefix hit could shorten it).
    With a step grid (the mocker's ``--mock-step-grid-ms``) each step's due time moves to the nearest
    tick of the process's grid: the engines of one process (``worker.host``) then end their steps
    in the same turn of the loop, and their outputs (token batches, KV events) leave together, as
    one host stepping its workers on one clock would send them. A step of the grid's period stays
    that long; an idle engine's first step ends at the tick nearest its due time (half a period
    sooner or later).
    While it is behind, steps also run back to back within one turn of the event loop, for up to
    ``CHAIN_S``: a turn of the loop (poll, callbacks, the pacing sleep) per step cost the mocker
    as much as the step at small batches, and what a step's outputs wait for (the loop's turn)
    is at most that half millisecond, under the stream interval.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grid = getattr(self.engine, "step_grid_s", 0.0)  # steps end on the process's grid of this period
        self._queue: deque = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.engine.paced = True  # execute() owes its pause to us instead of sleeping
        self._task = self.loop.create_task(self._run_inline(), name="engine-inline")

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        fut = self.loop.create_future()
        self._queue.append((fn, fut))
        self._wake.set()
        return fut

    def emit(self, outs: list) -> None:
        if outs:
            self._pending.append(outs)
            if not self._signalled:
                self._signalled = True
                self._ready.set()

    def _run_commands(self) -> None:
        while self._queue:
            fn, fut = self._queue.popleft()
            try:
                result = fn(self.engine)
            except Exception as e:
                _set_exception(fut, e)
            else:
                _set_result(fut, result)
        self._after_work()

    async def _run_inline(self) -> None:
        engine, clock = self.engine, self.loop.time
        due = clock()
        try:
            while not self._stop.is_set():
                if self._queue:
                    self._run_commands()
                if not engine.has_work:
                    self._wake.clear()
                    if not self._queue:
                        await self._wake.wait()
                    due = clock()
                    continue
                # Steps run back to back while the engine is behind its pace, for up to CHAIN_S;
                # then the loop gets its turn (arrivals, this run's outputs, commands).
                chain_end = time.perf_counter() + CHAIN_S
                while True:
                    t0 = time.perf_counter()
                    try:
                        outs = engine.step()
                    except Exception as e:
                        log.exception("engine step failed; failing the running requests")
                        outs = self._fail_running()
                        if getattr(e, "fatal", False):
                            self.failure = e  # as EngineLoop's
                            self.emit(outs)
                            raise
                    t1 = time.perf_counter()
                    self.step_seconds = t1 - t0
                    due += engine.take_owed_seconds()
                    if self.grid:
                        due = on_tick(due, self.grid)
                    delay = due - clock()
                    if delay > 0:
                        break  # its outputs leave when its time is up, after the pause below
                    self.emit(outs)
                    self._after_work()
                    if t1 >= chain_end or not engine.has_work:
                        break
                if delay < -0.01:
                    due = clock()
                await asyncio.sleep(max(delay, 0.0))  # also lets the loop send these steps' outputs
                if delay > 0:  # the last step's outputs waited for its time
                    self.emit(outs)
                    self._after_work()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.failure = e
            log.exception("engine task died")
            if self.on_failure is not None:
                self.on_failure(e)

