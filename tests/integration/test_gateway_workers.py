"""``mesh gateway --workers 2``: two gateway processes on one port (SO_REUSEPORT) under a
supervisor; both serve, any one answers /metrics for both, a killed one is replaced, and SIGTERM
stops them all."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from mesh.natsserver import free_port
from tests.helpers.cluster import wait_http_ok
from tests.helpers.procs import alive, descendants


def children(pid: int) -> list[int]:
    return sorted(p for p in descendants(pid) if Path(f"/proc/{p}/cmdline").read_bytes().count(b"--reuse-port"))


def metrics_dir(pid: int) -> Path:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    value = next(e for e in env if e.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    return Path(value.split(b"=", 1)[1].decode())


def completions_200(text: str) -> float:
    m = re.search(r'^pdmesh_gateway_requests_total\{endpoint="completions",status="200"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def healthy_in_a_row(url: str, n: int = 12, timeout: float = 60.0) -> None:
    """``n`` fresh connections in a row answered healthy: every process has a live worker."""
    deadline, row = time.monotonic() + timeout, 0
    while row < n:
        assert time.monotonic() < deadline, "not every gateway process became healthy"
        with httpx.Client(timeout=5) as http:
            row = row + 1 if http.get(url + "/health").status_code == 200 else 0
        time.sleep(0.05)


def one_request(url: str) -> int:
    with httpx.Client(timeout=30) as http:  # a new connection each time: the kernel picks a process
        r = http.post(url + "/v1/completions", json={"model": "mock", "prompt": [5, 6, 7], "max_tokens": 3})
        return r.status_code


@pytest.fixture(scope="module")
def gateway(cluster):
    cluster.worker("mock", "--worker-id", "gw-workers-mock", "--mock-speedup", "50")
    port = free_port()
    sup = cluster.spawn("gateway", "--nats", cluster.nats_url, "--host", "127.0.0.1", "--port", str(port),
                        "--workers", "2")
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(url + "/health", 90)
    deadline = time.monotonic() + 30
    while len(children(sup.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return sup, url


def test_two_processes_serve_one_port_and_count_together(gateway):
    sup, url = gateway
    kids = children(sup.pid)
    assert len(kids) == 2
    healthy_in_a_row(url)
    statuses = [one_request(url) for _ in range(40)]
    assert statuses == [200] * 40
    # each process counted into its own file of the shared metrics directory: both served
    files = {p.name for p in metrics_dir(kids[0]).glob("counter_*.db")}
    assert {f"counter_{k}.db" for k in kids} <= files, files
    # and whichever process answers /metrics, it reports every process's requests
    for _ in range(4):
        text = httpx.get(url + "/metrics", timeout=10).text
        assert completions_200(text) == 40
        assert "pdmesh_gateway_inflight_requests 0.0" in text


def test_a_killed_process_is_replaced_and_sigterm_stops_all(gateway):
    sup, url = gateway
    before = children(sup.pid)
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = children(sup.pid)
        if len(now) == 2 and before[0] not in now:
            break
        time.sleep(0.2)
    now = children(sup.pid)
    assert len(now) == 2 and before[0] not in now
    healthy_in_a_row(url)  # the new process is connected and has heard the worker's card
    assert [one_request(url) for _ in range(10)] == [200] * 10
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(30) == 0
    assert not [k for k in now if alive(k)]
