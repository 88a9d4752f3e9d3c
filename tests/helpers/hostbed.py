"""Simulated hosts on one machine: the test bed of the mesh across hosts (issue 31).

Each host of a ``HostBed`` is

- a network namespace ``pdmesh-bed-<pid>-h<i>`` with loopback up and one veth to a bridge in
  the root namespace; its address is ``10.213.X.i`` (X: a /24 no route of this machine uses,
  the root namespace takes ``.254`` on the bridge, so the test process reaches every host);
- a holder process (``unshare --mount --uts`` inside the network namespace) that mounts its own
  tmpfs on /dev/shm, sets its hostname ``bed-h<i>`` and sleeps: every process of the host is
  started with ``nsenter -t HOLDER --net --mount --uts``, so it sees that host's /dev/shm,
  hostname (``kvstore.transfer.host_id()`` differs per host: shm is not used across hosts) and
  addresses, and gets ``TMPDIR`` a directory of its own;
- one nats-server of a cluster (client port 4222, routes on 6222, monitoring on 8222, all on
  the host's address; JetStream with a store per host);
- the roles a test starts on it (``python -m cli ...`` with ``--nats`` its own server).

Faults: ``kill_host(i)`` (SIGKILL every process of the host at once, nats-server and holder
included: /dev/shm goes with it, as in a crash), ``partition(i, seconds)`` / ``heal(i)`` (the
veth's bridge side down / up), ``restart_host(i)`` (a new holder, the nats-server on its old
store, the roles it ran).

Names: namespaces ``pdmesh-bed-<pid>-h<i>``; links (15 characters at most) ``pdmb<tag>br`` and
``pdmb<tag>h<i>``, ``<tag>`` the owner's pid in base 36. ``stop()`` removes all of them (also at
exit); ``start()`` first removes those of owners no longer alive (runs that were killed). Nothing
else is touched, and traffic goes only to the bed's own addresses.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mesh.natsserver import EmbeddedNats
from tests.helpers.procs import alive

NS_PREFIX = "pdmesh-bed-"
LINK_PREFIX = "pdmb"
NATS_PORT, ROUTE_PORT, MONITOR_PORT = 4222, 6222, 8222
_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)-h\d+$")
_LINK_RE = re.compile(rf"^{LINK_PREFIX}([0-9a-z]+)(br|h\d+)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def unavailable_reason() -> str | None:
    """Why this machine cannot host a bed (the one line a skipping test gives), or None."""
    if os.geteuid() != 0:
        return "the host bed needs root (network namespaces)"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"the host bed needs `{tool}`"
    probe = f"{NS_PREFIX}{os.getpid()}-h99"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return "network namespaces cannot be made here"
    _ip("netns", "del", probe, check=False)
    return None


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of beds whose owner process is gone; the names removed."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NS_RE.match(name)
        if m and not alive(int(m.group(1))):
            _kill_pids(_ns_pids(name))
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = _LINK_RE.match(name)
        if m and not alive(int(m.group(1), 36)):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _free_subnet(start: int) -> int:
    """X of a 10.213.X.0/24 that no route or address of this machine (nor another bed) uses."""
    used = _ip("-4", "route", "show", "table", "all", check=False).stdout + _ip("-4", "addr", check=False).stdout
    for k in range(254):
        x = 1 + (start + k) % 253
        if f"10.213.{x}." not in used:
            return x
    raise RuntimeError("no free 10.213.X.0/24 for the host bed")


@dataclass
class Host:
    """One simulated host: its namespace, address, holder, nats-server and the roles it runs."""

    index: int
    ns: str
    addr: str
    veth: str  # the bridge side (partition: down)
    root: Path  # its tmp dir and nats store
    holder: subprocess.Popen | None = None
    nats: EmbeddedNats | None = None
    roles: list[tuple[list[str], dict]] = field(default_factory=list)  # (argv, env) to restart
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def hostname(self) -> str:
        return f"bed-h{self.index}"

    @property
    def nats_url(self) -> str:
        return f"nats://{self.addr}:{NATS_PORT}"

    @property
    def monitor(self) -> str:
        return f"http://{self.addr}:{MONITOR_PORT}"

    def enter(self) -> list[str]:
        """The argv prefix that runs a command inside this host."""
        assert self.holder is not None and self.holder.poll() is None, f"host {self.index} is down"
        return ["nsenter", "-t", str(self.holder.pid), "--net", "--mount", "--uts", f"--wd={os.getcwd()}"]


class HostBed:
    """``n`` simulated hosts (1-based: host 1 .. host n); use as a context manager."""

    def __init__(self, n: int = 3, name: str = "bed", log_dir: Path | None = None):
        self.n = n
        self.cluster_name = name
        self.tag = _b36(os.getpid())
        self.root = Path(tempfile.mkdtemp(prefix=f"{NS_PREFIX}{os.getpid()}-"))
        self.log_dir = log_dir
        self.bridge = f"{LINK_PREFIX}{self.tag}br"
        self.subnet = 0
        self.hosts: dict[int, Host] = {}
        self._lock = threading.Lock()
        self._stopped = False

    # ---- set up and tear down -------------------------------------------------------------

    def start(self) -> HostBed:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        sweep_stale()
        atexit.register(self.stop)
        try:
            self.subnet = _free_subnet(os.getpid() % 253)
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"10.213.{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(1, self.n + 1):
                self.hosts[i] = self._make_host(i)
            for i in self.hosts:
                self._start_host(i)
            self.wait_jetstream()
        except BaseException:
            self.stop()
            raise
        return self

    def _make_host(self, i: int) -> Host:
        ns = f"{NS_PREFIX}{os.getpid()}-h{i}"
        veth, peer = f"{LINK_PREFIX}{self.tag}h{i}", f"{LINK_PREFIX}{self.tag}p{i}"
        host = Host(i, ns, f"10.213.{self.subnet}.{i}", veth, self.root / f"h{i}")
        (host.root / "tmp").mkdir(parents=True)
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", peer, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        return host

    def _start_holder(self, host: Host) -> None:
        script = ("mount -t tmpfs -o size=2g tmpfs /dev/shm && hostname \"$1\" && echo ready && exec sleep infinity")
        host.holder = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, "unshare", "--mount", "--uts", "--propagation", "private",
             "sh", "-c", script, "holder", host.hostname],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        line = host.holder.stdout.readline()  # the holder says when its mounts and hostname are set
        if line.strip() != "ready":
            raise RuntimeError(f"host {host.index}: the namespace holder did not start")

    def _start_host(self, i: int, timeout: float = 20.0) -> None:
        host = self.hosts[i]
        self._start_holder(host)
        routes = ", ".join(f"nats://{h.addr}:{ROUTE_PORT}" for h in self.hosts.values())
        conf = (f"server_name: {self.cluster_name}-h{i}\nhttp: \"{host.addr}:{MONITOR_PORT}\"\n"
                f"cluster {{\n  name: {self.cluster_name}\n  listen: \"{host.addr}:{ROUTE_PORT}\"\n"
                f"  routes: [{routes}]\n}}\n")
        if host.nats is None:
            host.nats = EmbeddedNats(port=NATS_PORT, host=host.addr, store_dir=str(host.root / "nats"),
                                     config=conf, launcher=tuple(host.enter()))
        else:
            host.nats.launcher = tuple(host.enter())
        host.nats.start(timeout)

    def wait_jetstream(self, timeout: float = 30.0) -> None:
        """Until every running server knows the cluster's JetStream leader (its /jsz says so)."""
        import httpx

        deadline = time.monotonic() + timeout
        for host in self.hosts.values():
            while self.alive(host.index):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    if (httpx.get(f"{host.monitor}/jsz", timeout=2).json().get("meta_cluster") or {}).get("leader"):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"host {host.index}: no JetStream leader within {timeout:.0f}s")
                time.sleep(0.1)

    def stop(self) -> None:
        """Every process, namespace, link and directory of the bed; safe to call twice."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._terminate(list(self.hosts.values()))
        for host in self.hosts.values():
            _ip("netns", "del", host.ns, check=False)
            _ip("link", "del", host.veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def _terminate(self, hosts: list[Host]) -> None:
        """Every host's roles get SIGTERM (a graceful stop) at once, while every nats-server is still
        up, and a few seconds; then everything left is killed. (Host by host, a later host's roles
        stopped with an earlier host's server already gone: seconds more per bed.)"""
        procs = [p for host in hosts for p in host.procs]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        for host in hosts:
            self._kill_all(host)

    def _kill_all(self, host: Host) -> None:
        _kill_pids(_ns_pids(host.ns))
        for p in [*host.procs, host.holder, host.nats.proc if host.nats else None]:
            if p is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
        if host.nats is not None:
            host.nats.proc = None
        host.procs.clear()
        host.holder = None

    def __enter__(self) -> HostBed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- processes -----------------------------------------------------------------------

    @property
    def nats_urls(self) -> str:
        """Every host's server, comma-separated (what ``--nats`` takes for the whole cluster)."""
        return ",".join(h.nats_url for h in self.hosts.values())

    def spawn(self, i: int, argv: list[str], env: dict | None = None, remember: bool = True,
              pipes: bool = False) -> subprocess.Popen:
        """Run ``argv`` on host ``i`` (``remember``: ``restart_host`` starts it again; ``pipes``: text
        stdin and stdout to talk to it)."""
        host = self.hosts[i]
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(host.root / "tmp"), **(env or {})}
        log = subprocess.DEVNULL
        if self.log_dir is not None:
            name = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else Path(argv[0]).name
            log = open(self.log_dir / f"h{i}-{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        try:
            proc = subprocess.Popen([*host.enter(), *argv], env=full_env, stderr=log, start_new_session=True,
                                    stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if pipes else subprocess.DEVNULL, text=pipes or None)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        host.procs.append(proc)
        if remember:
            host.roles.append((argv, env or {}))
        return proc

    def cli(self, i: int, *args: str, env: dict | None = None) -> subprocess.Popen:
        """``python -m cli ARGS`` on host ``i``."""
        return self.spawn(i, [sys.executable, "-m", "cli", *args], env=env)

    def worker(self, i: int, role: str, *flags: str, env: dict | None = None) -> subprocess.Popen:
        """``mesh worker ROLE`` on host ``i``, on that host's nats-server."""
        return self.cli(i, "worker", role, "--nats", self.hosts[i].nats_url, *flags, env=env)

    def gateway(self, i: int, *flags: str, port: int = 8000) -> str:
        """``mesh gateway`` on host ``i`` (its own nats-server), listening on the host's address: its URL."""
        host = self.hosts[i]
        self.cli(i, "gateway", "--nats", host.nats_url, "--host", host.addr, "--port", str(port), *flags)
        return f"http://{host.addr}:{port}"

    # ---- faults --------------------------------------------------------------------------

    def kill_host(self, i: int) -> None:
        """SIGKILL every process of host ``i`` at once (its nats-server and holder too)."""
        self._kill_all(self.hosts[i])

    def partition(self, i: int, seconds: float | None = None) -> _Partition:
        """Cut host ``i`` off the bridge; heal after ``seconds`` (a timer), or on leaving the ``with``."""
        _ip("link", "set", self.hosts[i].veth, "down")
        return _Partition(self, i, seconds)

    def heal(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].veth, "up")

    def restart_host(self, i: int, timeout: float = 20.0) -> None:
        """Host ``i`` back after ``kill_host``: a fresh /dev/shm, its nats-server on its old store, its roles."""
        host = self.hosts[i]
        self._start_host(i, timeout)
        self.wait_jetstream()  # roles that start before the server rejoined find no JetStream (503)
        for argv, env in host.roles:
            self.spawn(i, argv, env, remember=False)

    def alive(self, i: int) -> bool:
        host = self.hosts[i]
        return host.holder is not None and host.holder.poll() is None


class _Partition:
    """A partition of one host: heals on ``heal()``, at the end of a ``with``, or after its timer."""

    def __init__(self, bed: HostBed, i: int, seconds: float | None):
        self.bed, self.i = bed, i
        self._timer = threading.Timer(seconds, self.heal) if seconds else None
        if self._timer:
            self._timer.daemon = True
            self._timer.start()

    def heal(self) -> None:
        if self._timer:
            self._timer.cancel()
        self.bed.heal(self.i)

    def __enter__(self) -> _Partition:
        return self

    def __exit__(self, *exc) -> None:
        self.heal()
