"""Where scale decisions take effect, behind one interface.

    replicas(pool) -> int        what the connector runs (or asked for) now
    scale(pool, target, victims) set the pool's size; ``victims`` are the worker ids to
                                 remove first when shrinking (the least loaded)

``local`` runs ``mesh worker`` processes on this machine (what ``mesh up``
uses); shrinking sends SIGTERM, and the worker drains: it leaves the router's
candidates, takes no new work, finishes what it has, deregisters, exits.
``kubernetes`` sets the prefill and decode Deployments' replica counts through
the scale subresource (pods get SIGTERM and drain the same way). ``virtual``
only records targets (decisions are published on the bus either way).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from mesh.procutil import die_with_parent, stop_processes

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


class Connector(Protocol):
    name: str

    async def replicas(self, pool: str) -> int: ...

    async def scale(self, pool: str, target: int, victims: Sequence[str] = ()) -> None: ...

    async def close(self) -> None: ...


class VirtualConnector:
    name = "virtual"

    def __init__(self, initial: dict[str, int] | None = None):
        self.targets = dict(initial or {})

    async def replicas(self, pool: str) -> int:
        return self.targets.get(pool, 0)

    async def scale(self, pool: str, target: int, victims: Sequence[str] = ()) -> None:
        self.targets[pool] = target

    async def close(self) -> None:
        pass


@dataclass
class _Proc:
    worker_id: str
    proc: subprocess.Popen
    draining: bool = False


@dataclass
class LocalConnector:
    """Worker processes of this machine. ``argv[pool]`` is the command line without ``--worker-id``.
    ``launchers``: argv prefixes taken in turn, one per started worker (``nsenter ...`` into the
    namespaces of a host of the multi-host test bed, ``ssh HOST`` ...): the pool spreads over them."""

    argv: dict[str, list[str]]
    env: dict[str, str] | None = None
    drain_timeout: float = 60.0
    name: str = "local"
    procs: dict[str, list[_Proc]] = field(default_factory=lambda: {p: [] for p in POOLS})
    _ids: itertools.count = field(default_factory=itertools.count)
    prefix: str = field(default_factory=lambda: f"w{os.getpid()}")
    exited: list[tuple[str, int]] = field(default_factory=list)  # (worker id, status) of reaped processes
    launchers: list[list[str]] = field(default_factory=list)
    _placed: itertools.count = field(default_factory=itertools.count)

    def _alive(self, pool: str) -> list[_Proc]:
        return [p for p in self.procs.get(pool, []) if p.proc.poll() is None and not p.draining]

    async def replicas(self, pool: str) -> int:
        self.reap()
        return len(self._alive(pool))

    def worker_ids(self, pool: str) -> list[str]:
        return [p.worker_id for p in self._alive(pool)]

    async def scale(self, pool: str, target: int, victims: Sequence[str] = ()) -> None:
        self.reap()
        alive = self._alive(pool)
        for _ in range(target - len(alive)):
            self._spawn(pool)
        extra = len(alive) - target
        if extra > 0:
            order = sorted(alive, key=lambda p: (p.worker_id not in victims, -self.procs[pool].index(p)))
            for p in order[:extra]:
                log.info("draining %s", p.worker_id)
                p.draining = True
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGTERM)

    def _spawn(self, pool: str) -> _Proc:
        wid = f"{pool}-{self.prefix}-{next(self._ids)}"  # the prefix keeps ids unique per connector
        # its own process group: a terminal's Ctrl-C reaches whoever runs the connector, which
        # then signals each worker exactly once (a second signal would cut the worker's drain)
        launcher = self.launchers[next(self._placed) % len(self.launchers)] if self.launchers else []
        proc = subprocess.Popen([*launcher, *self.argv[pool], "--worker-id", wid], env=self.env,
                                preexec_fn=die_with_parent, process_group=0)
        p = _Proc(wid, proc)
        self.procs.setdefault(pool, []).append(p)  # a pool of argv beyond POOLS: mesh up's embed workers
        log.info("started %s (pid %d)", wid, proc.pid)
        return p

    def reap(self) -> None:
        """Forget exited processes; kill drainers that overstay."""
        for pool in self.procs:
            keep = []
            for p in self.procs[pool]:
                rc = p.proc.poll()
                if rc is None:
                    keep.append(p)
                    continue
                self.exited.append((p.worker_id, rc))
                if not p.draining:
                    log.warning("%s exited unexpectedly (status %s)", p.worker_id, rc)
            self.procs[pool] = keep

    async def close(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> None:
        """Stop every worker: SIGTERM drains each (up to its own drain timeout), SIGINT stops them
        quickly; whoever is still running after ``timeout`` (default ``drain_timeout``) is killed."""
        everyone = [p for procs in self.procs.values() for p in procs]
        # a worker already draining got its SIGTERM from ``scale``: a second one would reach it
        # while it exits, after Python restored the default handler (killed, status -15); a
        # SIGINT is meant to cut its drain short, so that one goes to every worker
        signalled = [p.proc for p in everyone if sig == signal.SIGTERM and p.draining]
        for p in everyone:
            p.draining = True
        killed = await stop_processes([p.proc for p in everyone], sig,
                                      self.drain_timeout if timeout is None else timeout, signalled=signalled)
        if killed:
            log.warning("killed %d workers that did not stop in time", len(killed))
        self.reap()


_SA = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesConnector:
    """Scales the pool Deployments through ``deployments/{name}/scale`` (get and patch only)."""

    name = "kubernetes"

    def __init__(self, namespace: str | None = None, deployments: dict[str, str] | None = None,
                 api: str | None = None, token: str | None = None, verify: str | bool | None = None,
                 timeout: float = 10.0):
        self.namespace = namespace or _read(_SA / "namespace") or "default"
        self.deployments = deployments or {"prefill": "pdmesh-prefill", "decode": "pdmesh-decode"}
        if api is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError("not in a cluster: KUBERNETES_SERVICE_HOST is unset (pass the API URL)")
            api = f"https://{host}:{port}"
        token = token if token is not None else _read(_SA / "token")
        if verify is None:
            ca = _SA / "ca.crt"
            verify = str(ca) if ca.is_file() else True
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(base_url=api, headers=headers, verify=verify, timeout=timeout)

    def _path(self, pool: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployments[pool]}/scale"

    async def replicas(self, pool: str) -> int:
        r = await self._client.get(self._path(pool))
        r.raise_for_status()
        return int(r.json().get("spec", {}).get("replicas", 0))

    async def scale(self, pool: str, target: int, victims: Sequence[str] = ()) -> None:
        r = await self._client.patch(
            self._path(pool), content=json.dumps({"spec": {"replicas": target}}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        r.raise_for_status()

    async def close(self) -> None:
        await self._client.aclose()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
