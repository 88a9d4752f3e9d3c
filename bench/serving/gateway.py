"""Gateway benchmark: an async load generator against ``mesh up --mock``.

    python -m bench gateway                     # starts mesh up --mock --mock-speedup 100, runs c=32 and c=128
    python -m bench gateway --quick             # shorter runs
    python -m bench gateway --url http://127.0.0.1:8000 --nats nats://127.0.0.1:4222   # an existing mesh
    python -m bench gateway --json out.json
    python -m bench gateway --tracing-modes off,always,0.1   # tracing's cost: off, every request, 10% head sampling

What it measures (definitions):

* each request: ``POST /v1/completions`` with a ~100-token token-id prompt (the mocker has no
  tokenizer), ``max_tokens`` 64, ``ignore_eos``, ``stream`` with ``include_usage``. Prompts are
  random token ids, so no two share a cached prefix;
* the load generator is a minimal HTTP/1.1 client on raw asyncio streams (uvloop): one
  keep-alive connection per concurrent user, chunked SSE parsed by hand. httpx spends more CPU
  per event than the gateway does, and it shares the same 2 cores, so it would measure itself;
* requests/s and output tokens/s: completed requests (and their ``usage.completion_tokens``)
  over the wall time of the run, after a warm-up;
* TTFT: request sent -> first SSE event carrying a token; ITL: the gap between consecutive
  token events of one request (under load the gateway puts every token that has arrived for a
  request into one event, so an event may carry several tokens); p50/p99 over all requests
  (ITL: over all gaps);
* under each load, one extra client sends the same kind of request straight to the worker on
  the bus every 50 ms: its TTFT is what the load costs without the gateway in the path;
* CPU: each process's share of one core during the measured window (from /proc), including
  "other processes" (this machine may be shared: a run that got one core of two measures
  something else than one that got both) and the gateway's CPU milliseconds per request;
* gateway added latency: requests with the same parameters and same-length prompts (fresh ones:
  a repeated prompt would hit the prefix cache) sent (a) straight to the decode worker on its bus
  subject with ``mesh.client.generate`` and (b) through the gateway, interleaved, one request at
  a time (no queueing): TTFT(b) - TTFT(a), p50 of the differences of pairs, plus each
  side's p50. This is what the gateway itself costs a request: HTTP parsing, validation,
  routing, the bus hop into the gateway process, SSE formatting.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.common.sse_client import Connection
from mesh.bus import Bus
from mesh.natsserver import free_port
from mesh.protocol import GenerateRequest, SamplingOptions
from mesh.registry import Membership

BENCHMARK = Benchmark(
    name="gateway",
    measures="requests/s, TTFT and ITL through the gateway under closed-loop load (c=32, 128) against "
             "`mesh up --mock`, the gateway's CPU per request, and the latency it adds over the bus",
    target=">= 200 req/s at c=32, added latency p50 <= 3 ms; tracing at 10% head sampling costs < 5%",
    minutes=1.5,
    smoke=("--dry-run",),
)
PROMPT_TOKENS = 100
OUTPUT_TOKENS = 64
VOCAB = 32000  # the mocker's
TARGET_RPS_C32 = 200.0
TARGET_ADDED_P50_MS = 3.0


# -- one request ------------------------------------------------------------------------------


def prompt_ids(rng: random.Random) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(PROMPT_TOKENS)]


def request_body(model: str, ids: list[int]) -> bytes:
    return json.dumps({
        "model": model, "prompt": ids, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }).encode()


@dataclass
class Result:
    ttft: float
    itls: list[float]
    tokens: int


async def one_request(conn: Connection, model: str, ids: list[int]) -> Result:
    t0 = time.monotonic()
    stamps: list[float] = []
    tokens = 0
    async for t, data in conn.post_sse("/v1/completions", request_body(model, ids)):
        if data == b"[DONE]":
            continue  # read on to the end of the chunked body: the connection is reused
        ev = json.loads(data)
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        if ev.get("choices"):  # completions: every choice event carries a token chunk
            stamps.append(t)
    if not stamps:
        raise RuntimeError("no token events")
    return Result(stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)], tokens)


# -- who used the CPUs ------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mesh_processes(root: int) -> dict[str, int]:
    """The mesh's processes by role (children of ``mesh up``), plus this load generator."""
    out = {"load generator": os.getpid()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != root:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if "gateway" in words:
            out["gateway"] = int(entry)
        elif "worker" in words:
            role = words[words.index("worker") + 1]
            out[f"worker {role} {entry}"] = int(entry)
        elif any(w.endswith("nats-server") for w in words):
            out["nats-server"] = int(entry)
    return out


def _machine_busy_seconds() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds each process used between ``start`` and ``stop``, as a share of one core.

    ``other`` is what the rest of the machine used meanwhile: this box may be shared, and a
    benchmark that got one core of two measures something else than one that got both.
    """

    def __init__(self, procs: dict[str, int]):
        self.procs = procs

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.c0 = {k: _cpu_seconds(p) for k, p in self.procs.items()}
        self.m0 = _machine_busy_seconds()

    def stop(self) -> dict[str, float]:
        dt = time.monotonic() - self.t0
        out = {k: round((_cpu_seconds(p) - self.c0[k]) / dt * 100, 1) for k, p in self.procs.items()}
        machine = (_machine_busy_seconds() - self.m0) / dt * 100
        out["other processes"] = round(max(0.0, machine - sum(out.values())), 1)
        out["idle"] = round(max(0.0, (os.cpu_count() or 1) * 100 - machine), 1)
        return out


# -- load ------------------------------------------------------------------------------------


@dataclass
class LoadFigures:
    concurrency: int
    requests: int
    errors: int
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    cpu_percent: dict[str, float] = field(default_factory=dict)  # per process, 100 = one core
    direct_ttft_p50_ms: float = float("nan")  # the same load, a request sent straight to the worker
    direct_probes: int = 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


async def run_load(url: str, model: str, concurrency: int, seconds: float, warmup: float,
                   meter: CpuMeter | None = None, probe: tuple[Bus, str] | None = None) -> LoadFigures:
    u = urlsplit(url)
    rng = random.Random(concurrency)
    results: list[Result] = []
    errors = 0
    t_start = time.monotonic()
    t_measure = t_start + warmup
    t_end = t_measure + seconds
    done_at: list[float] = []

    async def user(i: int) -> None:
        nonlocal errors
        conn = Connection(u.hostname, u.port)
        try:
            while time.monotonic() < t_end:
                sent = time.monotonic()
                try:
                    r = await one_request(conn, model, prompt_ids(rng))
                except Exception as e:  # count it, reconnect, go on
                    errors += 1
                    if errors <= 3:
                        print(f"  request error: {e}", file=sys.stderr)
                    await conn.close()
                    conn = Connection(u.hostname, u.port)
                    continue
                now = time.monotonic()
                if sent >= t_measure and now <= t_end:
                    results.append(r)
                    done_at.append(now)
        finally:
            await conn.close()

    async def measure_cpu() -> dict[str, float]:
        if meter is None:
            return {}
        await asyncio.sleep(max(0.0, t_measure - time.monotonic()))
        meter.start()
        await asyncio.sleep(max(0.0, t_end - time.monotonic()))
        return meter.stop()

    direct: list[float] = []

    async def direct_probe() -> None:
        """The same request straight to the worker now and then, to see what the load costs without us."""
        if probe is None:
            return
        prng = random.Random(-concurrency)
        await asyncio.sleep(max(0.0, t_measure - time.monotonic()))
        while time.monotonic() < t_end - 0.5:
            direct.append(await direct_ttft(*probe, model, prompt_ids(prng)) * 1000)
            await asyncio.sleep(0.05)

    *_, cpu = await asyncio.gather(*(user(i) for i in range(concurrency)), direct_probe(), measure_cpu())
    elapsed = seconds
    ttfts = [r.ttft * 1000 for r in results]
    itls = [x * 1000 for r in results for x in r.itls]
    return LoadFigures(
        concurrency=concurrency, requests=len(results), errors=errors, seconds=round(elapsed, 2),
        requests_per_s=len(results) / elapsed,
        output_tokens_per_s=sum(r.tokens for r in results) / elapsed,
        ttft_p50_ms=pct(ttfts, 50), ttft_p99_ms=pct(ttfts, 99),
        itl_p50_ms=pct(itls, 50), itl_p99_ms=pct(itls, 99), cpu_percent=cpu,
        direct_ttft_p50_ms=pct(direct, 50), direct_probes=len(direct),
    )


# -- gateway added latency ------------------------------------------------------------------


@dataclass
class AddedLatency:
    pairs: int
    direct_ttft_p50_ms: float
    gateway_ttft_p50_ms: float
    added_p50_ms: float
    added_p90_ms: float
    diffs_ms: list[float] = field(default_factory=list, repr=False)


async def direct_ttft(bus: Bus, worker_id: str, model: str, ids: list[int]) -> float:
    from mesh import client

    req = GenerateRequest(f"bench-{uuid.uuid4().hex}", model, ids,
                          SamplingOptions(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True),
                          0, time.time())
    t0 = time.monotonic()
    first = None
    async for chunk in client.generate(bus, worker_id, req, 30.0, 30.0):
        if first is None and chunk.token_ids:
            first = time.monotonic() - t0
    return first


async def gateway_ttft(conn: Connection, model: str, ids: list[int]) -> float:
    return (await one_request(conn, model, ids)).ttft


async def added_latency(url: str, nats_url: str, model: str, pairs: int) -> AddedLatency:
    u = urlsplit(url)
    bus = await Bus.connect(nats_url, "bench-gateway")
    membership = Membership(bus)
    await membership.start(wait=2.0)
    try:
        cards = [c for c in membership.cards(model, "decode") if c.status == "ready"]
        if len(cards) != 1:
            raise RuntimeError(f"expected one decode worker for {model}, found {len(cards)}")
        worker = cards[0].worker_id
        conn = Connection(u.hostname, u.port)
        rng = random.Random(7)
        direct, via, diffs = [], [], []
        for i in range(pairs + 10):
            ids = prompt_ids(rng)
            # the same prompt twice would hit the prefix cache on the second run: use two
            # prompts of the same length, and alternate which path goes first
            ids2 = prompt_ids(rng)
            if i % 2:
                d = await direct_ttft(bus, worker, model, ids)
                g = await gateway_ttft(conn, model, ids2)
            else:
                g = await gateway_ttft(conn, model, ids2)
                d = await direct_ttft(bus, worker, model, ids)
            if i >= 10:  # warm-up
                direct.append(d * 1000)
                via.append(g * 1000)
                diffs.append((g - d) * 1000)
        await conn.close()
    finally:
        await membership.stop()
        await bus.close()
    return AddedLatency(pairs, statistics.median(direct), statistics.median(via), statistics.median(diffs),
                        pct(diffs, 90), diffs)


# -- the mesh ------------------------------------------------------------------------------


class OtlpSink:
    """An OTLP/HTTP trace receiver that accepts and counts exports: tracing on, with a real exporter."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sink = self
        self.requests = 0
        self.bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.requests += 1
                sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        import threading

        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.server.server_address[1]}"}


class MeshUp:
    """``mesh up --mock`` as a child process; its NATS URL parsed from the banner."""

    def __init__(self, port: int, speedup: float, decode: int, env: dict | None = None):
        self.root_pid = 0
        self.env = {**os.environ, **(env or {})}
        self.port = port
        self.argv = [sys.executable, "-m", "cli", "up", "--mock", "--mock-speedup", str(speedup),
                     "--prefill", "0", "--decode", str(decode), "--port", str(port)]
        self.proc: subprocess.Popen | None = None
        self.nats_url = ""

    def __enter__(self) -> MeshUp:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True, start_new_session=True,
                                     env=self.env)
        self.root_pid = self.proc.pid
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("mesh up exited before it was up")
            m = re.search(r"NATS (nats://[^;)\s]+)", line)
            if m:
                self.nats_url = m.group(1)
                return self
        raise RuntimeError("mesh up did not come up")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


async def bench(args) -> dict:
    url = args.url
    loads = []
    meter = CpuMeter(mesh_processes(args.root_pid)) if args.root_pid else None
    bus = await Bus.connect(args.nats, "bench-probe")
    membership = Membership(bus)
    await membership.start(wait=2.0)
    workers = [c.worker_id for c in membership.cards(args.model, "decode") if c.status == "ready"]
    probe = (bus, workers[0]) if len(workers) == 1 else None
    for c in args.concurrency:
        fig = await run_load(url, args.model, c, args.seconds, args.warmup, meter, probe)
        loads.append(fig)
        print(f"c={c:<4} {fig.requests_per_s:8.1f} req/s {fig.output_tokens_per_s:9.0f} out tok/s   "
              f"TTFT p50 {fig.ttft_p50_ms:7.2f} p99 {fig.ttft_p99_ms:7.2f} ms   "
              f"ITL p50 {fig.itl_p50_ms:6.2f} p99 {fig.itl_p99_ms:7.2f} ms   "
              f"({fig.requests} requests, {fig.errors} errors, {fig.seconds:.0f}s)", flush=True)
        if fig.direct_probes:
            print(f"       under this load, TTFT straight from the worker (bus, no gateway): "
                  f"p50 {fig.direct_ttft_p50_ms:.2f} ms ({fig.direct_probes} probes)", flush=True)
        if fig.cpu_percent:
            per_request = fig.cpu_percent.get("gateway", 0) / 100 / max(fig.requests_per_s, 1e-9) * 1000
            print("       CPU (% of one core): " + ", ".join(f"{k} {v:.0f}" for k, v in fig.cpu_percent.items())
                  + f"; the gateway spends {per_request:.2f} ms of CPU per request", flush=True)
    await membership.stop()
    await bus.close()
    added = await added_latency(url, args.nats, args.model, args.pairs)
    print(f"added latency (gateway TTFT - direct bus TTFT, {added.pairs} interleaved pairs, one at a time): "
          f"p50 {added.added_p50_ms:.2f} ms, p90 {added.added_p90_ms:.2f} ms "
          f"(direct TTFT p50 {added.direct_ttft_p50_ms:.2f} ms, via gateway {added.gateway_ttft_p50_ms:.2f} ms)")
    out = figures(loads, added)
    verdict = out["targets"]
    print(f"targets: >= {TARGET_RPS_C32:.0f} req/s at c=32: "
          f"{'met' if verdict['rps_c32_met'] else 'NOT met'}; added latency p50 <= {TARGET_ADDED_P50_MS} ms: "
          f"{'met' if verdict['added_p50_met'] else 'NOT met'}")
    return out


def figures(loads: list[LoadFigures], added: AddedLatency | None) -> dict:
    """Each load's figures, the added latency, and the targets met or not."""
    c32 = next((f for f in loads if f.concurrency == 32), None)
    verdict = {
        "rps_c32_target": TARGET_RPS_C32,
        "rps_c32_met": bool(c32 and c32.requests_per_s >= TARGET_RPS_C32),
        "added_p50_target_ms": TARGET_ADDED_P50_MS,
        "added_p50_met": bool(added and added.added_p50_ms <= TARGET_ADDED_P50_MS),
    }
    return {"load": [asdict(f) for f in loads],
            "added_latency": added and {k: v for k, v in asdict(added).items() if k != "diffs_ms"},
            "targets": verdict}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--url", default=None, help="an existing gateway (default: start mesh up --mock)")
    p.add_argument("--nats", default=None, help="the existing mesh's NATS URL (with --url)")
    p.add_argument("--model", default="mock")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per concurrency")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--pairs", type=int, default=200, help="requests per side for the added latency")
    p.add_argument("--mock-speedup", type=float, default=100.0)
    p.add_argument("--decode", type=int, default=1, help="mocker decode workers")
    p.add_argument("--quick", action="store_true", help="5 s per concurrency, 60 pairs")
    p.add_argument("--tracing", action="store_true",
                   help="run the mesh with OpenTelemetry tracing on (OTLP/HTTP to a local sink)")
    p.add_argument("--tracing-modes", default=None,
                   help="run the whole bench once per mode, in this order, and compare: comma-separated "
                        "off, always (every request traced) or a head-sampling ratio such as 0.1 "
                        "(OTEL_TRACES_SAMPLER=parentbased_traceidratio), e.g. off,always,0.1")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.quick:
        args.seconds, args.warmup, args.pairs = 5.0, 1.0, 60
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(f"gateway bench: {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} streamed output tokens, "
          f"{os.cpu_count()} CPUs (load generator on the same machine)", flush=True)
    if args.url and not args.nats:
        p.error("--url needs --nats")
    if args.dry_run:
        modes = [m.strip() for m in args.tracing_modes.split(",")] if args.tracing_modes else [None]
        for mode in modes:
            argv = MeshUp(0, args.mock_speedup, args.decode).argv
            print(f"DRY RUN: tracing {mode or ('on' if args.tracing else 'off')}: "
                  f"{'against ' + args.url if args.url else ' '.join(argv[1:])}; concurrency "
                  f"{args.concurrency}, {args.seconds:g} s each after {args.warmup:g} s; {args.pairs} latency pairs")
        out = figures([], None)
        return emit(BENCHMARK, {m: out for m in modes} if args.tracing_modes else out, args)
    if args.tracing_modes:
        return emit(BENCHMARK, _compare_tracing(args), args)
    if args.url:
        args.root_pid = 0
        out = asyncio.run(bench(args))
    else:
        out = _own_mesh(args, args.tracing)
    return emit(BENCHMARK, out, args)


def _own_mesh(args, tracing: bool, sampling: float | None = None) -> dict:
    port = free_port()
    sink = OtlpSink() if tracing else None
    env = dict(sink.env) if sink else None
    if sink and sampling is not None:
        env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG=str(sampling))
    with MeshUp(port, args.mock_speedup, args.decode, env) as mesh:
        if sink:
            print(f"tracing on: every process exports spans over OTLP/HTTP to {sink.env['OTEL_EXPORTER_OTLP_ENDPOINT']}")
        print(f"mesh up --mock --mock-speedup {args.mock_speedup:g} --prefill 0 --decode {args.decode} "
              f"(gateway :{port}, {mesh.nats_url})", flush=True)
        args.url, args.nats, args.root_pid = f"http://127.0.0.1:{port}", mesh.nats_url, mesh.root_pid
        out = asyncio.run(bench(args))
    if sink:
        print(f"the OTLP sink received {sink.requests} exports, {sink.bytes / 1e6:.1f} MB")
        out["otlp_exports"], out["otlp_mb"] = sink.requests, sink.bytes / 1e6
    return out


def _compare_tracing(args) -> dict:
    """The same bench once per tracing mode (fresh mesh each), then one table."""
    results = {}
    for mode in args.tracing_modes.split(","):
        mode = mode.strip()
        print(f"\n=== tracing {mode}", flush=True)
        if mode == "off":
            results[mode] = _own_mesh(args, False)
        elif mode == "always":
            results[mode] = _own_mesh(args, True)
        else:
            results[mode] = _own_mesh(args, True, float(mode))
    print("\ntracing      " + "".join(f"c={f['concurrency']:<4} req/s  gw ms CPU/req  " for f in results[next(iter(results))]["load"])
          + "added p50 ms")
    for mode, out in results.items():
        cells = ""
        for f in out["load"]:
            cpu = f["cpu_percent"].get("gateway", 0) / 100 / max(f["requests_per_s"], 1e-9) * 1000
            cells += f"{f['requests_per_s']:12.1f} {cpu:14.2f}  "
        print(f"{mode:<12} {cells}{out['added_latency']['added_p50_ms']:10.2f}")
    return results
