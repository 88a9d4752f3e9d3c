"""``mesh up``: the whole mesh on one machine.

Embedded NATS (unless ``--nats``), the tiny model (generated if missing, unless
``--model`` or ``--mock``), the gateway, and the prefill and decode pools as
child processes run by the planner's local connector; the planner sizes the
pools (unless ``--no-planner``; fixed pools get a dead worker replaced).
Ctrl-C or SIGTERM stops everything it started: the gateway first, then the
workers (each drains), then NATS. Children also die with this process if it
is killed outright (PR_SET_PDEATHSIG).
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

from mesh.bus import Bus
from mesh.natsserver import EmbeddedNats
from mesh.planner.connectors import LocalConnector
from mesh.planner.planner import Planner
from mesh.planner.policy import PlannerConfig
from mesh.procutil import die_with_parent, stop_event_on_signals
from mesh.registry import Membership

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
    planner: PlannerConfig | None = None  # None: fixed pools


def worker_argv(plan: UpPlan, nats_url: str) -> dict[str, list[str]]:
    """The command line of each pool's workers (the connector adds ``--worker-id``)."""
    py = [sys.executable, "-m", "mesh.cli"]
    bus = ["--nats", nats_url] + (["--ns", plan.ns] if plan.ns else [])
    model = [] if plan.mock else ["--model", plan.model]
    decode_role = "mock" if plan.mock else "decode"
    mock = ["--mock"] if plan.mock else []
    return {
        "decode": [*py, "worker", decode_role, *bus, *model, *plan.worker_flags],
        "prefill": [*py, "worker", "prefill", *mock, *bus, *model, *plan.worker_flags],
    }


def gateway_argv(plan: UpPlan, nats_url: str) -> list[str]:
    bus = ["--nats", nats_url] + (["--ns", plan.ns] if plan.ns else [])
    model = [] if plan.mock else ["--model", plan.model]
    return [sys.executable, "-m", "mesh.cli", "gateway", *bus, *model, "--host", plan.host,
            "--port", str(plan.port), *plan.gateway_flags]


async def _wait_healthy(url: str, gateway: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if gateway.poll() is not None:
                return False
            try:
                r = await client.get(url)
                if r.status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    return False


def _stop_gateway(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("the gateway did not stop in time: killing it")
        proc.kill()
        proc.wait()


async def run_up(plan: UpPlan) -> int:
    stop = stop_event_on_signals()
    nats = None
    url = plan.nats_url
    if url is None:
        nats = EmbeddedNats().start()
        url = nats.url
    pools = LocalConnector(worker_argv(plan, url), env=dict(os.environ))
    gateway = None
    planner = bus = membership = None
    try:
        await pools.scale("decode", plan.decode)
        await pools.scale("prefill", plan.prefill)
        gateway = subprocess.Popen(gateway_argv(plan, url), preexec_fn=die_with_parent)  # noqa: ASYNC220 (returns at once)
        health = f"http://{'127.0.0.1' if plan.host in ('0.0.0.0', '::') else plan.host}:{plan.port}/health"
        if not await _wait_healthy(health, gateway, timeout=120.0):
            print(f"mesh: error: the mesh did not come up (gateway {'exited' if gateway.poll() is not None else 'not healthy'})",
                  file=sys.stderr)
            return 1
        if plan.planner is not None:
            bus = await Bus.connect(url, "planner", ns=plan.ns or "mesh")
            membership = Membership(bus)
            await membership.start()
            planner = Planner(bus, membership, pools, plan.planner)
            await planner.start()
        what = "mocker" if plan.mock else plan.model
        mode = "planner on" if planner else "fixed pools"
        print(
            f"pdmesh is up: http://{plan.host}:{plan.port}/v1 serving {what} "
            f"({plan.prefill} prefill, {plan.decode} decode, {mode}; NATS {url}). Ctrl-C stops it.",
            flush=True,
        )
        while not stop.is_set():
            if planner is None:  # fixed pools: replace a worker that died
                for pool, n in (("decode", plan.decode), ("prefill", plan.prefill)):
                    if await pools.replicas(pool) < n:
                        await pools.scale(pool, n)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return 0
    finally:
        # The gateway first (no new requests), then the workers (they drain), then the bus.
        if planner is not None:
            await planner.stop()
        if membership is not None:
            await membership.stop()
        if bus is not None:
            await bus.close()
        if gateway is not None:
            await asyncio.to_thread(_stop_gateway, gateway)
        await pools.close()
        if nats is not None:
            nats.stop()
