"""Which KV transports a worker uses by default: nixl between hosts when NIXL imports (any layout), and
without it one log line that KV between hosts goes over nats (a child process where the
``nixl_cu12`` import fails, as on a machine without the extra). And why nixl can be a default:
a worker's idle NIXL agent costs no CPU (no UCX progress thread spinning a core)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from kvstore.transfer import PREFERENCE, nixl_available, ordered
from worker.base import WorkerSettings

CHILD = """
import logging, sys
sys.modules["nixl_cu12"] = None  # the import fails, as without the nixl extra
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from engine.config import EngineConfig
from worker.base import WorkerSettings
ws = WorkerSettings("nats://x", engine=EngineConfig("unused", device="cpu"))
print(ws.transport_names()); print(ws.transport_names())
try:
    WorkerSettings("nats://x", engine=EngineConfig("unused", device="cpu"), transports=("nixl", "nats")).transport_names()
except ValueError as e:
    print("error:", e)
"""

SEGMENTS = """
import os
from kvstore.transfer.nixl_agent import NixlNode
NixlNode.for_worker("segments")
print(os.environ.get("UCX_TCP_TX_SEG_SIZE"), os.environ.get("UCX_TCP_RX_SEG_SIZE"))
"""

IDLE = """
import asyncio, ctypes, os, resource, threading, time
from kvstore.transfer.nixl_agent import NixlNode
node = NixlNode.for_worker("idle-worker")
print(os.environ.get("UCX_TCP_TX_SEG_SIZE"), os.environ.get("UCX_TCP_RX_SEG_SIZE"))
pool = ctypes.create_string_buffer(1 << 22)
node.register("kv", ctypes.addressof(pool), len(pool))
node.metadata()
async def awaited():  # a notification awaited: the progress thread runs, then parks
    node.expect(b"kv:r:1")
    await asyncio.sleep(0.05)
    node.unexpect(b"kv:r:1")
asyncio.run(awaited())
tid = next(t.native_id for t in threading.enumerate() if t.name == "nixl-progress")
print(open(f"/proc/{tid}/timerslack_ns").read().strip())
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0 = cpu(); time.sleep(3); print(cpu() - c0)
"""


def test_preference_puts_nixl_between_the_same_host_paths_and_nats():
    assert PREFERENCE.index("shm") < PREFERENCE.index("nixl") < PREFERENCE.index("nats")
    assert ordered(["nats", "nixl", "shm"]) == ["shm", "nixl", "nats"]


@pytest.mark.skipif(not nixl_available(), reason="the nixl extra is not installed")
def test_cpu_workers_offer_nixl_by_default():
    ws = WorkerSettings("nats://x", engine=EngineConfig("unused", device="cpu"))
    assert ws.transport_names() == ["shm", "nixl", "nats"]
    named = WorkerSettings("nats://x", engine=EngineConfig("unused", device="cpu"), transports=("shm", "nixl", "nats"))
    assert named.transport_names() == ["shm", "nixl", "nats"]
    tp2 = WorkerSettings("nats://x", engine=EngineConfig("unused", device="cpu", tp=2), transports=("nixl", "nats"))
    assert tp2.transport_names() == ["nixl", "nats"]  # each rank's agent registers its part
    pp2 = WorkerSettings("nats://x", engine=EngineConfig("unused", device="cpu", tp=2, pp=2))
    assert pp2.transport_names() == ["shm", "nixl", "nats"]


@pytest.mark.skipif(not nixl_available(), reason="the nixl extra is not installed")
def test_a_ucx_segment_setting_of_the_environment_replaces_the_agents_pair():
    """UCX fails to make the agent when its RX segment is smaller than its TX one: a worker given
    either keeps UCX's own value of the other, not ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run([sys.executable, "-c", SEGMENTS], capture_output=True, text=True, timeout=120, check=True,
                         env={**env, "UCX_TLS": "tcp", "UCX_TCP_RX_SEG_SIZE": "128k"}).stdout
    assert out.splitlines()[-1] == "None 128k", out


def test_without_nixl_one_line_says_nats_carries_kv_between_hosts():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.splitlines()
    assert lines.count("['shm', 'nats']") == 2
    assert sum("KV between hosts goes over nats" in ln for ln in lines) == 1, out  # once, not per call
    assert any(ln.startswith("error:") and "pip install 'pdmesh[nixl]'" in ln for ln in lines), out


@pytest.mark.skipif(not nixl_available(), reason="the nixl extra is not installed")
def test_an_idle_nixl_agent_takes_no_cpu():
    """With UCX's progress thread an idle agent spun a core (5.0 CPU seconds in 5 s; 1.8 s on two
    busy cores): a regression shows as seconds, an idle agent as milliseconds (its own progress
    thread, once the notification it awaited is no longer awaited, parks). On the way: the
    agent's UCX defaults (an explicit setting wins) and its progress thread's fine timers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run([sys.executable, "-c", IDLE], capture_output=True, text=True, timeout=120, check=True,
                         env={**env, "UCX_TLS": "tcp"}).stdout
    lines = out.splitlines()
    assert "256k 256k" in lines, out
    assert lines[-2] == "1000", out  # the thread's timer slack (ns): its 0.05 ms polls are not 0.1
    assert float(lines[-1]) < 0.3, out
