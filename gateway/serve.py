"""Serving the gateway: one process, or N processes on one port.

``mesh gateway --workers N`` (N > 1) runs a supervisor that starts N gateway processes. Each binds
the port with ``SO_REUSEPORT`` (the kernel spreads new connections over them), has its own NATS
connection, reply subscription and router (fed by the same KV events and load reports; routing
decisions go on ``{ns}.router.decisions``, so each counts the others' load), and counts its
metrics into ``PROMETHEUS_MULTIPROC_DIR``, so any of them answers ``/metrics`` for all. The
supervisor restarts a process that dies, forwards SIGINT/SIGTERM, and stops them all (each drains
its streams for up to 5 s) before it exits.

    supervisor ──spawn──> gateway 0 ─┐
               ──spawn──> gateway 1 ─┼── SO_REUSEPORT :8000
               ──spawn──> ...       ─┘
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger(__name__)

RESTART_BACKOFF = 1.0  # seconds before restarting a gateway process that died
CRASH_LOOP = 3  # processes that die within CRASH_WINDOW of starting this many times in a row: give up
CRASH_WINDOW = 5.0
STOP_TIMEOUT = 15.0  # each process drains its streams for 5 s; then it is killed


def default_workers() -> int:
    """One gateway process per two cores, at most 4: the gateway shares its machine with workers
    and nats-server in most deployments, and every process indexes every KV event again."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other processes may bind too (the kernel balances between them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class PortInUse(RuntimeError):
    pass


def check_port(host: str, port: int) -> None:
    """Fail early, in one line, when the port belongs to a process that did not set SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, port))  # bound, never listening: no connection can land here
        except OSError as e:
            raise PortInUse(f"cannot listen on {host}:{port}: {e.strerror}") from None


def supervise(n: int, child_argv: list[str], host: str, port: int) -> int:
    """Run ``n`` gateway processes (``child_argv`` each) until SIGINT/SIGTERM; returns the exit code."""
    check_port(host, port)
    metrics_dir = tempfile.mkdtemp(prefix="pdmesh-gateway-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    procs: list[subprocess.Popen | None] = [None] * n
    started = [0.0] * n
    quick_deaths = [0] * n
    code = 0
    try:
        while not stop.is_set():
            for i in range(n):
                p = procs[i]
                if p is not None and p.poll() is None:
                    continue
                if p is not None:
                    _mark_dead(p.pid, metrics_dir)
                    lived = time.monotonic() - started[i]
                    quick_deaths[i] = quick_deaths[i] + 1 if lived < CRASH_WINDOW else 0
                    if quick_deaths[i] >= CRASH_LOOP:
                        print(f"mesh: error: gateway process {i} keeps exiting ({p.returncode}) right after it "
                              "starts; see its log above", file=sys.stderr)
                        code = 1
                        stop.set()
                        break
                    log.warning("gateway process %d exited (%s): restarting it", i, p.returncode)
                    time.sleep(RESTART_BACKOFF)
                procs[i] = subprocess.Popen(child_argv, env=env)
                started[i] = time.monotonic()
            stop.wait(0.5)
    finally:
        live = [p for p in procs if p is not None and p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code


def _mark_dead(pid: int, metrics_dir: str) -> None:
    """Drop a dead process's live gauges (in-flight requests) from the shared metrics."""
    with contextlib.suppress(Exception):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, metrics_dir)


def child_argv(argv: list[str]) -> list[str]:
    """This command line for one gateway process: ``--workers`` replaced by ``--workers 1 --reuse-port``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--workers":
            skip = True
            continue
        if a.startswith("--workers="):
            continue
        out.append(a)
    return [sys.executable, "-m", "cli", *out, "--workers", "1", "--reuse-port"]
