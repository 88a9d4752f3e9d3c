"""Disaggregated serving with an FP8 KV cache (``--kv-cache-dtype fp8``), real worker processes.

Two pairs at once, each in its own namespace:

* FP8 prefill -> FP8 decode over shm: the blocks move as they are, and the greedy output equals
  the single-process engine's with an FP8 cache;
* float32 prefill -> FP8 decode over nats: the dtypes differ, and the copy converts (the sender
  casts its blocks to the dtype the decode worker's params name): every long prompt is
  prefilled remotely (no fallback), and the output equals the same two engines in one process,
  the float32 prefill's blocks cast into the FP8 decode engine's (``KVCache.write_blocks``).

Each worker's card states its KV dtype.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import SampledToken
from tests.helpers.cluster import Watcher, run_all
from tests.helpers.procs import stop_processes
from tests.helpers.references import prompts_of

THRESHOLD = 64
LENGTHS = [5, 20, 70, 100, 150, 300]
LONG = sum(1 for n in LENGTHS if n >= THRESHOLD)
PROMPTS = prompts_of(LENGTHS, 4096, 11, low=3)


def greedy(model, kv_cache_dtype: str, max_tokens: int) -> list[list[int]]:
    engine = Engine(EngineConfig(model, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256))
    try:
        seqs = engine.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        return [s.output_token_ids for s in seqs]
    finally:
        engine.close()


def converted(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Float32 prefills into an FP8 decode engine, in one process: what the mixed pair does."""
    decode = Engine(EngineConfig(model, kv_cache_dtype="fp8", num_kv_blocks=64, enable_prefix_caching=False))
    prefill = Engine(EngineConfig(model, num_kv_blocks=64, enable_prefix_caching=False))
    outs = []
    try:
        for i, prompt in enumerate(prompts):
            seq = decode.new_sequence(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                      request_id=f"r{i}")
            assert decode.reserve_remote(seq)
            job = prefill.new_sequence(prompt, SamplingParams(max_tokens=1, temperature=0.0))
            job.hold_blocks = True
            prefill.add(job)
            while not job.is_finished:
                prefill.step()
            decode.kv_cache.write_blocks(seq.block_table, prefill.kv_cache.read_blocks(job.block_table))  # casts
            prefill.release(job.request_id)
            decode.complete_remote(f"r{i}", SampledToken(job.output_token_ids[0]))
            while not seq.is_finished:
                decode.step()
            outs.append(seq.output_token_ids)
        return outs
    finally:
        decode.close()
        prefill.close()


@pytest.fixture(scope="module")
def expected(tiny_model):
    fp8 = greedy(tiny_model, "fp8", 16)
    short = sum(1 for n in LENGTHS if n < THRESHOLD)  # prefilled by the decode worker itself
    return {"fp8": fp8, "mixed": fp8[:short] + converted(tiny_model, PROMPTS[short:], 16)}


async def test_fp8_pairs_serve_disaggregated_and_a_float32_prefill_converts(cluster, tiny_model, expected):
    common = ["--model", str(tiny_model), "--device-kv-blocks", "256"]
    pairs = {"same": ("shm", "fp8"), "mixed": ("nats", "auto")}  # transport, the prefill worker's KV dtype
    procs, watchers = [], {}
    for name, (transport, prefill_kv) in pairs.items():
        ns = f"kvd-{name}"
        flags = [*common, "--ns", ns, "--transports", transport]
        procs += [cluster.worker("decode", *flags, "--kv-cache-dtype", "fp8", "--disagg-threshold", str(THRESHOLD),
                                 "--worker-id", f"dec-{name}"),
                  cluster.worker("prefill", *flags, "--kv-cache-dtype", prefill_kv, "--prefill-capacity", "16",
                                 "--worker-id", f"pre-{name}")]
    try:
        for name in pairs:
            w = watchers[name] = await Watcher.open(cluster.nats_url, ns=f"kvd-{name}")
            await w.wait_for(lambda w=w, n=name: w.membership.get(f"dec-{n}") and w.membership.get(f"pre-{n}"),
                             120, f"the {name} pair")
        assert watchers["same"].membership.get("pre-same").kv_dtype == "float8_e4m3fn"
        assert watchers["mixed"].membership.get("pre-mixed").kv_dtype == "float32"
        assert {watchers[n].membership.get(f"dec-{n}").kv_dtype for n in pairs} == {"float8_e4m3fn"}
        for name, w in watchers.items():
            await w.fresh_load(f"pre-{name}")  # the decode worker hears the prefill pool's load too
        await asyncio.sleep(1.2)
        same, mixed = await asyncio.gather(*(run_all(watchers[n].bus, f"dec-{n}", PROMPTS) for n in pairs))

        assert [toks for toks, _ in same] == expected["fp8"]
        assert [toks for toks, _ in mixed] == expected["mixed"]
        assert expected["mixed"] != expected["fp8"]  # the float32 prefill's KV shows: a real mixed case
        for name, (transport, _) in pairs.items():
            d = await watchers[name].fresh_load(f"dec-{name}")
            assert d.counters.get("remote_prefill_done", 0) == LONG, (name, d.counters)
            assert d.counters.get(f"transport_{transport}", 0) == LONG
            assert d.counters.get("local_prefill", 0) == len(LENGTHS) - LONG
    finally:
        for w in watchers.values():
            await w.close()
        stop_processes(procs)
