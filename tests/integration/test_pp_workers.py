"""Pipeline-parallel workers as real processes: ``--pp 2`` workers (rank 0 the worker, rank 1 a
helper process holding the second stage's layer, gloo between them) next to workers of other
layouts.

A prefill worker of one layout feeds a decode worker of another: the KV moves once, straight
into the rank that holds each layer (shm: the prefill worker copies each overlap of its parts
with the decode worker's rank files). Greedy output equals the single-process engine's. An
aggregated ``--pp 2`` decode worker does too; its card states its layout, ``mesh top`` shows it,
and when its second stage dies the next request ends with an error (nothing hangs) and the
worker exits non-zero and leaves the mesh. (That no rank outlives a killed rank 0 is the rank
group's, whatever the layout: tests/integration/test_tp_workers.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.client import generate
from mesh.protocol import GenerateRequest, SamplingOptions, WorkerLayout
from tests.helpers.cluster import Watcher, run_all
from tests.helpers.layouts import rank_processes, run_on, start_split
from tests.helpers.procs import stop_processes
from tests.helpers.references import prompts_of

THRESHOLD = 64
LENGTHS = [5, 40, 64, 90, 200]
LONG = sum(1 for n in LENGTHS if n >= THRESHOLD)


def prompts(seed: int = 7):
    return prompts_of(LENGTHS, 4096, seed, low=3)


@pytest.fixture(scope="module")
def expected(tiny_model):
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=1024))
    seqs = engine.generate(prompts(), SamplingParams(max_tokens=12, temperature=0.0))
    return [s.output_token_ids for s in seqs]


# a prefill worker's layout -> the layouts of the decode workers it feeds (over shm), in one namespace
SPLITS = {"pp-shm-1": ((), (("pp2", ["--pp", "2"]),)),
          "pp-shm-2": (("--pp", "2"), (("one", []), ("tp2", ["--tp", "2"])))}  # layers to heads: each rank file gets its overlap
# nats at PP: the whole pool block-major, split by stage (tests/unit/test_pp.py; kept out of the suite's time)


@pytest.fixture(scope="module")
def splits(cluster, tiny_model):
    """``splits(ns)``: the workers of ``SPLITS[ns]`` started (decode workers ``dec-<ns>-<name>``) on
    first use; the split asked for before is stopped then."""
    started: dict[str, list] = {}
    stopping: list = []

    def split(ns: str) -> None:
        if ns not in started:
            for procs in started.values():  # stopping while the next split starts: waited for at the end
                for proc in procs:
                    proc.send_signal(signal.SIGTERM)
                stopping.extend(procs)
            started.clear()
            prefill, decodes = SPLITS[ns]
            started[ns] = start_split(cluster, tiny_model, ns, list(prefill),
                                      {f"dec-{ns}-{name}": ("shm", layout) for name, layout in decodes}, THRESHOLD)

    yield split
    stop_processes([*stopping, *(p for procs in started.values() for p in procs)])


@pytest.mark.parametrize(("ns", "name"), [(ns, name) for ns, (_, decodes) in SPLITS.items() for name, _ in decodes])
async def test_prefill_and_decode_of_different_layouts(cluster, splits, expected, ns, name):
    splits(ns)
    prefill, decode = list(SPLITS[ns][0]), dict(SPLITS[ns][1])[name]
    run = await run_on(cluster, ns, f"dec-{ns}-{name}", prompts(), 12)
    transport = "shm"
    assert run.tokens == expected
    assert run.decode.counters.get("remote_prefill_done", 0) == LONG, run.decode.counters
    assert run.decode.counters.get(f"transport_{transport}", 0) == LONG
    assert run.prefill_delta(f"transport_{transport}") == LONG, run.prefill.counters  # (it may have fed another)
    assert run.decode.kv_blocks_used == 0 and run.decode.running == 0
    for card, layout in ((run.decode_card, decode), (run.prefill_card, prefill)):
        assert card.layout.pp == (2 if "--pp" in layout else 1)
        assert card.layout.tp == (2 if "--tp" in layout else 1)


async def test_aggregated_pp2_worker_its_card_and_a_dead_stage_ends_the_worker(cluster, tiny_model, expected):
    ns, dec = "pp-agg", "dec-pp-agg"
    worker = cluster.worker("decode", "--ns", ns, "--model", str(tiny_model), "--device-kv-blocks", "1024",
                            "--pp", "2", "--max-num-batched-tokens", "128", "--worker-id", dec)
    w = await Watcher.open(cluster.nats_url, ns=ns)
    try:
        await w.wait_for(lambda: w.membership.get(dec), 120, "the decode worker")
        assert w.membership.get(dec).layout == WorkerLayout(tp=1, pp=2, stage_layers=[1, 1])
        # no prefill pool here: every prompt is prefilled through both stages, in chunks and micro-batches
        results = await run_all(w.bus, dec, prompts(), max_tokens=12)
        assert [toks for toks, _ in results] == expected
        d = await w.fresh_load(dec)
        assert d.counters.get("local_prefill", 0) == len(LENGTHS)
        top = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "cli", "top", "--nats", cluster.nats_url, "--ns", ns, "--once"],
            capture_output=True, text=True, timeout=60)
        assert top.returncode == 0, top.stderr
        assert next(line for line in top.stdout.splitlines() if dec in line).split()[2] == "tp1xpp2"
        # the second stage dies: the next request fails, nothing hangs, and the worker leaves the mesh
        ranks = rank_processes(worker.pid)
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        req = GenerateRequest("after-the-stage-died", "tiny", prompts()[0], SamplingOptions(max_tokens=4, temperature=0.0))
        chunks = [c async for c in generate(w.bus, dec, req, first_timeout=60, idle_timeout=60)]
        assert chunks[-1].finish_reason == "error"
        assert await asyncio.to_thread(worker.wait, 60) == 1
        await w.wait_for(lambda: w.membership.get(dec) is None, 15, "the card to go")
    finally:
        await w.close()
