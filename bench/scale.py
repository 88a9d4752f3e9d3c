"""Scale: the mesh at 10, 100 and 1,000 simulated workers, up to 4,096 streams, on one machine.

Each run starts a whole mesh: nats-server (JetStream, monitoring on), ``mesh gateway --workers G``
(the KV router in each process), ``mesh planner``, the workers as ``mesh worker mock --num-workers``
in at most 8 processes, and a closed-loop load of C streams (``bench/scale_probes.py client``:
token-id prompts, a 64-token system prompt every request shares and 192 tokens of its own, 64
tokens out, every token its own chunk). The simulated step is fixed, ``1000 * C / rate`` ms for any
batch, so the mesh carries ``--token-rate`` tokens a second (default 3,000: what two shared cores
carry beside 1,000 workers' own upkeep) whatever the number of workers, and a row at 1,000
workers does the same work as a row at 10 with the same streams.

Per run, over a window after a warm-up: every component's CPU seconds per second and RSS (from
/proc; the gateway with its processes, the workers summed over theirs); NATS messages and bytes per
second by subject family (a counting subscriber, ``scale_probes.py natscount``; nats-server's own
totals from its monitoring endpoint, /varz, beside them); the router's decision p50/p99 (the
gateway's ``pdmesh_router_decision_seconds``) and KV events indexed per second; TTFT and
inter-token p50/p99 at the client; the machine's load average. CPU per token: a component's CPU
seconds over the tokens the client received. ``--kill``: one more run where a process of 200
workers (of 1,000) is killed mid-load: how long until no decision names its workers, whether every
stream finished with the mocker's exact tokens, and which errors clients saw.

The router's own figures at 1,000 workers with 1M blocks indexed (``router`` in the JSON): the
gateway's ``KvRouter`` in this process, fed as the bus feeds it; decision p50/p99, index bytes per
block, ingest rate.

    python bench/scale.py [--quick] [--workers 10,100,1000] [--streams 512,4096] [--gateway-workers 1]
                          [--token-rate 3000] [--seconds 30] [--kill]

The last line is one JSON object: the figures, the machine, the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mesh.natsserver import EmbeddedNats, free_port

HERE = Path(__file__).resolve().parent
PROBES = HERE / "scale_probes.py"
MAX_PROCESSES = 8
SYSTEM_TOKENS, OWN_TOKENS = 64, 192


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
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        self.procs.setdefault(component, []).append(p)
        return p

    def start(self) -> None:
        s = self.spec
        self.monitor = free_port()
        self.nats = EmbeddedNats(store_dir=str(self.work / "js"), config=f"http_port: {self.monitor}\n").start()
        url = self.nats.url
        mesh = [sys.executable, "-m", "cli"]
        self.port = free_port()
        self.spawn("nats counter", [sys.executable, str(PROBES), "natscount", url, str(self.work / "counts.json")],
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
        per = [s.workers // s.processes + (i < s.workers % s.processes) for i in range(s.processes)]
        for i, n in enumerate(per):
            self.spawn("workers", [*mesh, "worker", "mock", "--nats", url, "--ns", self.ns, "--model",
                                   str(self.model_dir), "--num-workers", str(n), "--worker-id", f"h{i}",
                                   "--device-kv-blocks", str(blocks), "--max-num-seqs", str(seqs),
                                   "--metrics-port", "-1", *[a for t in timing for a in ("--mock-timing", t)]],
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


async def run(spec: Spec, model_dir: Path, vocab: int, keep: bool = False) -> dict:
    work = Path(tempfile.mkdtemp(prefix="pdmesh-scale-"))
    mesh = Mesh(spec, model_dir, work)
    try:
        mesh.start()
        ready_s = await wait_ready(mesh, 120 + spec.workers * 0.2)
        await asyncio.sleep(3.0)  # snapshots and the first load reports
        return await measure(mesh, spec, vocab, ready_s)
    finally:
        mesh.stop()
        if not keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


async def measure(mesh: Mesh, spec: Spec, vocab: int, ready_s: float) -> dict:
    client = await asyncio.create_subprocess_exec(
        sys.executable, str(PROBES), "client", f"http://127.0.0.1:{mesh.port}", mesh.model_dir.name,
        "--streams", str(spec.streams), "--tokens", str(spec.tokens), "--system-tokens", str(SYSTEM_TOKENS),
        "--own-tokens", str(OWN_TOKENS), "--vocab", str(vocab), "--warmup", str(spec.settle_s()),
        "--seconds", str(spec.seconds), "--drain", str(spec.tokens * spec.step_ms / 1000 * 3 + 60),
        stdout=asyncio.subprocess.PIPE, start_new_session=True)
    watch = await KillWatch.open(mesh) if spec.kill_after else None
    first = last = None
    cpu_client = []
    try:
        while True:
            wait = spec.settle_s() + spec.seconds + spec.tokens * spec.step_ms / 1000 * 3 + 180
            line = (await asyncio.wait_for(client.stdout.readline(), wait)).decode()
            if not line:
                raise RuntimeError(f"the load client exited ({await client.wait()})")
            if line.startswith("measure-start"):
                first = snapshot(mesh)
                cpu_client.append(cpu_seconds([client.pid]))
                if watch is not None:
                    watch.arm(spec.kill_after)
            elif line.startswith("measure-end"):
                last = snapshot(mesh)
                cpu_client.append(cpu_seconds([client.pid]))
            elif line.startswith("{"):
                load = json.loads(line)
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            client.kill()
        await client.wait()
        if watch is not None:
            await watch.close()
    row = figures(spec, first, last, load, cpu_client, ready_s)
    if watch is not None:
        row["kill"] = watch.figures()
    return row


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
                "last_decision_to_killed_s": None if k is None or self.last_decision is None
                else round(self.last_decision - k, 2),
                "left_registry_s": None if k is None or self.gone_at is None else round(self.gone_at - k, 2)}

    async def close(self) -> None:
        await self.members.stop()
        await self.bus.close()


# -- the router alone at 1,000 workers ----------------------------------------------------------
def router_at_scale(workers: int, blocks: int):
    """``KvRouter`` as the gateway runs it, fed ``workers`` x ``blocks`` blocks as wire batches: each
    worker a 64-block system prompt all share and conversations of its own. Returns the router,
    the system prompt, each worker's first conversation, and the seconds the batches took to index."""
    import gc

    from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
    from mesh.protocol import KvEvent, KvEventBatch, LoadReport, WorkerCard, decode, encode
    from mesh.registry import Membership
    from mesh.router.policy import RouterConfig
    from mesh.router.router import KvRouter

    class Members(Membership):
        def __init__(self, cards):
            super().__init__(bus=None)
            self._cards = {c.worker_id: c for c in cards}
            self.version = 1

    now = time.time()
    ids = [f"w{i:04d}" for i in range(workers)]
    router = KvRouter(None, Members([WorkerCard(w, "decode", "m", 16, 16384, 1 << 17, "h", 1, now, now)
                                     for w in ids]), RouterConfig())
    router._spawn = lambda coro: coro.close()  # decisions are not published: no bus
    rng = random.Random(0)
    seed = hash_seed(DEFAULT_HASH_KEY, "m")
    system = [rng.randrange(32000) for _ in range(64 * 16)]
    shared = block_hashes(system, 16, seed)
    convs: dict[str, list[int]] = {}
    wire = []
    for w in ids:
        conv = system + [rng.randrange(32000) for _ in range(16 * 60)]
        convs[w] = conv
        own = block_hashes(conv, 16, seed)[64:]
        own += [rng.getrandbits(63) for _ in range(blocks - 64 - len(own))]  # older conversations' blocks
        wire.append(encode(KvEventBatch(w, "m", 1, [KvEvent("stored", shared), KvEvent("stored", own)])))
    idx = router.index("m")
    for w in ids:
        idx.load_snapshot(w, 0, {})
    gc.collect()
    t0 = time.perf_counter()
    for raw in wire:
        assert idx.apply(decode(raw, KvEventBatch))
    ingest = time.perf_counter() - t0
    for w in ids:
        router._heard[w] = time.monotonic()
        router.table.report(w, rng.randrange(0, 2000), 0, time.monotonic())
        router.loads[w] = LoadReport(w, "m", "decode", now)
    return router, system, convs, ingest


def router_figures(workers: int, blocks: int, decisions: int) -> dict:
    """Decisions of ``router_at_scale``'s router on prompts that share the system prompt, half of
    them continuing a worker's conversation; the index's bytes per block; the ingest rate."""
    router, system, convs, ingest = router_at_scale(workers, blocks)
    rng = random.Random(1)
    indexed = workers * blocks
    nbytes = router.index("m").nbytes()
    lat, cpu = [], []  # wall and this thread's CPU: on a shared machine the wall p99 is the scheduler's
    conv_list = list(convs.values())
    for i in range(decisions):
        if i % 2:
            tokens = rng.choice(conv_list)[: 64 * 16 + 16 * rng.randrange(1, 60)] + [7]
        else:
            tokens = system + [rng.randrange(32000) for _ in range(16 * rng.randrange(4, 64))]
        t0, c0 = time.perf_counter(), time.thread_time()
        d = router.route("m", tokens, f"r{i}")
        lat.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        router.finished(d.worker_id, f"r{i}")
    lat.sort()
    cpu.sort()
    return {"workers": workers, "blocks_indexed": indexed, "index_bytes_per_block": round(nbytes / indexed, 1),
            "decision_cpu_p50_ms": round(cpu[len(cpu) // 2] * 1000, 3),
            "decision_cpu_p99_ms": round(cpu[int(len(cpu) * 0.99)] * 1000, 3),
            "ingest_blocks_s": round(indexed / ingest), "decision_p50_ms": round(lat[len(lat) // 2] * 1000, 3),
            "decision_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 3),
            "decision_mean_ms": round(statistics.fmean(lat) * 1000, 3), "load_avg": os.getloadavg()[0]}


# -- the report -------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    head = ("| workers | streams | gw | load (1m) | tok/s | gateway cpu s/s (us/tok) | workers cpu s/s | "
            "nats-server cpu s/s | planner cpu s/s | gateway RSS MB | NATS msg/s | decision p50/p99 ms | "
            "KV events/s | TTFT p50/p99 ms | ITL p50/p99 ms | errors |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c, u = r["cpu_s_per_s"], r["cpu_us_per_token"]
        out.append(
            f"| {r['workers']} | {r['streams']} | {r['gateways']} | {r['load_avg'][0]} | {r['tokens_s']} | "
            f"{c['gateway']} ({u['gateway']}) | {c['workers']} | {c['nats-server']} | {c['planner']} | "
            f"{r['rss_mb'].get('gateway')} | {r['nats_totals_s']['in_msgs']} | "
            f"{r['router_decision_p50_ms']}/{r['router_decision_p99_ms']} | {r['kv_events_indexed_s']} | "
            f"{r['ttft_p50_ms']}/{r['ttft_p99_ms']} | {r['itl_p50_ms']}/{r['itl_p99_ms']} | "
            f"{sum(r['errors'].values())} |")
    return "\n".join(out)


def machine() -> dict:
    commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(), "commit": commit}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a minute: 10 and 40 workers, 64 streams, a 40-worker kill")
    p.add_argument("--workers", default="10,100,1000")
    p.add_argument("--streams", default="512,4096")
    p.add_argument("--gateway-workers", default="1", help="gateway processes per run, e.g. 1,4")
    p.add_argument("--token-rate", type=float, default=3000.0, help="tokens a second the mesh carries")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--kill", action="store_true", help="also the kill run (1,000 workers, 200 per process)")
    p.add_argument("--no-router", action="store_true", help="skip the in-process router figures")
    p.add_argument("--keep", action="store_true", help="keep each run's logs (printed)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the runs' cleanups: no mesh left behind
    model_dir = Path(tempfile.mkdtemp(prefix="pdmesh-scale-model-")) / "tiny"
    subprocess.run([sys.executable, "-m", "cli", "model", "tiny", str(model_dir)], check=True,
                   stdout=subprocess.DEVNULL)  # (bench/engine.py would shadow the engine package here)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if args.quick:
        workers, streams, gws, kill_w, kill_p = [10, 40], [64], [1], 40, 4
        args.warmup, args.seconds = min(args.warmup, 4.0), min(args.seconds, 8.0)
    else:
        workers = [int(x) for x in args.workers.split(",")]
        streams = [int(x) for x in args.streams.split(",")]
        gws = [int(x) for x in args.gateway_workers.split(",")]
        kill_w, kill_p = 1000, 5
    out: dict = {"benchmark": "scale", "machine": machine(), "token_rate": args.token_rate}
    if not args.no_router:
        out["router"] = router_figures(*((100, 1000, 500) if args.quick else (1000, 1000, 5000)))
        print(f"router: {out['router']}", file=sys.stderr, flush=True)
    rows = []
    for w in workers:
        for c in streams:
            for g in gws:
                spec = Spec(w, c, g, min(MAX_PROCESSES, w), max(10.0, round(1000 * c / args.token_rate, 1)),
                            args.tokens, args.warmup, args.seconds)
                row = asyncio.run(run(spec, model_dir, vocab, args.keep))
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    out["runs"] = rows
    if args.kill:
        c = streams[-1]
        spec = Spec(kill_w, c, gws[0], kill_p, max(10.0, round(1000 * c / args.token_rate, 1)), args.tokens,
                    args.warmup, max(args.seconds, 20.0), kill_after=max(args.seconds, 20.0) / 3)
        out["kill"] = asyncio.run(run(spec, model_dir, vocab, args.keep))
        print(json.dumps(out["kill"]), file=sys.stderr, flush=True)
    print(table(rows + ([out["kill"]] if "kill" in out else [])), file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
