"""``mesh up``: the whole mesh on one machine.

Embedded NATS (unless ``--nats``), the tiny model (generated if missing, unless
``--model`` or ``--mock``), the gateway, the prefill and decode pools as child
processes. Ctrl-C or SIGTERM stops everything it started: the gateway first,
then the workers (each drains), then NATS. Children also die with this
process if it is killed outright (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mesh.natsserver import EmbeddedNats
from mesh.procutil import die_with_parent, stop_event_on_signals

log = logging.getLogger(__name__)


def default_model_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "pdmesh" / "models" / "tiny"


def ensure_tiny_model(path: Path) -> Path:
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        from mesh.engine.tiny import write_tiny_model

        write_tiny_model(path)
    return path


@dataclass
class UpPlan:
    """What to start; built from the CLI flags."""

    model: str | None  # None with mock
    mock: bool
    prefill: int
    decode: int
    host: str
    port: int
    nats_url: str | None
    ns: str | None
    worker_flags: list[str] = field(default_factory=list)  # pool flags passed to every worker
    gateway_flags: list[str] = field(default_factory=list)


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    reported: bool = False


def _spawn(child: Child, env: dict) -> None:
    child.proc = subprocess.Popen(child.argv, env=env, preexec_fn=die_with_parent)


def _stop(children: list[Child], timeout: float) -> None:
    for c in children:
        if c.proc and c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time: killing it", c.name)
            c.proc.kill()
            c.proc.wait()


def children_for(plan: UpPlan, nats_url: str) -> tuple[Child, list[Child]]:
    py = [sys.executable, "-m", "mesh.cli"]
    bus = ["--nats", nats_url] + (["--ns", plan.ns] if plan.ns else [])
    model = [] if plan.mock else ["--model", plan.model]
    workers = []
    decode_role = "mock" if plan.mock else "decode"
    for i in range(plan.decode):
        workers.append(Child(f"decode-{i}", [*py, "worker", decode_role, *bus, *model, *plan.worker_flags]))
    for i in range(plan.prefill):
        mock = ["--mock"] if plan.mock else []
        workers.append(Child(f"prefill-{i}", [*py, "worker", "prefill", *mock, *bus, *model, *plan.worker_flags]))
    gateway = Child("gateway", [*py, "gateway", *bus, *model, "--host", plan.host, "--port", str(plan.port),
                                *plan.gateway_flags])
    return gateway, workers


async def _wait_healthy(url: str, children: list[Child], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if any(c.proc.poll() is not None for c in children):
                return False
            try:
                r = await client.get(url)
                if r.status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    return False


async def run_up(plan: UpPlan) -> int:
    stop = stop_event_on_signals()
    nats = None
    url = plan.nats_url
    if url is None:
        nats = EmbeddedNats().start()
        url = nats.url
    env = dict(os.environ)
    gateway, workers = children_for(plan, url)
    started: list[Child] = []
    try:
        for c in [*workers, gateway]:
            _spawn(c, env)
            started.append(c)
        health = f"http://{'127.0.0.1' if plan.host in ('0.0.0.0', '::') else plan.host}:{plan.port}/health"
        if not await _wait_healthy(health, started, timeout=120.0):
            dead = [c.name for c in started if c.proc.poll() is not None]
            print(f"mesh: error: the mesh did not come up ({', '.join(dead) or 'timeout'})", file=sys.stderr)
            return 1
        what = "mocker" if plan.mock else plan.model
        print(
            f"pdmesh is up: http://{plan.host}:{plan.port}/v1 serving {what} "
            f"({plan.prefill} prefill, {plan.decode} decode; NATS {url}). Ctrl-C stops it.",
            flush=True,
        )
        while not stop.is_set():
            for c in started:
                if c.proc.poll() is not None and not c.reported:
                    c.reported = True
                    log.warning("%s exited with status %s", c.name, c.proc.returncode)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return 0
    finally:
        # The gateway first (no new requests), then the workers (they drain), then the bus.
        await asyncio.to_thread(_stop, [gateway], 10.0)
        await asyncio.to_thread(_stop, workers, 40.0)
        if nats is not None:
            nats.stop()
