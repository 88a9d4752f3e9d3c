"""Per-step token batches through the real path: a mock decode worker (real ``EngineCore``,
scheduler and emission) sends one ``TokenBatch`` per step for many concurrent streams, and the
gateway hands each chunk to its stream, in order; on the same mesh a custom worker written against
the raw protocol (plain nats-py and msgpack, one ``TokenChunk`` per message, no batching) serves
another model through the same gateway reply subscription."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time

import httpx
import msgpack
import nats
import pytest

from mesh.bus import Bus
from mesh.protocol import Subjects, WorkerCard
from mesh.registry import CardPublisher
from mocker.engine import MockConfig
from tests.helpers.cluster import Watcher, wait_http_ok

N_STREAMS = 24
PACED_STEP_MS = 25.0
MAX_TOKENS = 40
VOCAB = MockConfig().vocab_size


def mocker_tokens(prompt: list[int], n: int) -> list[int]:
    """What ``MockEngine.token_for`` generates after ``prompt``."""
    toks, last, length = [], prompt[-1], len(prompt)
    for _ in range(n):
        last = (last * 31 + length * 17 + 7) % VOCAB
        toks.append(last)
        length += 1
    return toks


class SingleChunkWorker:
    """A custom worker as one in another language would write it: raw subjects, msgpack maps, one
    TokenChunk per token on the reply subject; it ignores ``batch_to``. It echoes the prompt."""

    def __init__(self, nats_url: str, worker_id: str):
        self.nats_url, self.worker_id = nats_url, worker_id
        self.served = 0

    async def start(self) -> None:
        self.nc = await nats.connect(self.nats_url)
        await self.nc.subscribe(f"mesh.echo.decode.{self.worker_id}.generate", cb=self._on_generate)
        self.bus = Bus(self.nc, Subjects("mesh"))  # only to publish our card the standard way
        self.cards = CardPublisher(self.bus, self._card)
        await self.cards.start()

    def _card(self) -> WorkerCard:
        now = time.time()
        return WorkerCard(self.worker_id, "decode", "echo", 16, 1024, 16384, socket.gethostname(), os.getpid(),
                          now, now, engine="custom")

    async def _on_generate(self, msg) -> None:
        req = msgpack.unpackb(msg.data)
        ids = req["token_ids"][: req["sampling"]["max_tokens"]]
        for i, t in enumerate(ids):
            chunk = {"type": "TokenChunk", "request_id": req["request_id"], "index": i, "token_ids": [t],
                     "worker": self.worker_id}  # the gateway takes chunks only from the stream's worker
            if i == len(ids) - 1:
                chunk["finish_reason"] = "length"
                chunk["usage"] = {"prompt_tokens": len(req["token_ids"]), "completion_tokens": len(ids)}
            await self.nc.publish(msg.reply, msgpack.packb(chunk))
            await asyncio.sleep(0.002)
        self.served += 1

    async def stop(self) -> None:
        await self.cards.stop()
        await self.nc.close()


@pytest.fixture(scope="module")
def gateway(cluster, tiny_model):
    cluster.worker("mock", "--served-name", "batchy", "--worker-id", "batchy-0", "--mock-speedup", "20")
    # real pace, and every decode step at least PACED_STEP_MS: far slower than a stream's chunk interval
    cluster.worker("mock", "--served-name", "paced", "--worker-id", "paced-0", "--mock-speedup", "1",
                   "--mock-timing", f"decode_base_ms={PACED_STEP_MS}")
    return cluster.gateway(tiny_model, None)  # "batchy" and "echo" have no tokenizer here: token ids


async def stream_ids(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "stream": True, "return_token_ids": True,
            "ignore_eos": True, "temperature": 0}
    got = []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                got += event["choices"][0].get("token_ids") or []
    return got


async def test_batched_and_single_chunk_streams_share_one_gateway(cluster, gateway):
    custom = SingleChunkWorker(cluster.nats_url, "echo-0")
    await custom.start()
    w = await Watcher.open(cluster.nats_url)
    try:
        await w.wait_for(lambda: w.membership.get("batchy-0") and w.membership.get("echo-0"), 60, "workers")
        wait_http_ok(gateway + "/health", 60)
        prompts = [[(17 * i + j) % 900 + 3 for j in range(20 + i)] for i in range(N_STREAMS)]
        async with httpx.AsyncClient(timeout=60) as http:
            batched = [stream_ids(http, gateway, "batchy", p, MAX_TOKENS) for p in prompts]
            singles = [stream_ids(http, gateway, "echo", p, 12) for p in prompts[:4]]
            results = await asyncio.gather(*batched, *singles)
            metrics = (await http.get(gateway + "/metrics")).text
        for p, got in zip(prompts, results[:N_STREAMS], strict=True):
            assert got == mocker_tokens(p, MAX_TOKENS)  # every token, in order, to its own stream
        for p, got in zip(prompts[:4], results[N_STREAMS:], strict=True):
            assert got == p[:12]
        assert custom.served == 4
        batches = float(re.search(r"^pdmesh_gateway_token_batches_total (\S+)$", metrics, re.M).group(1))
        chunks = float(re.search(r"^pdmesh_gateway_batched_chunks_total (\S+)$", metrics, re.M).group(1))
        # the batching worker's chunks all came in batches, several streams' per message
        assert chunks >= N_STREAMS * 2 and chunks / batches > 2, (chunks, batches)
        assert "pdmesh_gateway_live_choices 0" in metrics
    finally:
        await w.close()
        await custom.stop()


async def token_events(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], n: int) -> list[list[int]]:
    """The token ids of each SSE event of a streamed completion, one list per event that carries any."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "stream": True, "return_token_ids": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    events = []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"] and (ids := event["choices"][0].get("token_ids")):
                    events.append(ids)
    return events


def figure(metrics: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))


def direct_deltas(metrics: str) -> float:
    return figure(metrics, "pdmesh_gateway_direct_deltas_total")


async def test_paced_streams_send_each_token_in_its_own_chunk(cluster, gateway):
    """Issue 33: when the worker's steps are slower than the stream interval (a GPU's decode step
    against a gateway that writes in microseconds), nothing is merged: every token of every
    concurrent stream leaves in its own SSE event, in order, and all of them arrive."""
    w = await Watcher.open(cluster.nats_url)
    try:
        await w.wait_for(lambda: w.membership.get("paced-0"), 60, "the paced worker")
        wait_http_ok(gateway + "/health", 60)
        prompts = [[(29 * i + j) % 900 + 3 for j in range(16 + i)] for i in range(8)]
        async with httpx.AsyncClient(timeout=60) as http:
            # the worker connects its token link (mesh.tokenlink) at the first request it serves
            # for this gateway; that request's chunks keep the bus
            links = figure((await http.get(gateway + "/metrics")).text, "pdmesh_gateway_token_links")
            assert await token_events(http, gateway, "paced", [5, 6, 7], 2) == [[t] for t in mocker_tokens([5, 6, 7], 2)]
            deadline = time.monotonic() + 10
            while figure((await http.get(gateway + "/metrics")).text, "pdmesh_gateway_token_links") <= links:
                assert time.monotonic() < deadline, "the workers' token links never came up"
                await asyncio.sleep(0.05)
            before = (await http.get(gateway + "/metrics")).text
            results = await asyncio.gather(*(token_events(http, gateway, "paced", p, 16) for p in prompts))
            after = (await http.get(gateway + "/metrics")).text
        direct = direct_deltas(after) - direct_deltas(before)
        linked = figure(after, "pdmesh_gateway_link_batches_total") - figure(before, "pdmesh_gateway_link_batches_total")
        for p, events in zip(prompts, results, strict=True):
            assert [len(e) for e in events] == [1] * 16, events  # one token per chunk, none merged
            assert [t for e in events for t in e] == mocker_tokens(p, 16)
        # behind uvicorn the mid-stream tokens (not the first, not the last) are written from the
        # reply handler (gateway/choices/direct.py); a 25 ms step leaves the reader waiting for nearly all
        assert 8 * 14 // 2 <= direct <= 8 * 14, direct
        # every step's batch came over the link, not through NATS: 16 steps at least (more when
        # the streams' prefills took steps of their own)
        assert 16 <= linked <= 8 * 16, linked
    finally:
        await w.close()
