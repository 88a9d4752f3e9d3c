"""The mesh across three simulated hosts (issue 31): the gateway on host 1, a prefill worker on
host 2, a decode worker on host 3, each host its own network, /dev/shm and hostname and one
nats-server of a cluster (``tests.helpers.hostbed``).

Greedy outputs through the official ``openai`` client equal the engine's in-process run, the
long prompts are prefilled on host 2, and their KV crossed between hosts on a transport that
reaches across hosts (shm, which needs one /dev/shm, carried nothing). Peer fetch across hosts
gives the cold run's tokens.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.helpers.multihost import completion_ids, cross_host_transport, open_watcher, wait_gateway
from tests.helpers.references import prompts_of

THRESHOLD = 64
LENGTHS = [5, 20, 63, 70, 150, 300, 450]


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=512))
    ps = prompts_of(LENGTHS, 4096, 3, low=3)
    seqs = engine.generate(ps, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return ps, [s.output_token_ids for s in seqs]


async def test_gateway_prefill_decode_on_three_hosts_is_token_identical(hostbed, tiny_model, reference):
    prompts, expected = reference
    model = ["--model", str(tiny_model), "--device-kv-blocks", "512"]
    hostbed.worker(2, "prefill", *model, "--worker-id", "mh-pre", "--prefill-capacity", "8")
    hostbed.worker(3, "decode", *model, "--worker-id", "mh-dec", "--disagg-threshold", str(THRESHOLD))
    url = hostbed.gateway(1, "--model", str(tiny_model))
    w = await open_watcher(hostbed.hosts[1].nats_url)
    try:
        await w.wait_for(lambda: w.membership.get("mh-dec") and w.membership.get("mh-pre"), 120, "both workers")
        await w.fresh_load("mh-pre", timeout=30)  # the decode worker has heard the prefill pool too
        await wait_gateway(url)
        got = [await completion_ids(url, p, 12) for p in prompts]
        assert got == expected
        long_ones = sum(1 for n in LENGTHS if n >= THRESHOLD)
        dec, pre = await w.fresh_load("mh-dec"), await w.fresh_load("mh-pre")
        carrier = cross_host_transport(w.membership.get("mh-dec"))
        assert dec.counters.get("remote_prefill_done", 0) == long_ones, dec.counters
        assert dec.counters.get(f"transport_{carrier}", 0) == long_ones, dec.counters
        assert pre.counters.get(f"transport_{carrier}", 0) == long_ones, pre.counters
        assert dec.counters.get("transport_shm", 0) == 0 and pre.counters.get("transport_shm", 0) == 0
    finally:
        await w.close()
