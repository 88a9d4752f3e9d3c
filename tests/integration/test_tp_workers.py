"""Tensor-parallel workers as real processes: ``--tp 2`` workers (rank 0 the worker, rank 1 a
helper process it starts, gloo between them) next to ``--tp 1`` ones.

A prefill worker of one TP degree feeds a decode worker of another through each CPU
transport (shm: the prefill worker copies head ranges between the rank files; nats: the
full head set crosses the bus and the decode side splits it by rank): greedy output equals
the single-process TP=1 engine's. An aggregated ``--tp 2`` decode worker does too, and
killing its rank 0 with SIGKILL leaves no rank process behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from kvstore.transfer.shm import PREFIX, remove_stale_files, shm_dir
from tests.helpers.cluster import Watcher, run_all
from tests.helpers.layouts import rank_processes, run_on, start_split
from tests.helpers.procs import alive, stop_processes
from tests.helpers.references import prompts_of

THRESHOLD = 64
LENGTHS = [5, 20, 63, 64, 90, 150, 256, 400, 600]
LONG = sum(1 for n in LENGTHS if n >= THRESHOLD)
TRANSPORTS = ("shm", "nats")


def prompts(seed: int = 5):
    return prompts_of(LENGTHS, 4096, seed, low=3)


@pytest.fixture(scope="module")
def expected(tiny_model):
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=1024))
    seqs = engine.generate(prompts(), SamplingParams(max_tokens=16, temperature=0.0))
    return [s.output_token_ids for s in seqs]


@pytest.fixture(scope="module")
def splits(cluster, tiny_model):
    """``splits(prefill_tp, decode_tp)``: the namespace of a prefill worker of one TP degree and, for
    each transport, a decode worker of the other that offers only that one (``dec-<ns>-<transport>``),
    started on first use; the split asked for before is stopped then."""
    started: dict[tuple[int, int], tuple[str, list]] = {}
    stopping: list = []

    def split(prefill_tp: int, decode_tp: int) -> str:
        if (prefill_tp, decode_tp) not in started:
            for _, procs in started.values():  # stopping while the next split starts: waited for at the end
                for proc in procs:
                    proc.send_signal(signal.SIGTERM)
                stopping.extend(procs)
            started.clear()
            ns = f"tp-{prefill_tp}{decode_tp}"
            decodes = {f"dec-{ns}-{t}": (t, ["--tp", str(decode_tp)]) for t in TRANSPORTS}
            started[prefill_tp, decode_tp] = ns, start_split(cluster, tiny_model, ns, ["--tp", str(prefill_tp)],
                                                             decodes, THRESHOLD)
        return started[prefill_tp, decode_tp][0]

    yield split
    stop_processes([*stopping, *(p for _, procs in started.values() for p in procs)])


# grouped by TP degrees: the two decode workers of a split share its prefill worker
@pytest.mark.parametrize(("transport", "prefill_tp", "decode_tp"),
                         [("shm", 1, 2), ("nats", 1, 2), ("shm", 2, 1), ("nats", 2, 1)])
async def test_prefill_and_decode_of_different_tp_degrees(cluster, splits, expected, transport, prefill_tp, decode_tp):
    ns = splits(prefill_tp, decode_tp)
    run = await run_on(cluster, ns, f"dec-{ns}-{transport}", prompts(), 16)
    assert run.tokens == expected
    assert run.decode.counters.get("remote_prefill_done", 0) == LONG, run.decode.counters
    assert run.decode.counters.get(f"transport_{transport}", 0) == LONG
    assert run.decode.counters.get("local_prefill", 0) == len(LENGTHS) - LONG
    # the prefill worker's count over this transport: this decode worker's jobs (the other's go over its own)
    assert run.prefill.counters.get(f"transport_{transport}", 0) == LONG, run.prefill.counters
    assert run.decode.kv_blocks_used == 0 and run.decode.running == 0
    assert (run.decode_card.layout.tp, run.prefill_card.layout.tp) == (decode_tp, prefill_tp)


async def test_aggregated_tp2_worker_and_no_rank_outlives_a_killed_worker(cluster, tiny_model, expected):
    ns, dec = "tp-agg", "dec-tp-agg"
    worker = cluster.worker("decode", "--ns", ns, "--model", str(tiny_model), "--device-kv-blocks", "1024",
                            "--tp", "2", "--max-num-batched-tokens", "256", "--worker-id", dec)
    w = await Watcher.open(cluster.nats_url, ns=ns)
    try:
        await w.wait_for(lambda: w.membership.get(dec), 120, "the decode worker")
        # no prefill pool here: every prompt is prefilled by the worker's two ranks, in chunks
        results = await run_all(w.bus, dec, prompts())
        assert [toks for toks, _ in results] == expected
        d = await w.fresh_load(dec)
        assert d.counters.get("local_prefill", 0) == len(LENGTHS)
        ranks = rank_processes(worker.pid)
        assert len(ranks) == 1
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 15
        while any(alive(r) for r in ranks) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not any(alive(r) for r in ranks), "a tensor-parallel rank outlived its worker"
        # its KV files (one per rank) are stale now: the next decode worker's sweep removes them all
        files = list(shm_dir().glob(f"{PREFIX}{worker.pid}-*"))
        assert len([f for f in files if not f.name.endswith(".fence")]) == 2  # and the write fence
        remove_stale_files()
        assert not any(f.exists() for f in files)
    finally:
        await w.close()
