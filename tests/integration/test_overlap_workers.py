"""Workers with overlapped scheduling (``--async-scheduling``), as real processes on a real bus.

A decode and a prefill worker of the tiny model, both overlapped, with the shm transport: long
prompts are prefilled remotely, short ones locally, and every greedy output equals the
single-process engine's (which runs without overlap). A request cancelled mid-stream stops,
and every block comes back.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.client import cancel, generate
from mesh.protocol import GenerateRequest, SamplingOptions
from tests.helpers.cluster import Watcher, stream_tokens
from tests.helpers.references import prompts_of

THRESHOLD = 64
LENGTHS = [5, 20, 48, 70, 130, 256, 333, 512]
NS = "overlap"


def prompts(seed: int = 0):
    return prompts_of(LENGTHS, 4096, seed, low=3)


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=1024))
    seqs = engine.generate(prompts(), SamplingParams(max_tokens=16, temperature=0.0))
    return {tuple(s.prompt_token_ids): s.output_token_ids for s in seqs}


async def test_overlapped_workers_give_the_engines_tokens_and_cancel_cleanly(cluster, tiny_model, reference):
    flags = ["--ns", NS, "--model", str(tiny_model), "--device-kv-blocks", "1024", "--transports", "shm",
             "--async-scheduling"]
    cluster.worker("decode", *flags, "--disagg-threshold", str(THRESHOLD), "--worker-id", "dec-ovl")
    cluster.worker("prefill", *flags, "--worker-id", "pre-ovl", "--prefill-capacity", "8")
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        await w.wait_for(lambda: w.membership.get("dec-ovl") and w.membership.get("pre-ovl"), 180, "both workers")
        await w.fresh_load("pre-ovl")
        await asyncio.sleep(1.2)
        results = await asyncio.gather(*(stream_tokens(w.bus, "dec-ovl", p) for p in prompts()))
        for p, (toks, last) in zip(prompts(), results, strict=True):
            assert toks == reference[tuple(p)], f"prompt of {len(p)} tokens differs"
            assert last.finish_reason == "length" and last.usage.prompt_tokens == len(p)
        dec = await w.fresh_load("dec-ovl")
        long_ones = sum(1 for n in LENGTHS if n >= THRESHOLD)
        assert dec.counters.get("remote_prefill_done", 0) == long_ones, dec.counters

        # a long generation cancelled after its first tokens (as the gateway does when its client
        # leaves: it stops reading and publishes a cancel): the worker frees everything
        req = GenerateRequest(uuid.uuid4().hex, "tiny", prompts(1)[2],
                              SamplingOptions(max_tokens=2000, temperature=0.0, ignore_eos=True))
        got = 0
        reply = w.bus.nc.new_inbox()
        async for chunk in generate(w.bus, "dec-ovl", req, first_timeout=120, idle_timeout=30, reply=reply):
            assert chunk.finish_reason is None
            got += len(chunk.token_ids)
            if got >= 3:
                await cancel(w.bus, "tiny", "dec-ovl", req.request_id, reply)
                break
        cancelled_at = time.time()
        await w.wait_for(lambda: (r := w.loads.get("dec-ovl")) and r.timestamp > cancelled_at and r.running == 0
                         and r.kv_blocks_used == 0, 30, "every block back after the cancel")
        assert (await w.fresh_load("dec-ovl")).counters.get("cancelled", 0) == 1
    finally:
        await w.close()
