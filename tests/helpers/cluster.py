"""Real clusters for integration tests: worker and gateway processes started with the ``mesh``
CLI, a bus client to watch them, HTTP readiness, one request streamed from a worker, kill -9 of
the worker serving a stream, and ``mesh up`` as a user runs it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx

from mesh.bus import Bus
from mesh.client import generate
from mesh.loads import subscribe_loads
from mesh.natsserver import free_port
from mesh.protocol import GenerateRequest, LoadReport, RouterDecision, SamplingOptions
from mesh.registry import Membership
from tests.helpers.procs import stop_processes


@dataclass
class Cluster:
    """Processes started for one test module; all are stopped at the end."""

    nats_url: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def spawn(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", *args], env=full_env,
            stdout=subprocess.DEVNULL, stderr=None,
        )
        self.procs.append(proc)
        return proc

    def worker(self, role: str, *flags: str, env: dict | None = None) -> subprocess.Popen:
        return self.spawn("worker", role, "--nats", self.nats_url, *flags, env=env)

    def gateway(self, model_dir, port: int | None = None, *flags: str) -> str:
        port = port or free_port()
        self.spawn("gateway", "--nats", self.nats_url, "--model", str(model_dir), "--host", "127.0.0.1",
                   "--port", str(port), *flags)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        stop_processes(self.procs)


async def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """The first truthy value of ``predicate()``, polled every ``interval`` seconds for ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


class Watcher:
    """A bus client that tracks membership and the latest load report of every worker."""

    def __init__(self, bus: Bus, membership: Membership):
        self.bus = bus
        self.membership = membership
        self.loads: dict[str, LoadReport] = {}

    @classmethod
    async def open(cls, url: str, ns: str = "mesh", config=None) -> Watcher:
        """``config``: a ``NatsConfig`` (None: ``url`` with the environment's settings)."""
        bus = await Bus.connect(url, "test-watcher", ns=ns, config=config)
        m = Membership(bus)
        await m.start(wait=1.0)
        w = cls(bus, m)

        async def on_load(report: LoadReport, raw) -> None:
            w.loads[report.worker_id] = report

        await subscribe_loads(bus, on_load)
        return w

    async def wait_for(self, predicate, timeout: float = 60.0, what: str = "condition"):
        return await wait_until(predicate, timeout, what)

    async def wait_workers(self, role: str, n: int, model: str | None = None, timeout: float = 60.0):
        return await self.wait_for(
            lambda: (c := self.membership.cards(model, role)) and len(c) >= n and c, timeout,
            f"{n} {role} workers",
        )

    async def fresh_load(self, worker_id: str, timeout: float = 10.0) -> LoadReport:
        """The first load report of ``worker_id`` sent after now."""
        since = time.time()
        return await self.wait_for(
            lambda: (r := self.loads.get(worker_id)) and r.timestamp > since and r, timeout,
            f"a load report from {worker_id}",
        )

    async def close(self) -> None:
        await self.membership.stop()
        await self.bus.close()


async def router_choices(w: Watcher) -> list[str]:
    """The workers the router sends requests to from now on, in order (the list fills as its
    decisions come): where a stream runs before any load report says so."""
    chosen: list[str] = []

    async def on_decision(d: RouterDecision, raw) -> None:
        chosen.append(d.worker_id)

    await w.bus.subscribe(w.bus.subjects.router_decisions(), on_decision, RouterDecision)
    await w.bus.flush(5.0)  # the server has the subscription before the test sends a request
    return chosen


async def kill_serving_worker(w: Watcher, workers: Mapping[str, subprocess.Popen], *,
                              chosen: list[str] | None = None, since: float = 0.0) -> str:
    """kill -9 of the worker of ``workers`` (id -> process) that serves the one stream running: the
    router's last choice where the test follows them (``router_choices``: a short stream may end
    before a load report shows it running), else the one worker whose load report, sent after
    ``since``, has a request running. Its id."""
    if chosen is not None:
        serving = (await w.wait_for(lambda: chosen, 10, "the router's decision"))[-1]
    else:
        busy = await w.wait_for(
            lambda: [wid for wid in workers if (r := w.loads.get(wid)) and r.timestamp > since and r.running], 10,
            "the serving worker's load report")
        assert len(busy) == 1, busy
        serving = busy[0]
    os.kill(workers[serving].pid, signal.SIGKILL)
    return serving


async def stream_killing_its_worker(url: str, model: str, prompt: list[int], max_tokens: int, w: Watcher,
                                    workers: Mapping[str, subprocess.Popen], *, after: int,
                                    chosen: list[str] | None = None) -> tuple[list[int], str]:
    """A greedy streamed completion (``ignore_eos``) whose worker is killed (``kill_serving_worker``)
    once ``after`` tokens came: every token id the client got, and the killed worker's id."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    got: list[int] = []
    killed = None
    async with httpx.AsyncClient(timeout=120) as client, client.stream("POST", f"{url}/v1/completions",
                                                                       json=body) as r:
        assert r.status_code == 200
        async for event in completion_events(r):
            got += event["choices"][0].get("token_ids") or []
            if killed is None and len(got) >= after:
                killed = await kill_serving_worker(w, workers, chosen=chosen)
    assert killed is not None
    return got, killed


def wait_http_ok(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 within {timeout}s")


async def completion_events(response: httpx.Response):
    """The events of a streamed completion (its ``data:`` lines before ``[DONE]``); none may be an error."""
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        yield event


async def stream_tokens(bus: Bus, worker_id: str, prompt: list[int], max_tokens: int = 16, model: str = "tiny"):
    """One greedy request of ``model`` sent straight to ``worker_id``: its tokens and its last chunk."""
    req = GenerateRequest(uuid.uuid4().hex, model, prompt, SamplingOptions(max_tokens=max_tokens, temperature=0.0))
    toks, last = [], None
    async for chunk in generate(bus, worker_id, req, first_timeout=120, idle_timeout=60):
        assert chunk.error is None, chunk.error
        toks += chunk.token_ids
        last = chunk
    return toks, last


async def run_all(bus: Bus, worker_id: str, prompt_list, max_tokens: int = 16):
    """``stream_tokens`` of every prompt at once, in order."""
    return await asyncio.gather(*(stream_tokens(bus, worker_id, p, max_tokens) for p in prompt_list))


def start_up(*flags: str, env: dict | None = None, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """``mesh up`` on a free port, once it says it is up (within ``timeout`` s): the process and its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--port", str(port), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "pdmesh is up" in line:
            proc.up_line = line
            return proc, f"http://127.0.0.1:{port}"
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"mesh up did not come up: {proc.stdout.read()}")
