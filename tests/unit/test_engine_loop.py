"""The engine thread (and the mocker's inline loop, which keeps the same contract without the
thread): commands between steps, ordered outputs, a failing step that fails only its requests,
and the mocker's timing model kept as a pace."""

from __future__ import annotations

import asyncio
import time

import pytest

from mesh.engine.loop import EngineLoop, InlineEngineLoop
from mesh.engine.sampling import SamplingParams
from mesh.mocker.engine import MockConfig, MockEngine


class Flaky(MockEngine):
    """A mocker whose next step raises once when told to."""

    explode = False

    def execute(self, out):
        if self.explode:
            self.explode = False
            raise RuntimeError("boom")
        return super().execute(out)


async def gather(loop: EngineLoop, outs: list) -> None:
    while True:
        outs.extend(await loop.outputs())


LOOPS = pytest.mark.parametrize("loop_type", [EngineLoop, InlineEngineLoop])


@LOOPS
async def test_a_failing_step_fails_its_requests_and_the_loop_serves_on(loop_type):
    engine = Flaky(MockConfig(speedup=1000, num_blocks=64))
    outs: list = []
    loop = loop_type(engine, asyncio.get_running_loop())
    collect = asyncio.create_task(gather(loop, outs))
    loop.start()
    try:
        def add(e, rid, n):
            e.add(e.new_sequence([1, 2, 3], SamplingParams(max_tokens=n), request_id=rid))

        engine.explode = True
        await loop.call(lambda e: add(e, "doomed", 50))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if any(o.request_id == "doomed" and o.finish_reason for o in outs):
                break
        doomed = [o for o in outs if o.request_id == "doomed" and o.finish_reason]
        assert doomed and doomed[-1].finish_reason == "error"
        assert engine.pool.num_used == 0  # its blocks came back
        await loop.call(lambda e: add(e, "fine", 5))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if any(o.request_id == "fine" and o.finish_reason for o in outs):
                break
        fine = [o for o in outs if o.request_id == "fine"]
        assert fine[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in fine) == 5
        assert loop.failure is None
    finally:
        loop.stop()
        collect.cancel()


@LOOPS
async def test_a_fatal_engine_error_ends_the_loop_and_says_so(loop_type):
    class Broken(RuntimeError):
        fatal = True

    class Dead(MockEngine):
        def execute(self, out):
            raise Broken("a rank is gone")

    engine = Dead(MockConfig(speedup=1000, num_blocks=64))
    outs: list = []
    died = asyncio.get_running_loop().create_future()
    loop = loop_type(engine, asyncio.get_running_loop(), on_failure=died.set_result)
    collect = asyncio.create_task(gather(loop, outs))
    loop.start()
    try:
        await loop.call(lambda e: e.add(e.new_sequence([1, 2, 3], SamplingParams(max_tokens=5), request_id="r")))
        error = await asyncio.wait_for(died, 10)
        assert isinstance(error, Broken) and loop.failure is error
        await asyncio.sleep(0.05)
        assert [o.finish_reason for o in outs if o.request_id == "r"] == ["error"]  # its request was failed
    finally:
        loop.stop()
        collect.cancel()


async def test_the_inline_loop_keeps_the_timing_model_and_the_order_of_commands():
    """The mocker's pause is awaited, not slept: the loop stays free during it (a coroutine runs
    many times), the steps still take the model's time in sum, and commands run between steps."""
    engine = MockEngine(MockConfig(speedup=20, num_blocks=64))  # 8 ms decode steps -> 0.4 ms each
    outs: list = []
    loop = InlineEngineLoop(engine, asyncio.get_running_loop())
    collect = asyncio.create_task(gather(loop, outs))
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    loop.start()
    try:
        t0 = time.monotonic()
        seen = await loop.call(lambda e: e.add(e.new_sequence([1, 2, 3], SamplingParams(max_tokens=40),
                                                              request_id="r")) or e.num_steps)
        while not any(o.finish_reason for o in outs):
            await asyncio.sleep(0.005)
        elapsed = time.monotonic() - t0
        assert seen == 0 and engine.paced
        assert elapsed >= 0.9 * engine.simulated_seconds > 0  # the model's time, awaited
        assert ticks > engine.num_steps  # other coroutines ran while the engine paused
        assert sum(len(o.new_token_ids) for o in outs) == 40
        assert await loop.call(lambda e: e.has_work) is False
    finally:
        loop.stop()
        collect.cancel()
        tick.cancel()
