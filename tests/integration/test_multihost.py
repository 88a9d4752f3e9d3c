"""The mesh across three simulated hosts (issue 31): the gateway on host 1, a prefill worker on
host 2, a decode worker on host 3, each host its own network, /dev/shm and hostname and one
nats-server of a cluster (``tests.helpers.hostbed``).

Greedy outputs through the official ``openai`` client equal the engine's in-process run, the
long prompts are prefilled on host 2, and their KV crossed between hosts on the first transport
of the decode worker's that reaches across hosts (nixl where it is installed, else nats; shm,
which needs one /dev/shm, carried nothing). Peer fetch across hosts
gives the cold run's tokens.
"""

from __future__ import annotations

import os
import random
import sys
import time

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.bus import Bus
from mesh.natsauth import NatsConfig
from mesh.planner.connectors import LocalConnector
from mesh.planner.planner import Planner
from mesh.planner.policy import PlannerConfig
from mesh.prefill_queue import PrefillQueue
from mesh.protocol import PrefillJob, decode
from mesh.router.policy import RouterConfig
from mesh.router.router import KvRouter
from tests.helpers.cluster import stream_tokens
from tests.helpers.multihost import (
    BUS_FLAGS,
    completion_ids,
    cross_host_transport,
    open_watcher,
    wait_gateway,
)
from tests.helpers.peer_fetch import (
    BS,
    PREFIX_BLOCKS,
    ask,
    decode_flags,
    plan_of,
    prefix_in_host_tier,
)
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
    hostbed.worker(2, "prefill", *model, "--worker-id", "mh-pre", "--prefill-capacity", "8", "--transports", "shm,nixl,nats")
    hostbed.worker(3, "decode", *model, "--worker-id", "mh-dec", "--disagg-threshold", str(THRESHOLD), "--transports", "shm,nixl,nats")
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


async def test_peer_fetch_across_hosts_gives_the_cold_runs_tokens(hostbed, tiny_model):
    """A prefix in the host tier of a decode worker on host 2 is fetched by one on host 3 (the router
    in the test process plans it, as the gateway's does): the cold run's tokens, no recompute, and
    the bytes went over the channel that crosses hosts, not shared memory."""
    flags = decode_flags(tiny_model, timeout=5)
    hostbed.worker(2, "decode", *flags, "--worker-id", "pf-a", "--transports", "shm,nixl,nats")
    hostbed.worker(3, "decode", *flags, "--worker-id", "pf-b", "--transports", "shm,nixl,nats")
    w = await open_watcher(hostbed.hosts[1].nats_url)
    router = KvRouter(w.bus, w.membership, RouterConfig(peer_fetch=True))
    await router.start()
    try:
        await w.wait_workers("decode", 2, timeout=120)
        prompt, cold = await prefix_in_host_tier(w, router, "pf-a", random.Random(5))
        d = router.route("tiny", prompt, "moved", exclude={"pf-a"})
        assert (d.worker_id, d.fetch_source, d.fetch_blocks) == ("pf-b", "pf-a", PREFIX_BLOCKS)
        tokens, cached = await ask(w.bus, "pf-b", prompt, router, plan_of(d), "moved")
        assert tokens == cold and cached == PREFIX_BLOCKS * BS
        b = (await w.fresh_load("pf-b")).counters
        assert (b.get("peer_fetch_ok"), b.get("hit_blocks_peer")) == (1, PREFIX_BLOCKS), b
        assert b.get("peer_fetch_via_shm", 0) == 0 and sum(v for k, v in b.items() if k.startswith("peer_fetch_via_")) == 1
    finally:
        await router.stop()
        await w.close()


async def test_the_prefill_queue_survives_the_loss_of_its_streams_leader_host(hostbed):
    """Jobs queued on a stream of three replicas (``--js-replicas 3``: one per host) are all still
    there, in order, for a prefill worker on a surviving host after the host of the stream's
    leader is killed whole."""
    config = NatsConfig.build(hostbed.nats_urls, js_replicas=3, connect_timeout=30)
    bus = await Bus.connect(hostbed.hosts[1].nats_url, "queue-test", config=config)
    queue = PrefillQueue(bus, "tiny")
    ids = [f"job-{k}" for k in range(5)]
    for rid in ids:
        await queue.publish(PrefillJob(rid, "tiny", [1, 2, 3], "nobody", 0, [0], {}, time.time() + 60, 16), timeout=10)
    info = await bus.js.stream_info(queue.stream)
    assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
    leader = int(info.cluster.leader.rsplit("-h", 1)[1])  # server names: <cluster>-h<i>
    await bus.close()
    hostbed.kill_host(leader)
    survivor = next(i for i in hostbed.hosts if i != leader)
    bus = await Bus.connect(hostbed.hosts[survivor].nats_url, "queue-test-2",
                            config=NatsConfig.build(hostbed.hosts[survivor].nats_url, js_replicas=3, connect_timeout=30))
    try:
        sub, got = None, []
        for _ in range(30):  # the two survivors elect new leaders first (as a prefill worker, retry)
            try:
                sub = sub or await PrefillQueue(bus, "tiny").pull()
                got += [decode(m.data, expect=PrefillJob).request_id for m in await sub.fetch(5 - len(got), timeout=2)]
            except Exception:  # (a timeout or 503 while the new leader is elected)
                pass
            if len(got) == 5:
                break
        assert got == ids
    finally:
        await bus.close()


async def test_the_planner_adds_workers_on_any_host(hostbed):
    """The planner with its process connector and one launcher per bed host (``nsenter`` into hosts
    2 and 3): its window finds the decode pool under its floor of 2 and starts one worker on each
    host (their cards carry the hosts' names), both serve, and scaling to 0 drains them."""
    argv = {"decode": [sys.executable, "-m", "cli", "worker", "mock", "--nats", hostbed.nats_urls, *BUS_FLAGS,
                       "--mock-speedup", "20"], "prefill": []}
    conn = LocalConnector(argv, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, drain_timeout=20,
                          launchers=[hostbed.hosts[i].enter() for i in (2, 3)])
    w = await open_watcher(hostbed.hosts[1].nats_url)
    try:
        planner = Planner(w.bus, w.membership, conn, PlannerConfig(min_decode=2, max_decode=2, max_prefill=0))
        (decision,) = await planner.tick(time.monotonic())  # one window, run here rather than on its timer
        assert (decision.pool, decision.current, decision.target) == ("decode", 0, 2), decision
        cards = await w.wait_workers("decode", 2, model="mock", timeout=120)
        assert sorted(c.host for c in cards) == [hostbed.hosts[2].hostname, hostbed.hosts[3].hostname]
        for c in cards:
            toks, last = await stream_tokens(w.bus, c.worker_id, [5, 6, 7, 8], max_tokens=4, model="mock")
            assert len(toks) == 4 and last.finish_reason == "length"
        await conn.scale("decode", 0)
        await w.wait_for(lambda: not w.membership.cards("mock", "decode"), 60, "the pool drained")
    finally:
        await conn.close()
        await w.close()
