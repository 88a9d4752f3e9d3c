"""The decode worker's request lifecycle through the real path: a real ``DecodeWorker`` (mocker
engine: the real scheduler, block pool and emission) in this process, so that every request's
``DecodeRequest`` can be watched, a real nats-server, a real prefill worker process. After a
finish, a cancel (mid-decode and during a remote prefill), the prefill worker's death and the
engine's death, every request has reached a final state, the worker holds none, and the engine
holds no sequence and no block."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest

from decode.lifecycle import ReqState
from decode.request import DecodeRequest
from decode.worker import DecodeWorker
from engine.scheduler import StepOutput
from mesh.bus import Bus
from mesh.client import StreamError, cancel, generate
from mesh.protocol import GenerateRequest, SamplingOptions, TokenChunk, decode
from mocker.engine import MockConfig
from tests.helpers.cluster import Watcher
from worker.base import WorkerSettings, sampling_params

MODEL = "life"
THRESHOLD = 256  # prompts at least this long prefill remotely


class Recorded(dict):
    """``DecodeWorker.active``, remembering every request that ever went in."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __setitem__(self, key, value):
        self.seen.append(value)
        super().__setitem__(key, value)


async def start_decode(nats_url: str, speedup: float = 20.0, prefill_timeout: float = 1.0) -> DecodeWorker:
    worker = DecodeWorker(WorkerSettings(
        nats_url=nats_url, worker_id=f"life-dec-{uuid.uuid4().hex[:6]}",
        engine=MockConfig(model_name=MODEL, speedup=speedup, num_blocks=4096),
        disagg_threshold=THRESHOLD, prefill_timeout=prefill_timeout, metrics_port=-1, load_interval=0.2))
    worker.active = Recorded()
    worker.stop = asyncio.Event()
    worker.task = asyncio.create_task(worker.run(worker.stop))
    await asyncio.wait_for(worker.ready.wait(), 30)
    return worker


async def stop(worker: DecodeWorker) -> None:
    worker.stop.set()
    await asyncio.wait_for(worker.task, 30)


def assert_all_final(worker: DecodeWorker, *expected: ReqState) -> None:
    assert not worker.active
    assert worker.active.seen
    states = {r.state for r in worker.active.seen}
    assert all(s.is_final for s in states), states
    assert states <= set(expected), states


async def engine_is_empty(worker: DecodeWorker) -> None:
    def check(engine):
        s = engine.scheduler
        return len(s.running), len(s.waiting), len(s.remote), engine.pool.num_used

    for _ in range(100):
        if await worker.loop.call(check) == (0, 0, 0, 0):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine still holds work: {await worker.loop.call(check)}")


def request(n_prompt: int, max_tokens: int, seed: int = 0) -> GenerateRequest:
    prompt = [(7 * seed + 13 * j) % 30000 + 1 for j in range(n_prompt)]
    return GenerateRequest(uuid.uuid4().hex, MODEL, prompt, SamplingOptions(max_tokens=max_tokens, ignore_eos=True))


async def run_to_end(bus: Bus, worker_id: str, req: GenerateRequest) -> list:
    return [c async for c in generate(bus, worker_id, req, first_timeout=30, idle_timeout=30)]


@pytest.fixture
async def bus(nats_server):
    b = await Bus.connect(nats_server.url, "lifecycle-test")
    yield b
    await b.close()


async def wait_state(worker: DecodeWorker, rid: str, state: ReqState, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.01)):
        rec = next((r for r in worker.active.seen if r.request_id == rid), None)
        if rec is not None and rec.state is state:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} never reached {state.name}")


async def test_finished_and_cancelled_requests_end_final(nats_server, bus):
    worker = await start_decode(nats_server.url, speedup=5.0)
    try:
        done = await asyncio.gather(*(run_to_end(bus, worker.worker_id, request(40, 20, i)) for i in range(6)))
        assert all(chunks[-1].finish_reason == "length" for chunks in done)
        assert all(sum(len(c.token_ids) for c in chunks) == 20 for chunks in done)
        # cancelled mid-decode
        long = request(40, 100_000, 99)
        stream = generate(bus, worker.worker_id, long, first_timeout=30, idle_timeout=30)
        await anext(stream)
        await wait_state(worker, long.request_id, ReqState.DECODING)
        await cancel(bus, MODEL, worker.worker_id, long.request_id, worker.active[long.request_id].reply)
        await wait_state(worker, long.request_id, ReqState.CANCELLED)
        await stream.aclose()
        assert_all_final(worker, ReqState.FINISHED, ReqState.CANCELLED)
        await engine_is_empty(worker)
    finally:
        await stop(worker)


async def test_remote_prefill_cancelled_waits_for_its_blocks_and_a_dead_prefill_worker_falls_back(
        cluster, nats_server, bus):
    # a slow mock prefill worker: a long prompt takes it about 2 s
    prefill = cluster.worker("prefill", "--mock", "--served-name", MODEL, "--worker-id", "life-pre",
                             "--mock-speedup", "0.03", "--prefill-capacity", "8")
    worker = await start_decode(nats_server.url, prefill_timeout=1.0)
    w = await Watcher.open(nats_server.url)
    try:
        await w.wait_for(lambda: w.membership.get("life-pre"), 30, "the prefill worker")
        await w.fresh_load("life-pre")
        await asyncio.sleep(0.5)  # the decode worker hears the prefill worker's load too

        # cancelled while the prefill worker owns the blocks: CANCELLING until it lets go
        req = request(1000, 8, 1)
        stream = generate(bus, worker.worker_id, req, first_timeout=30, idle_timeout=30)
        first = asyncio.ensure_future(anext(stream))
        await wait_state(worker, req.request_id, ReqState.WAITING_FOR_KV)
        await cancel(bus, MODEL, worker.worker_id, req.request_id, worker.active[req.request_id].reply)
        await wait_state(worker, req.request_id, ReqState.CANCELLING)
        await wait_state(worker, req.request_id, ReqState.CANCELLED)  # its PrefillDone or deadline came
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        await engine_is_empty(worker)

        # the prefill worker dies holding the job: the deadline passes, the request prefills here
        req = request(1000, 8, 2)
        task = asyncio.ensure_future(run_to_end(bus, worker.worker_id, req))
        await wait_state(worker, req.request_id, ReqState.WAITING_FOR_KV)
        os.kill(prefill.pid, signal.SIGKILL)
        chunks = await asyncio.wait_for(task, 30)
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 8
        assert worker.counters.by_key.get("local_prefill_fallback", 0) >= 1
        assert_all_final(worker, ReqState.FINISHED, ReqState.CANCELLED)
        await engine_is_empty(worker)
    finally:
        await w.close()
        await stop(worker)


async def test_an_engine_that_dies_fails_every_request_it_held(nats_server, bus):
    worker = await start_decode(nats_server.url, speedup=2.0)
    try:
        reqs = [request(40, 100_000, i) for i in range(3)]
        streams = [generate(bus, worker.worker_id, r, first_timeout=30, idle_timeout=30) for r in reqs]
        await asyncio.gather(*(anext(s) for s in streams))

        class Broken(RuntimeError):
            fatal = True

        def explode():
            raise Broken("the device is gone")

        worker.engine.step = explode
        ends = []
        for s in streams:
            last = None
            try:
                async for c in s:
                    last = c
            except StreamError:
                pass
            ends.append(last)
        assert all(c is not None and c.finish_reason == "error" for c in ends), ends
        await asyncio.wait_for(worker.task, 30)
        assert worker.exit_code == 1
        assert_all_final(worker, ReqState.FAILED)
    finally:
        worker.stop.set()


async def test_a_first_output_delivered_before_the_admission_result_is_not_lost(nats_server, bus):
    """The engine may step a request (and its output may be handled) before the event loop has
    resumed the admission that added it: that output is the request's first chunk, not dropped."""
    worker = await start_decode(nats_server.url)
    try:
        req = request(8, 4, 5)
        seq = worker.engine.new_sequence(req.token_ids, sampling_params(req.sampling), request_id=req.request_id)
        inbox = bus.nc.new_inbox()
        sub = await bus.nc.subscribe(inbox)
        # The server has our subscription once a message of our own came back through it (nats-py
        # sends flush()'s PING ahead of a SUB still in its buffer: flush is no barrier here).
        await bus.nc.publish(inbox, b"probe")
        assert (await sub.next_msg(timeout=10)).data == b"probe"
        rec = DecodeRequest(req, inbox, seq, 0.0)
        worker.active[req.request_id] = rec  # as _on_generate leaves it while the admission runs
        await worker.handle_outputs([StepOutput(req.request_id, [42], [], None, 8, 0, 1)])
        chunk = decode((await sub.next_msg(timeout=10)).data, TokenChunk)
        assert (chunk.index, chunk.token_ids, chunk.usage.prompt_tokens) == (0, [42], 8)
        assert rec.state is ReqState.DECODING and rec.chunks_sent == 1
    finally:
        worker.active.pop(req.request_id, None)
        await stop(worker)
