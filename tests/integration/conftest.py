"""Real clusters for integration tests: a nats-server on a free loopback port, worker
and gateway processes started with the ``mesh`` CLI, and a bus client to watch them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from mesh.bus import Bus
from mesh.natsserver import EmbeddedNats, free_port
from mesh.protocol import LoadReport
from mesh.registry import Membership
from tests.procs import stop_processes


@pytest.fixture(scope="module")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


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


@pytest.fixture(scope="module")
def cluster(nats_server) -> Iterator[Cluster]:
    c = Cluster(nats_server.url)
    yield c
    c.stop()


class Watcher:
    """A bus client that tracks membership and the latest load report of every worker."""

    def __init__(self, bus: Bus, membership: Membership):
        self.bus = bus
        self.membership = membership
        self.loads: dict[str, LoadReport] = {}

    @classmethod
    async def open(cls, url: str, ns: str = "mesh") -> Watcher:
        bus = await Bus.connect(url, "test-watcher", ns=ns)
        m = Membership(bus)
        await m.start(wait=1.0)
        w = cls(bus, m)

        async def on_load(report: LoadReport, raw) -> None:
            w.loads[report.worker_id] = report

        await bus.subscribe(bus.subjects.load_all(), on_load, LoadReport)
        return w

    async def wait_for(self, predicate, timeout: float = 60.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

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
