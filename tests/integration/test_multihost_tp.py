"""nixl between hosts at several ranks (issue 50): a ``--tp 2`` prefill worker on one simulated
host feeds a ``--tp 1`` and a ``--tp 2`` decode worker on another (``tests.helpers.hostbed``:
network, mount and UTS namespaces), over ``--transports nixl,nats``.

Every rank of each worker runs its own NIXL agent and registers its part of the KV: the prefill
worker's rank r writes the heads it holds straight into the decode ranks that hold them (one
NIXL transfer and one notification per pair of ranks). Greedy tokens equal the single-process
engine's for both decode workers, every long prompt's KV crossed on nixl (both sides' counters),
and the bytes the prefill worker counts on the nixl transport (``pdmesh_kv_transfer_bytes``) are
exactly the long prompts' blocks.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.helpers.cluster import Watcher, run_all
from tests.helpers.hostbed import HostBed, unavailable_reason
from tests.helpers.references import prompts_of

pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")

THRESHOLD = 64
LENGTHS = [20, 70, 150, 333]
LONG = [n for n in LENGTHS if n >= THRESHOLD]
MAX_TOKENS = 8
BS = 16
METRICS_PORT = 9466


@pytest.fixture
def bed(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with HostBed(2, name="tp", log_dir=tmp_path) as bed:
        yield bed


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=256))
    prompts = prompts_of(LENGTHS, 4096, 21, low=3)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return prompts, [s.output_token_ids for s in seqs], engine.kv_spec.block_bytes


async def nixl_bytes(url: str) -> float:
    async with httpx.AsyncClient(timeout=5.0) as client:
        text = (await client.get(url)).text
    for line in text.splitlines():
        if line.startswith("pdmesh_kv_transfer_bytes_total{") and 'transport="nixl"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_tp2_prefill_feeds_tp1_and_tp2_decode_workers_across_hosts_over_nixl(bed, tiny_model, reference):
    prompts, expected, block_bytes = reference
    flags = ["--model", str(tiny_model), "--device-kv-blocks", "256", "--transports", "nixl,nats"]
    addr = bed.hosts[1].addr
    bed.worker(1, "prefill", *flags, "--tp", "2", "--worker-id", "tp-pre", "--prefill-capacity", "8",
               "--metrics-host", addr, "--metrics-port", str(METRICS_PORT))
    for tp in (1, 2):
        bed.worker(2, "decode", *flags, "--tp", str(tp), "--worker-id", f"tp-dec{tp}",
                   "--disagg-threshold", str(THRESHOLD))
    w = await Watcher.open(bed.hosts[2].nats_url)
    try:
        await w.wait_for(lambda: all(w.membership.get(i) for i in ("tp-pre", "tp-dec1", "tp-dec2")), 180,
                         "the three workers")
        await w.fresh_load("tp-pre", timeout=30)  # the decode workers have heard the prefill pool too
        await asyncio.sleep(1.2)
        for tp in (1, 2):
            results = await run_all(w.bus, f"tp-dec{tp}", prompts, max_tokens=MAX_TOKENS)
            assert [toks for toks, _ in results] == expected, f"tp 2 -> tp {tp}"
            dec = (await w.fresh_load(f"tp-dec{tp}")).counters
            assert dec.get("transport_nixl") == len(LONG) and dec.get("remote_prefill_done") == len(LONG), dec
            assert dec.get("carried_prefill_done") == len(LONG), dec  # each came with its last pair's bytes
        pre = (await w.fresh_load("tp-pre")).counters
        assert pre.get("transport_nixl") == 2 * len(LONG) and not pre.get("transport_nats"), pre
        blocks = sum(-(-n // BS) for n in LONG)
        assert await nixl_bytes(f"http://{addr}:{METRICS_PORT}/metrics") == 2 * blocks * block_bytes
    finally:
        await w.close()
