"""The engine thread (and the mocker's inline loop, which keeps the same contract without the
thread): commands between steps, ordered outputs, a failing step that fails only its requests,
and the mocker's timing model kept as a pace."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.loop import EngineLoop, InlineEngineLoop
from engine.sampling import SamplingParams
from mocker.engine import MockConfig, MockEngine


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


@LOOPS
async def test_a_steps_outputs_leave_when_its_simulated_time_is_up(loop_type):
    """A first token arrives after its prefill's simulated time, not when the step starts: a
    prefix hit must be able to shorten a TTFT (python -m bench trace-replay measures exactly that)."""
    engine = MockEngine(MockConfig(speedup=2, num_blocks=256))  # 1,000 prompt tokens: 62 ms / 2
    outs: list = []
    loop = loop_type(engine, asyncio.get_running_loop())
    collect = asyncio.create_task(gather(loop, outs))
    loop.start()
    try:
        t0 = time.monotonic()
        await loop.call(lambda e: e.add(e.new_sequence(list(range(1, 1001)), SamplingParams(max_tokens=1),
                                                       request_id="r")))
        while not outs:
            await asyncio.sleep(0.001)
        first = time.monotonic() - t0
        assert engine.num_steps == 1 and engine.simulated_seconds >= 0.03
        assert first >= 0.9 * engine.simulated_seconds
    finally:
        loop.stop()
        collect.cancel()


async def test_the_inline_loop_runs_steps_back_to_back_while_behind_its_pace():
    """Behind its timing model (simulated steps far shorter than the host's), the mocker runs
    several steps per turn of the event loop, and the loop still gets its turns."""
    engine = MockEngine(MockConfig(speedup=1e6, num_blocks=256))  # nanosecond steps: always behind
    outs: list = []
    loop = InlineEngineLoop(engine, asyncio.get_running_loop())
    collect = asyncio.create_task(gather(loop, outs))
    ticks = 0
    counting = True

    async def ticker():
        nonlocal ticks
        while counting:
            ticks += 1
            await asyncio.sleep(0)

    loop.start()
    try:
        await loop.call(lambda e: [e.add(e.new_sequence([1, 2, 3], SamplingParams(max_tokens=300, ignore_eos=True),
                                                        request_id=f"r{i}")) for i in range(4)])
        tick = asyncio.create_task(ticker())
        while sum(1 for o in outs if o.finish_reason) < 4:
            await asyncio.sleep(0)
        counting = False
        await tick
        assert engine.num_steps >= 300
        assert 0 < ticks < engine.num_steps / 2  # turns of the loop, each with several steps
        assert sum(len(o.new_token_ids) for o in outs) == 1200
    finally:
        loop.stop()
        collect.cancel()


async def test_engines_on_one_step_grid_end_their_steps_in_the_same_turn():
    """``--mock-step-grid-ms``: the engines of one process end their steps on the ticks of one grid
    (a host stepping its workers together), so their outputs leave in the same turn of the loop;
    a step of the grid's period keeps its length, whenever its engine began."""
    from mesh.procutil import on_tick
    from mocker.engine import TimingModel

    assert abs(on_tick(on_tick(12.3456, 0.02) + 0.02, 0.02) - on_tick(12.3456, 0.02) - 0.02) < 1e-9
    assert abs(on_tick(12.3456, 0.02) - 12.3456) <= 0.01
    timing = TimingModel(prefill_base_ms=0, prefill_ms_per_token=0.001, prefill_ms_per_token_ctx=0,
                         decode_base_ms=20, decode_ms_per_seq=0, decode_ms_per_kv_token=0)
    turn = 0
    turns: dict[str, list[int]] = {"a": [], "b": []}

    async def ticker():
        nonlocal turn
        while True:
            turn += 1
            await asyncio.sleep(0)

    async def collect(loop, name):
        while True:
            await loop.outputs()
            turns[name].append(turn)

    tick = asyncio.create_task(ticker())
    loops, tasks = {}, []
    try:
        for name in ("a", "b"):
            engine = MockEngine(MockConfig(num_blocks=64, timing=timing, step_grid_ms=20))
            loops[name] = loop = InlineEngineLoop(engine, asyncio.get_running_loop())
            tasks.append(asyncio.create_task(collect(loop, name)))
            loop.start()
            await loop.call(lambda e: e.add(e.new_sequence([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True),
                                                           request_id="r")))
            await asyncio.sleep(0.007)  # b begins off a's phase
        while not all(lp.engine.num_steps >= 8 and not lp.engine.has_work for lp in loops.values()):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.03)
        # together: within a turn or two (the ticker may run between the two collectors' wake-ups);
        # 7 ms apart, without the grid, they are thousands of turns apart
        together = [t for t in turns["b"] if any(abs(t - u) <= 2 for u in turns["a"])]
        assert len(together) >= 5, turns  # all but the first step or two of each
    finally:
        for loop in loops.values():
            loop.stop()
        for t in (tick, *tasks):
            t.cancel()


def test_settle_heap_freezes_start_up_objects_and_collects_less_often():
    import gc

    from mesh.procutil import GC_GEN0, settle_heap

    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == GC_GEN0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
