"""``mesh up``'s runner: the whole mesh on one machine, as ``cli.up`` planned it.

Embedded NATS (unless ``--nats``), the tiny model (generated if missing, unless
``--model`` or ``--mock``), the gateway, and the prefill and decode pools as
child processes run by the planner's local connector; the planner sizes the
pools (unless ``--no-planner``; fixed pools get a dead worker replaced).
Ctrl-C or SIGTERM stops everything it started within a few seconds: the
gateway and the workers together (workers drain briefly, the gateway reports how
their streams ended), then NATS once nobody uses it. Children also die with this process if it
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
from mesh.natsauth import ENV_NAMES, NatsConfig
from mesh.natsserver import EmbeddedNats
from mesh.planner.connectors import LocalConnector
from mesh.planner.planner import Planner
from mesh.planner.policy import PlannerConfig
from mesh.procutil import die_with_parent, stop_event_on_signals, stop_processes
from mesh.registry import Membership

log = logging.getLogger(__name__)


@dataclass
class UpPlan:
    """What to start; built from the CLI flags."""

    models: list[str]  # model directories, one pool pair each ([] with --mock alone: the model "mock")
    mock: bool
    prefill: int
    decode: int
    host: str
    port: int
    nats: NatsConfig | None  # None: an embedded server
    ns: str | None
    worker_flags: list[str] = field(default_factory=list)  # pool flags passed to every worker
    gateway_flags: list[str] = field(default_factory=list)
    planner: PlannerConfig | None = None  # None: fixed pools
    served_name: str | None = None  # the one model's name when --served-name is given
    gateway_env: dict[str, str] = field(default_factory=dict)  # secrets for the gateway (API keys)
    embed: int = 0  # embed workers per model (worker decode --task embed): a fixed pool of its own
    embed_flags: list[str] = field(default_factory=list)  # --task embed and its pooling


def served_name(model_dir: str) -> str:
    return Path(model_dir).name


def worker_argv(plan: UpPlan, model_dir: str | None) -> dict[str, list[str]]:
    """The command line of one model's pool workers (the connector adds ``--worker-id``; NATS
    comes in the environment, ``child_env``)."""
    py = [sys.executable, "-m", "cli"]
    bus = ["--ns", plan.ns] if plan.ns else []
    model = [] if model_dir is None else ["--model", model_dir]
    decode_role = "mock" if plan.mock else "decode"
    mock = ["--mock"] if plan.mock else []
    return {
        "decode": [*py, "worker", decode_role, *bus, *model, *plan.worker_flags],
        "prefill": [*py, "worker", "prefill", *mock, *bus, *model, *plan.worker_flags],
        "embed": [*py, "worker", "decode", *bus, *model, *plan.worker_flags, *plan.embed_flags],
    }


def _token(model_dir: str | None) -> str:
    from mesh.protocol import subject_token

    return subject_token(served_name(model_dir) if model_dir else "mock")


def gateway_argv(plan: UpPlan) -> list[str]:
    bus = ["--ns", plan.ns] if plan.ns else []
    model = [arg for m in plan.models for arg in ("--model", m)]
    return [sys.executable, "-m", "cli", "gateway", *bus, *model, "--host", plan.host,
            "--port", str(plan.port), *plan.gateway_flags]


async def _wait_ready(base: str, models: set[str], gateway: subprocess.Popen, timeout: float,
                      embed: set[str] = frozenset()) -> bool:
    """Healthy, every model of ``models`` has a live decode worker and every one of ``embed`` an
    embed worker (a mesh is up when all of it is)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if gateway.poll() is not None:
                return False
            try:
                health = await client.get(f"{base}/health")  # open even with API keys on
                ready = health.json() if health.status_code == 200 else {}
                if models <= set(ready.get("models", [])) and embed <= set(ready.get("embed_models", [])) and ready:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    return False


STOP_TIMEOUT = 4.0  # seconds every role gets after the signal before it is killed


async def _stop_gateway(proc: subprocess.Popen) -> None:
    if await stop_processes([proc], signal.SIGINT, timeout=STOP_TIMEOUT):
        log.warning("the gateway did not stop in time: killed it")


async def run_up(plan: UpPlan) -> int:
    stop = stop_event_on_signals()
    nats = None
    config = plan.nats
    if config is None:
        nats = EmbeddedNats().start()
        config = NatsConfig(servers=(nats.url,))
    # NATS (URL with any password, credential files) reaches the children in their environment,
    # which other users cannot read, unlike a command line
    inherited = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    env = {**inherited, **config.child_env()}
    # one pool pair (and one planner) per model: they scale on their own, on the same bus
    model_dirs: list[str | None] = list(plan.models) or [None]
    pools = {
        (served_name(m) if m else "mock"): LocalConnector(
            worker_argv(plan, m), env=env, prefix=f"{_token(m)}-{os.getpid()}")
        for m in model_dirs
    }
    gateway = None
    planners: list[Planner] = []
    bus = membership = None
    try:
        for connector in pools.values():
            await connector.scale("decode", plan.decode)
            await connector.scale("prefill", plan.prefill)
            await connector.scale("embed", plan.embed)
        gateway = subprocess.Popen(gateway_argv(plan), env={**env, **plan.gateway_env},  # noqa: ASYNC220 (returns at once)
                                   preexec_fn=die_with_parent, process_group=0)  # Ctrl-C reaches us only; we signal it once
        base = f"http://{'127.0.0.1' if plan.host in ('0.0.0.0', '::') else plan.host}:{plan.port}"
        names = {plan.served_name} if plan.served_name else set(pools)
        generate = names if plan.decode else set()
        if not await _wait_ready(base, generate, gateway, timeout=120.0, embed=names if plan.embed else set()):
            print(f"mesh: error: the mesh did not come up (gateway {'exited' if gateway.poll() is not None else 'not healthy'})",
                  file=sys.stderr)
            return 1
        if plan.planner is not None:
            bus = await Bus.connect(config.url, "planner", ns=plan.ns or "mesh", config=config.for_role("planner"))
            membership = Membership(bus)
            await membership.start()
            for name, connector in pools.items():
                planner = Planner(bus, membership, connector, plan.planner, model=name)
                await planner.start()
                planners.append(planner)
        print(_banner(plan, len(pools), bool(planners), config), flush=True)
        while not stop.is_set():
            # fixed pools (the embed pool always): replace a worker that died
            fixed = [("embed", plan.embed)] + ([] if planners else [("decode", plan.decode), ("prefill", plan.prefill)])
            for connector in pools.values():
                for pool, n in fixed:
                    if await connector.replicas(pool) < n:
                        await connector.scale(pool, n)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return 0
    finally:
        await _stop_all(planners, membership, bus, gateway, pools, nats)


def _banner(plan: UpPlan, num_models: int, planner_on: bool, config: NatsConfig) -> str:
    what = ", ".join(plan.models) or "the mocker"
    if plan.mock and plan.models:
        what = f"the mocker as {what}"
    mode = "planner on" if planner_on else "fixed pools"
    embed = f", {plan.embed} embed" if plan.embed else ""
    return (f"pdmesh is up: http://{plan.host}:{plan.port}/v1 serving {what} "
            f"({plan.prefill} prefill, {plan.decode} decode{embed}{' per model' if num_models > 1 else ''}, {mode}; "
            f"NATS {config.display}). Ctrl-C stops it.")


async def _stop_all(planners, membership, bus, gateway, pools, nats) -> None:
    """Everything stops together and quickly (SIGINT: in-flight streams get a short drain, then
    end with an error the gateway reports); the gateway outlives the workers' drain so that it
    can report how their streams ended; NATS goes last, once nobody uses it."""
    for planner in planners:
        await planner.stop()
    if membership is not None:
        await membership.stop()
    if bus is not None:
        await bus.close(timeout=1.0)
    stopping = [connector.close(signal.SIGINT, timeout=STOP_TIMEOUT) for connector in pools.values()]
    if gateway is not None:
        stopping.append(_stop_gateway(gateway))
    await asyncio.gather(*stopping)
    if nats is not None:
        await asyncio.to_thread(nats.stop)
