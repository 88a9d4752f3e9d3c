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

    models: list[str]  # model directories, one pool pair each ([] with --mock alone: the model "mock")
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
    served_name: str | None = None  # the one model's name when --served-name is given


def served_name(model_dir: str) -> str:
    return Path(model_dir).name


def worker_argv(plan: UpPlan, nats_url: str, model_dir: str | None) -> dict[str, list[str]]:
    """The command line of one model's pool workers (the connector adds ``--worker-id``)."""
    py = [sys.executable, "-m", "mesh.cli"]
    bus = ["--nats", nats_url] + (["--ns", plan.ns] if plan.ns else [])
    model = [] if model_dir is None else ["--model", model_dir]
    decode_role = "mock" if plan.mock else "decode"
    mock = ["--mock"] if plan.mock else []
    return {
        "decode": [*py, "worker", decode_role, *bus, *model, *plan.worker_flags],
        "prefill": [*py, "worker", "prefill", *mock, *bus, *model, *plan.worker_flags],
    }


def _token(model_dir: str | None) -> str:
    from mesh.protocol import subject_token

    return subject_token(served_name(model_dir) if model_dir else "mock")


def gateway_argv(plan: UpPlan, nats_url: str) -> list[str]:
    bus = ["--nats", nats_url] + (["--ns", plan.ns] if plan.ns else [])
    model = [arg for m in plan.models for arg in ("--model", m)]
    return [sys.executable, "-m", "mesh.cli", "gateway", *bus, *model, "--host", plan.host,
            "--port", str(plan.port), *plan.gateway_flags]


async def _wait_ready(base: str, models: set[str], gateway: subprocess.Popen, timeout: float) -> bool:
    """Healthy, and every model has a live worker (a mesh is up when all of it is)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if gateway.poll() is not None:
                return False
            try:
                if (await client.get(f"{base}/health")).status_code == 200:
                    live = {m["id"] for m in (await client.get(f"{base}/v1/models")).json()["data"]}
                    if models <= live:
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
    # one pool pair (and one planner) per model: they scale on their own, on the same bus
    model_dirs: list[str | None] = list(plan.models) or [None]
    pools = {
        (served_name(m) if m else "mock"): LocalConnector(
            worker_argv(plan, url, m), env=dict(os.environ), prefix=f"{_token(m)}-{os.getpid()}")
        for m in model_dirs
    }
    gateway = None
    planners: list[Planner] = []
    bus = membership = None
    try:
        for connector in pools.values():
            await connector.scale("decode", plan.decode)
            await connector.scale("prefill", plan.prefill)
        gateway = subprocess.Popen(gateway_argv(plan, url), preexec_fn=die_with_parent)  # noqa: ASYNC220 (returns at once)
        base = f"http://{'127.0.0.1' if plan.host in ('0.0.0.0', '::') else plan.host}:{plan.port}"
        names = {plan.served_name} if plan.served_name else set(pools)
        if not await _wait_ready(base, names, gateway, timeout=120.0):
            print(f"mesh: error: the mesh did not come up (gateway {'exited' if gateway.poll() is not None else 'not healthy'})",
                  file=sys.stderr)
            return 1
        if plan.planner is not None:
            bus = await Bus.connect(url, "planner", ns=plan.ns or "mesh")
            membership = Membership(bus)
            await membership.start()
            for name, connector in pools.items():
                planner = Planner(bus, membership, connector, plan.planner, model=name)
                await planner.start()
                planners.append(planner)
        what = ", ".join(plan.models) or "the mocker"
        if plan.mock and plan.models:
            what = f"the mocker as {what}"
        mode = "planner on" if planners else "fixed pools"
        print(
            f"pdmesh is up: http://{plan.host}:{plan.port}/v1 serving {what} "
            f"({plan.prefill} prefill, {plan.decode} decode{' per model' if len(pools) > 1 else ''}, {mode}; "
            f"NATS {url}). Ctrl-C stops it.",
            flush=True,
        )
        while not stop.is_set():
            if not planners:  # fixed pools: replace a worker that died
                for connector in pools.values():
                    for pool, n in (("decode", plan.decode), ("prefill", plan.prefill)):
                        if await connector.replicas(pool) < n:
                            await connector.scale(pool, n)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return 0
    finally:
        # The gateway first (no new requests), then the workers (they drain), then the bus.
        for planner in planners:
            await planner.stop()
        if membership is not None:
            await membership.stop()
        if bus is not None:
            await bus.close()
        if gateway is not None:
            await asyncio.to_thread(_stop_gateway, gateway)
        await asyncio.gather(*(connector.close() for connector in pools.values()))
        if nats is not None:
            nats.stop()
