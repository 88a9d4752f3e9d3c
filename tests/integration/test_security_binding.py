"""Request-scoped messages count only from the peer the request is bound to, and a late KV copy
never lands in reused blocks: real nats-server, real decode and prefill worker processes (one
pair for the whole module: starting them is most of its time).

- A ``Cancel`` naming another reply subject (another gateway's) does not cancel the request.
- A forged ``PrefillDone`` (ok, a wrong first token, no job token), sent the moment the job is
  queued, is dropped: the request's tokens are the single-process engine's.
- A shm copy that ends after the job's deadline (held back by ``MESH_FAULT_KV_COPY_DELAY_S``):
  the request falls back to a local prefill with the right tokens at the deadline; the blocks
  the copy writes stay out of the pool until it has ended (its PrefillDone); the next request,
  served meanwhile from a small pool, and the same prompt again from its cached blocks after
  the copy landed, are token-identical to the single-process engine.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.protocol import (
    Cancel,
    GenerateRequest,
    PrefillDone,
    PrefillJob,
    SamplingOptions,
    TokenChunk,
    decode,
)
from tests.helpers.cluster import Watcher

MAX_TOKENS = 8
DELAY = 7.0  # how long the late copy waits under its fence, seconds
TIMEOUT = 2.0  # the decode worker's --prefill-timeout in the slow-copy test


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineConfig(tiny_model, num_kv_blocks=64))


def expected(engine, p: list[int], n: int = MAX_TOKENS) -> list[int]:
    return engine.generate([p], SamplingParams(max_tokens=n, temperature=0.0))[0].output_token_ids


async def stream(bus, worker: str, req: GenerateRequest, on_first=None) -> tuple[list[int], TokenChunk]:
    """The request's chunks, on our own reply subject (as a gateway would)."""
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    toks: list[int] = []
    try:
        await bus.publish(bus.subjects.generate(req.model, worker), req, reply=inbox)
        while True:
            chunk = decode((await sub.next_msg(timeout=60)).data, TokenChunk)
            assert chunk.error is None, chunk.error
            toks += chunk.token_ids
            if on_first is not None and chunk.index == 0:
                await on_first(inbox)
            if chunk.finish_reason is not None:
                return toks, chunk
    finally:
        await sub.unsubscribe()


PRE, DEC = "pre-bind", "dec-bind"
BLOCKS = 22  # a small pool: without the fence, the next request is handed the late copy's blocks


async def test_unbound_messages_are_dropped_and_a_slow_copy_is_fenced(cluster, tiny_model, engine):
    flags = ["--model", str(tiny_model), "--device-kv-blocks", str(BLOCKS), "--transports", "shm"]
    cluster.worker("prefill", *flags, "--worker-id", PRE, env={"MESH_FAULT_KV_COPY_DELAY_S": str(DELAY)})
    cluster.worker("decode", *flags, "--worker-id", DEC, "--disagg-threshold", "64",
                   "--prefill-timeout", str(TIMEOUT))
    w = await Watcher.open(cluster.nats_url)
    bus = w.bus
    dones: list[PrefillDone] = []

    async def on_done(msg: PrefillDone, raw) -> None:
        dones.append(msg)

    def real() -> list[PrefillDone]:
        return [d for d in dones if d.token != "guessed"]

    def request(p: list[int], n: int = MAX_TOKENS) -> GenerateRequest:
        return GenerateRequest(uuid.uuid4().hex, "tiny", p, SamplingOptions(max_tokens=n, temperature=0.0))

    try:
        await bus.subscribe(bus.subjects.kv_ready("tiny", DEC), on_done, PrefillDone)
        await w.wait_for(lambda: w.membership.get(PRE) and w.membership.get(DEC), 120, "both workers")
        await w.fresh_load(PRE)  # the decode worker hears the prefill worker's load too
        await asyncio.sleep(1.2)

        # 1. A forged PrefillDone the moment the job is queued; the real copy ends after the deadline.
        a = prompt(150, 2)  # 10 blocks of 16 for the prefill worker to write
        want = expected(engine, a)
        forged: list[str] = []

        async def on_job(msg) -> None:
            job = decode(msg.data, PrefillJob)
            assert job.token  # the job's capability, which the real PrefillDone echoes
            await bus.publish(bus.subjects.kv_ready("tiny", DEC), PrefillDone(
                request_id=job.request_id, prefill_worker=PRE, ok=True, token_id=(want[0] + 1) % 4096,
                transport="shm", token="guessed"))
            forged.append(job.request_id)

        spy = await bus.nc.subscribe(bus.subjects.prefill_jobs("tiny"), cb=on_job)
        try:
            req = request(a)
            toks, last = await stream(bus, DEC, req)
        finally:
            await spy.unsubscribe()
        assert forged == [req.request_id]
        assert toks == want and last.finish_reason == "length"
        assert not real()  # the real copy had not ended: it fell back at the deadline, not after the copy

        # 2. The next request, while the late copy still holds its blocks: served from others.
        b = prompt(60, 3)
        toks, _ = await stream(bus, DEC, request(b))
        assert toks == expected(engine, b)
        report = await w.fresh_load(DEC)
        assert not real(), "the late copy ended too early for this test to mean anything"
        c = report.counters
        assert c.get("refused_messages") == 1 and c.get("local_prefill_fallback") == 1, c
        assert c.get("fenced_jobs") == 1 and not c.get("unfenced_jobs"), c
        assert report.kv_blocks_used == 10 and report.running == report.waiting == 0  # held for the copy

        # 3. The copy ends (its PrefillDone): the blocks come back, and what the copy wrote landed
        # in none of the next request's blocks: the same prompt again, from its cached prefix.
        await w.wait_for(real, DELAY + 10, "the late copy's end")
        (done,) = real()
        assert not done.ok and done.request_id == req.request_id
        report = await w.wait_for(lambda: (r := w.loads.get(DEC)) and r.counters.get("unfenced_jobs") and r,
                                  10, "the fenced blocks back in the pool")
        assert report.kv_blocks_used == 0
        toks, last = await stream(bus, DEC, request(b))
        assert last.usage.cached_tokens >= 48  # read from the blocks the second request left
        assert toks == expected(engine, b)

        # 4. Another gateway's Cancel (its own reply subject) for our request: refused.
        req = request(prompt(20, 1), 300)

        async def forge_cancel(_inbox: str) -> None:
            await bus.publish(bus.subjects.cancel("tiny", DEC), Cancel(req.request_id, reply=bus.nc.new_inbox()))

        toks, last = await stream(bus, DEC, req, on_first=forge_cancel)
        assert last.finish_reason == "length" and len(toks) == 300  # not cancelled
        report = await w.fresh_load(DEC)
        assert report.counters.get("refused_messages") == 2, report.counters
    finally:
        await w.close()
