"""A worker's ranks on two simulated hosts (issue 50; ``tests.helpers.hostbed``): a ``--pp 2`` decode
worker on host 1 (``--local-ranks 1``: its first stage there) whose second stage joins from host 2
(``mesh rank --join``); with the gateway on host 1 and a one-rank decode worker on host 3. Every
process holds the mesh secret, from which the group token is derived.

- Joins that were not invited are refused in one line: a wrong group token (another mesh secret),
  a rank the worker does not wait for, and any join once its group is complete.
- Greedy tokens equal the single-rank engine's, the stages' activations crossing hosts.
- Host 2 killed whole while streams run on the worker: the worker fails (exit 1), leaves the
  routing, and its streams end with the single-rank tokens (the gateway resumes them on host 3);
  no stream hangs. (Those long references come from host 3's worker, a single-rank engine in a
  process of its own: the test process's engine took minutes for them on a loaded machine.)
- Host 2 cut off (nothing closes: the worker's step waits on the lost stage in a collective)
  while requests stream from the worker: within 3 s of silence on the lifeline the worker ends
  them with a 503 (which a gateway resumes elsewhere), leaves the routing and exits 1; the rank
  on host 2 exits 1 too; nothing hangs.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

import httpx
import pytest

from bench.mesh.chaos import Outcome, checked_request
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from kvstore.hashing import generate_hash_key
from mesh.client import generate
from mesh.protocol import GenerateRequest, SamplingOptions, WorkerLayout
from tests.helpers.cluster import run_all
from tests.helpers.multihost import BUS_FLAGS, open_watcher, wait_gateway
from tests.helpers.references import prompts_of

GW_FLAGS = (*BUS_FLAGS, "--first-token-timeout", "30", "--idle-timeout", "30")
STREAM_TOKENS = 1000  # long enough that the kill lands mid-stream (it follows a load report, once a second)


@pytest.fixture(scope="module")
def engine(tiny_model) -> Engine:
    return Engine(EngineConfig(tiny_model, num_kv_blocks=1024))


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    seqs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))
    return [s.output_token_ids for s in seqs]


async def greedy_on(bus, worker: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens of each prompt (EOS ignored) from ``worker``, asked over the bus."""

    async def one(prompt: list[int]) -> list[int]:
        req = GenerateRequest(uuid.uuid4().hex, "tiny", prompt,
                              SamplingOptions(max_tokens=n, temperature=0.0, ignore_eos=True))
        return [t async for c in generate(bus, worker, req, first_timeout=60, idle_timeout=60) for t in c.token_ids]

    return await asyncio.gather(*(one(p) for p in prompts))


async def refused_join(capsys, bed, *flags: str) -> str:
    """``mesh rank --join dec-pp FLAGS`` (the CLI in this process, outside the hosts: a join from
    anywhere that reaches host 2's server), which must fail in one line: that line."""
    from cli import main

    capsys.readouterr()
    rc = await asyncio.to_thread(main, rank_argv(bed, *flags)[3:])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("mesh: error: "), (rc, err)
    return err


def mesh_key(tmp_path, name: str = "mesh.key"):
    path = tmp_path / name
    path.write_text(generate_hash_key().hex())
    return path


def start_pp_worker(bed, tiny_model, key):
    """``dec-pp`` on host 1, waiting for its second stage: the worker's process."""
    return bed.worker(1, "decode", *worker_flags(tiny_model, key), "--pp", "2", "--local-ranks", "1",
                      "--worker-id", "dec-pp")


def worker_flags(tiny_model, key) -> list[str]:
    return [*BUS_FLAGS, "--hash-key-file", str(key), "--model", str(tiny_model), "--device-kv-blocks", "1024"]


def rank_argv(bed, *flags: str) -> list[str]:
    """``mesh rank --join dec-pp`` on host 2's server."""
    return [sys.executable, "-m", "cli", "rank", "--join", "dec-pp", "--nats", bed.hosts[2].nats_url, *BUS_FLAGS, *flags]


async def test_a_pp2_worker_with_its_second_stage_on_another_host(hostbed, tiny_model, engine, tmp_path, capsys):
    key, wrong = mesh_key(tmp_path), mesh_key(tmp_path, "other.key")
    pp = start_pp_worker(hostbed, tiny_model, key)
    hostbed.worker(3, "decode", *worker_flags(tiny_model, key), "--worker-id", "dec-3")
    url = hostbed.gateway(1, "--model", str(tiny_model), "--hash-key-file", str(key), *GW_FLAGS)

    # while the worker waits for its second stage: joins it did not invite, refused in one line
    assert "worker dec-pp refused the join: wrong group token" in await refused_join(
        capsys, hostbed, "--hash-key-file", str(wrong))
    assert "waits for no rank 0" in await refused_join(capsys, hostbed, "--hash-key-file", str(key), "--rank", "0")
    hostbed.spawn(2, rank_argv(hostbed, "--hash-key-file", str(key)))
    w = await open_watcher(hostbed.hosts[1].nats_url)
    try:
        await w.wait_for(lambda: w.membership.get("dec-pp") and w.membership.get("dec-3"), 180, "both workers")
        assert w.membership.get("dec-pp").layout == WorkerLayout(tp=1, pp=2, stage_layers=[1, 1])
        assert w.membership.get("dec-pp").transports == {}  # no transport reaches the KV on host 2
        assert "worker dec-pp has all its ranks" in await refused_join(capsys, hostbed, "--hash-key-file", str(key))

        # the same tokens as one rank, the activations crossing hosts (sent to the worker itself)
        prompts = prompts_of([5, 40, 90], 4096, 7, low=3)
        results = await run_all(w.bus, "dec-pp", prompts, max_tokens=12)
        assert [toks for toks, _ in results] == greedy(engine, prompts, 12)

        # host 2 dies while streams run on the worker: they end on host 3 with the engine's tokens
        streams = prompts_of([30, 41, 52, 63, 35, 47], 4096, 11, low=3)
        expected = await greedy_on(w.bus, "dec-3", streams, STREAM_TOKENS)
        assert all(len(e) == STREAM_TOKENS for e in expected)
        await wait_gateway(url)
        out = Outcome()
        async with httpx.AsyncClient(timeout=120) as client:
            sent = time.time()
            # salted: host 3's cached copies of these prompts must not draw every stream to it
            bodies = [{"model": "tiny", "prompt": p, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
                       "cache_salt": "streams"} for p in streams]
            runs = [asyncio.create_task(checked_request(client, url, b, e, out, 120.0))
                    for b, e in zip(bodies, expected, strict=True)]
            await w.wait_for(lambda: (r := w.loads.get("dec-pp")) and r.running >= 1 and r.timestamp > sent,
                             60, "streams running on the worker")
            assert out.total == 0, "a stream ended before the kill: it would not test a migration"
            hostbed.kill_host(2)
            await asyncio.gather(*runs)
        assert out.correct == len(streams) and out.hung == 0, (out.error_kinds, out.incorrect_samples, out.hung)
        assert await asyncio.to_thread(pp.wait, 60) == 1  # the worker failed, as a worker with a dead rank does
        await w.wait_for(lambda: w.membership.get("dec-pp") is None, 30, "the worker to leave the routing")
    finally:
        await w.close()


async def test_a_cut_off_rank_host_fails_its_worker_and_nothing_hangs(hostbed, tiny_model, tmp_path):
    key = mesh_key(tmp_path)
    pp = start_pp_worker(hostbed, tiny_model, key)
    rank = hostbed.spawn(2, rank_argv(hostbed, "--hash-key-file", str(key)))
    w = await open_watcher(hostbed.hosts[1].nats_url)
    try:
        await w.wait_for(lambda: w.membership.get("dec-pp"), 180, "the worker")
        prompts = prompts_of([30, 41, 52], 4096, 12, low=3)
        chunks: dict[int, list] = {i: [] for i in range(len(prompts))}

        async def stream(i: int) -> None:
            req = GenerateRequest(uuid.uuid4().hex, "tiny", prompts[i],
                                  SamplingOptions(max_tokens=8000, temperature=0.0, ignore_eos=True))
            async for chunk in generate(w.bus, "dec-pp", req, first_timeout=60, idle_timeout=30):
                chunks[i].append(chunk)

        runs = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
        await w.wait_for(lambda: all(chunks.values()), 60, "every stream's first tokens")
        with hostbed.partition(2):
            await asyncio.wait_for(asyncio.gather(*runs), 30)  # idle streams would raise StreamError
            ends = [c[-1] for c in chunks.values()]
            assert all(e.finish_reason == "error" and e.error_status == 503 for e in ends), ends
            await w.wait_for(lambda: w.membership.get("dec-pp") is None, 30, "the worker to leave the routing")
            assert await asyncio.to_thread(pp.wait, 60) == 1
            assert await asyncio.to_thread(rank.wait, 60) == 1  # its worker is lost: it exits too
    finally:
        await w.close()
