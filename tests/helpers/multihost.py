"""What the tests and benchmarks of the mesh across hosts share: a watcher on one host's server,
the gateway's readiness, greedy completions through the official ``openai`` client, which
transport carries KV between hosts, and the gateway's counters."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from bench.mesh.chaos import Outcome
from bench.mesh.chaos import checked_request as chaos_request
from mesh.natsauth import NatsConfig
from mesh.protocol import WorkerCard
from tests.helpers.cluster import Watcher

SAME_HOST_ONLY = ("shm", "cuda_ipc")  # transports that need one /dev/shm or one GPU host
# every process of a bed: the registry bucket and prefill streams on all three servers (a host's
# loss keeps a quorum), and patience while the cluster forms
BUS_FLAGS = ("--js-replicas", "3", "--nats-connect-timeout", "30")


async def open_watcher(url: str, ns: str = "mesh") -> Watcher:
    """A ``Watcher`` on ``url`` (one server of the bed's cluster). Like every process of a bed, it
    would create the registry bucket with three replicas (one replica would die with its host)."""
    return await Watcher.open(url, ns, config=NatsConfig.build(url, js_replicas=3, connect_timeout=30))


async def wait_gateway(url: str, timeout: float = 120.0) -> None:
    """Until the gateway's /health is 200 (it sees a decode worker of some model)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise AssertionError(f"{url}/health was not 200 within {timeout:.0f}s")


async def completion_ids(url: str, prompt: list[int], max_tokens: int, model: str = "tiny",
                         timeout: float = 60.0) -> list[int]:
    """The greedy token ids of one completion of ``prompt`` through the ``openai`` client."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0) as client:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    return (r.choices[0].model_extra or {})["token_ids"]


def cross_host_transport(decode_card: WorkerCard) -> str:
    """The transport a prefill worker on another host uses to reach this decode worker: its first
    offered transport that does not need a shared host."""
    return next(t for t in decode_card.transports if t not in SAME_HOST_ONLY)


async def gateway_counter(url: str, name: str) -> int | None:
    """A counter of the gateway's /metrics (its ``_total`` sample), or None when unreachable."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            text = (await client.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return None
    total = 0
    for line in text.splitlines():
        sample, _, value = line.partition(" ")
        if sample.split("{")[0] == f"{name}_total":
            total += int(float(value))
    return total



async def checked_request(client: httpx.AsyncClient, url: str, prompt: list[int], expected: list[int],
                          out: Outcome, timeout: float, model: str = "tiny") -> None:
    """One streamed greedy completion of ``prompt``, checked against ``expected`` and counted in
    ``out`` (``bench.mesh.chaos.checked_request``: correct, incorrect, a clear error, or hung)."""
    body = {"model": model, "prompt": prompt, "max_tokens": len(expected), "temperature": 0, "ignore_eos": True}
    await chaos_request(client, url, body, expected, out, timeout)


def clear_errors_only(out: Outcome) -> bool:
    """Every error the clients saw was a clear one: an HTTP 5xx or an error event in the stream."""
    return all(k.startswith(("http 5", "stream")) for k in out.error_kinds)
