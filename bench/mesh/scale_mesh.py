"""The processes of one ``python -m bench scale`` run and what is read from them: the mesh
(``Mesh``: nats-server, gateway, planner, worker processes, the NATS counter), the snapshots at each
end of the window (CPU and RSS from /proc, nats-server's /varz, the counter's counts, the gateway's
/metrics), the figures of one run from two snapshots, and the kill run's watch (``KillWatch``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.registry import ROOT
from mesh.natsserver import EmbeddedNats, free_port

SYSTEM_TOKENS, OWN_TOKENS = 64, 192
PROBES = "bench.mesh.scale_probes"  # the load client and the NATS counter, each a process of its own


@dataclass
class Spec:
    workers: int
    streams: int
    gateways: int
    processes: int
    step_ms: float
    tokens: int = 64
    warmup: float = 10.0
    seconds: float = 30.0
    kill_after: float = 0.0  # --kill: SIGKILL one worker process this long into the window
    step_grid: bool = False  # --step-grid: a process's workers step on one clock (--mock-step-grid-ms)

    def settle_s(self) -> float:
        """Warm-up: the initial burst admitted and a request's time run, so that requests end and
        start through the window as they would for good (a stream's first request has any length)."""
        return max(self.warmup, min(1.2 * self.tokens * self.step_ms / 1000, 120.0))

    @property
    def per_worker_seqs(self) -> int:
        return max(16, 2 * -(-self.streams // self.workers) + 8)


# -- processes ---------------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (f := _stat(int(entry))) is not None:
            parents.setdefault(int(f[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parents.get(pid, ()))
    return out


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    return sum((int(f[11]) + int(f[12])) / tick for p in pids if (f := _stat(p)) is not None)


def rss_mb(pids: list[int]) -> float:
    total = 0
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return round(total / 1024, 1)


@dataclass
class Mesh:
    """The processes of one run, by component; all stopped (their process groups) at the end."""

    spec: Spec
    model_dir: Path
    work: Path
    ns: str = "scale"
    procs: dict[str, list[subprocess.Popen]] = field(default_factory=dict)
    nats: EmbeddedNats | None = None
    monitor: int = 0
    port: int = 0

    def spawn(self, component: str, argv: list[str], log: str) -> subprocess.Popen:
        out = open(self.work / log, "ab")  # noqa: SIM115 (the child writes it; closed at stop)
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        self.procs.setdefault(component, []).append(p)
        return p

    def start(self) -> None:
        s = self.spec
        self.monitor = free_port()
        self.nats = EmbeddedNats(store_dir=str(self.work / "js"), config=f"http_port: {self.monitor}\n").start()
        url = self.nats.url
        mesh = [sys.executable, "-m", "cli"]
        self.port = free_port()
        self.spawn("nats counter", [sys.executable, "-m", PROBES, "natscount", url, str(self.work / "counts.json")],
                   "counter.log")
        self.spawn("gateway", [*mesh, "gateway", "--nats", url, "--ns", self.ns, "--model", str(self.model_dir),
                               "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(s.gateways),
                               "--max-inflight", str(2 * s.streams + 64)], "gateway.log")
        self.spawn("planner", [*mesh, "planner", "--nats", url, "--ns", self.ns, "--min-prefill", "0",
                               "--max-prefill", "0", "--min-decode", "1", "--max-decode", "100000"], "planner.log")
        seqs = s.per_worker_seqs
        blocks = seqs * (-(-(SYSTEM_TOKENS + OWN_TOKENS + s.tokens) // 16) + 1) + 512
        timing = [f"decode_base_ms={s.step_ms}", "decode_ms_per_seq=0", "decode_ms_per_kv_token=0",
                  "prefill_base_ms=0", "prefill_ms_per_token=0.001", "prefill_ms_per_token_ctx=0"]
        grid = ["--mock-step-grid-ms", str(s.step_ms)] if s.step_grid else []
        per = [s.workers // s.processes + (i < s.workers % s.processes) for i in range(s.processes)]
        for i, n in enumerate(per):
            self.spawn("workers", [*mesh, "worker", "mock", "--nats", url, "--ns", self.ns, "--model",
                                   str(self.model_dir), "--num-workers", str(n), "--worker-id", f"h{i}",
                                   "--device-kv-blocks", str(blocks), "--max-num-seqs", str(seqs),
                                   "--metrics-port", "-1", *grid, *[a for t in timing for a in ("--mock-timing", t)]],
                       f"workers-{i}.log")

    def pids(self, component: str) -> list[int]:
        return [pid for p in self.procs.get(component, []) if p.poll() is None for pid in tree(p.pid)]

    def stop(self) -> None:
        for group in self.procs.values():
            for p in group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for group in self.procs.values():
            for p in group:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        if self.nats is not None:
            self.nats.stop()


COMPONENTS = ("gateway", "workers", "planner", "nats-server", "nats counter")


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def metric_lines(text: str, name: str) -> dict[str, float]:
    """``name``'s samples: {labels: value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = out.get(key[len(name):], 0.0) + float(value)
    return out


def histogram_quantile(before: dict[str, float], after: dict[str, float], q: float) -> float | None:
    """From the cumulative ``_bucket`` samples of two scrapes: the q-quantile of what came between,
    interpolated within its bucket (in ms)."""
    buckets = []
    for key, v in after.items():
        if 'le="' not in key:
            continue
        le = key.split('le="', 1)[1].split('"', 1)[0]
        buckets.append((float("inf") if le == "+Inf" else float(le), v - before.get(key, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    want, lo, below = q * total, 0.0, 0.0
    for le, cum in buckets:
        if cum >= want:
            if le == float("inf"):
                return round(lo * 1000, 3)
            share = (want - below) / (cum - below) if cum > below else 1.0
            return round((lo + (le - lo) * share) * 1000, 3)
        lo, below = le, cum
    return None


@dataclass
class Snapshot:
    at: float  # when the CPU, the counts and /varz were read (together, first)
    cpu: dict[str, float]
    varz: dict
    counts: dict
    metrics: str
    metrics_at: float  # the gateway's /metrics comes last, when its loop gets to it
    load: tuple[float, float, float]
    rss: dict[str, float]


def snapshot(mesh: Mesh) -> Snapshot:
    at = time.monotonic()
    cpu = {c: cpu_seconds(mesh.pids(c)) for c in COMPONENTS if c != "nats-server"}
    cpu["nats-server"] = cpu_seconds([mesh.nats.proc.pid])
    counter = mesh.procs["nats counter"][0]
    path = mesh.work / "counts.json"
    before = path.stat().st_mtime_ns if path.exists() else 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(counter.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and (not path.exists() or path.stat().st_mtime_ns == before):
        time.sleep(0.01)
    counts = json.loads(path.read_text()) if path.exists() and path.stat().st_mtime_ns != before else {}
    varz = json.loads(http_get(f"http://127.0.0.1:{mesh.monitor}/varz"))
    try:  # a busy gateway answers late (its loop serves the streams first)
        metrics = http_get(f"http://127.0.0.1:{mesh.port}/metrics", timeout=60.0).decode()
    except OSError as e:
        print(f"scale: the gateway's /metrics did not answer: {e}", file=sys.stderr)
        metrics = ""
    rss = {c: rss_mb(mesh.pids(c)) for c in COMPONENTS if c != "nats-server"}
    rss["nats-server"] = rss_mb([mesh.nats.proc.pid])
    return Snapshot(at, cpu, varz, counts, metrics, time.monotonic(), os.getloadavg(), rss)


async def wait_ready(mesh: Mesh, timeout: float) -> float:
    """Until every worker's card is in the registry and the gateway counts them all live."""
    from mesh.bus import Bus
    from mesh.registry import Membership

    began = time.monotonic()
    bus = await Bus.connect(mesh.nats.url, "scale-bench", ns=mesh.ns)
    members = Membership(bus)
    await members.start(wait=2.0)
    try:
        while time.monotonic() - began < timeout:
            live = len(members.cards(role="decode"))
            try:
                text = http_get(f"http://127.0.0.1:{mesh.port}/metrics").decode()
                seen = sum(metric_lines(text, "pdmesh_gateway_live_workers").values())
            except OSError:
                seen = 0
            if live >= mesh.spec.workers and seen >= mesh.spec.workers:
                return time.monotonic() - began
            for name, group in mesh.procs.items():
                if any(p.poll() is not None for p in group):
                    raise RuntimeError(f"a {name} process exited; see {mesh.work}")
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{live} of {mesh.spec.workers} workers live after {timeout:.0f} s (gateway: {seen})")
    finally:
        await members.stop()
        await bus.close()



def figures(spec: Spec, a: Snapshot, b: Snapshot, load: dict, cpu_client: list[float], ready_s: float) -> dict:
    dt = b.at - a.at
    tokens = load["tokens_s"] * dt
    cpu = {c: round((b.cpu[c] - a.cpu[c]) / dt, 3) for c in b.cpu}
    cpu["client"] = round((cpu_client[1] - cpu_client[0]) / dt, 3)
    per_token_us = {c: round(v * dt / tokens * 1e6, 1) if tokens else None for c, v in cpu.items()}
    fam: dict = {}
    if not a.counts or not b.counts:
        fam = {"(the counter did not answer)": {}}
    else:
        for k, (n, nbytes) in b.counts.get("counts", {}).items():
            n0, b0 = a.counts.get("counts", {}).get(k, (0, 0))
            fam[k] = {"msg_s": round((n - n0) / dt, 1), "bytes_s": round((nbytes - b0) / dt)}
    va, vb = a.varz, b.varz
    nats = {k: round((vb[k] - va[k]) / dt, 1) for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}
    dec_a = metric_lines(a.metrics, "pdmesh_router_decision_seconds_bucket")
    dec_b = metric_lines(b.metrics, "pdmesh_router_decision_seconds_bucket")
    kv = metric_lines(b.metrics, 'pdmesh_router_kv_events_total{unit="hashes"}')
    kv0 = metric_lines(a.metrics, 'pdmesh_router_kv_events_total{unit="hashes"}')
    rss = b.rss
    return {
        "workers": spec.workers, "streams": spec.streams, "gateways": spec.gateways, "processes": spec.processes,
        "step_ms": spec.step_ms, "ready_s": round(ready_s, 1), "seconds": round(dt, 1),
        "load_avg": [round(x, 2) for x in a.load], "load_avg_end": [round(x, 2) for x in b.load],
        "tokens_s": load["tokens_s"], "req_s": load["req_s"],
        "ttft_p50_ms": load["ttft_p50_ms"], "ttft_p99_ms": load["ttft_p99_ms"],
        "itl_p50_ms": load["itl_p50_ms"], "itl_p99_ms": load["itl_p99_ms"],
        "errors": load["errors"], "mismatched": load["mismatched"], "unfinished": load["unfinished"],
        "cpu_s_per_s": cpu, "cpu_us_per_token": per_token_us, "rss_mb": rss,
        "router_decision_p50_ms": histogram_quantile(dec_a, dec_b, 0.5),
        "router_decision_p99_ms": histogram_quantile(dec_a, dec_b, 0.99),
        "kv_events_indexed_s": round((sum(kv.values()) - sum(kv0.values())) / (b.metrics_at - a.metrics_at)
                                     / spec.gateways, 1) if a.metrics and b.metrics else None,
        "nats_totals_s": nats, "nats_by_family_s": fam, "counter_dropped": b.counts.get("closed", False),
        "migrations": sum(metric_lines(b.metrics, "pdmesh_gateway_migrations_total").values())
        - sum(metric_lines(a.metrics, "pdmesh_gateway_migrations_total").values()),  # streams resumed elsewhere
    }


class KillWatch:
    """The kill run: SIGKILL one worker process; follow the routers' decisions and the registry."""

    def __init__(self, mesh: Mesh, bus, members):
        self.mesh, self.bus, self.members = mesh, bus, members
        self.victim = mesh.procs["workers"][0]
        self.prefix = "h0-"
        self.killed_at: float | None = None
        self.last_decision: float | None = None  # the last decision naming a killed worker (monotonic)
        self.gone_at: float | None = None  # when the registry view had none of them left
        self.victims = 0
        self._task = None

    @classmethod
    async def open(cls, mesh: Mesh) -> KillWatch:
        from mesh.bus import Bus
        from mesh.protocol import RouterDecision
        from mesh.registry import Membership

        bus = await Bus.connect(mesh.nats.url, "scale-kill-watch", ns=mesh.ns)
        members = Membership(bus)
        await members.start(wait=2.0)
        watch = cls(mesh, bus, members)

        async def on_decision(d: RouterDecision, raw) -> None:
            if watch.killed_at is not None and d.worker_id.startswith(watch.prefix):
                watch.last_decision = time.monotonic()

        await bus.subscribe(bus.subjects.router_decisions(), on_decision, RouterDecision)
        members.on_change(watch._on_member)
        return watch

    def _on_member(self, worker_id, card) -> None:
        if (card is None and self.killed_at is not None and worker_id.startswith(self.prefix)
                and not any(c.worker_id.startswith(self.prefix) for c in self.members.cards())):
            self.gone_at = time.monotonic()

    def arm(self, after: float) -> None:
        self._task = asyncio.get_running_loop().call_later(after, self._kill)

    def _kill(self) -> None:
        self.victims = sum(1 for c in self.members.cards() if c.worker_id.startswith(self.prefix))
        self.killed_at = time.monotonic()
        os.killpg(self.victim.pid, signal.SIGKILL)

    def figures(self) -> dict:
        k = self.killed_at
        return {"killed_workers": self.victims,
                # 0.0: no decision named one of them after the kill
                "last_decision_to_killed_s": None if k is None else round(max(0.0, (self.last_decision or k) - k), 2),
                "left_registry_s": None if k is None or self.gone_at is None else round(self.gone_at - k, 2)}

    async def close(self) -> None:
        await self.members.stop()
        await self.bus.close()


