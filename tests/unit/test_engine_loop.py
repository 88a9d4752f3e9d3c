"""The engine thread: commands between steps, ordered outputs, and a failing step that fails
only its requests."""

from __future__ import annotations

import asyncio

from mesh.engine.loop import EngineLoop
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


async def test_a_failing_step_fails_its_requests_and_the_loop_serves_on():
    engine = Flaky(MockConfig(speedup=1000, num_blocks=64))
    outs: list = []
    loop = EngineLoop(engine, asyncio.get_running_loop())
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


async def test_a_fatal_engine_error_ends_the_loop_and_says_so():
    class Broken(RuntimeError):
        fatal = True

    class Dead(MockEngine):
        def execute(self, out):
            raise Broken("a rank is gone")

    engine = Dead(MockConfig(speedup=1000, num_blocks=64))
    outs: list = []
    died = asyncio.get_running_loop().create_future()
    loop = EngineLoop(engine, asyncio.get_running_loop(), on_failure=died.set_result)
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
