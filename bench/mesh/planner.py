"""Planner benchmark: a three-phase load against ``mesh up --mock`` with the planner on.

    python -m bench planner                    # 3 x 60 s phases, ~4 min
    python -m bench planner --quick            # 3 x 30 s phases (a smoke run: the pools barely settle)
    python -m bench planner --fixed 3,3        # the same load on fixed pools (--no-planner), for comparison
    python -m bench planner --phases gen:40:12:32:100 --fixed 1,3 --router round-robin   # a probe

What it does and measures (definitions):

* the mesh: ``mesh up --mock`` with 1 prefill and 1 decode worker to start, the planner on
  (``--ttft-ms``/``--itl-ms`` targets, ``--planner-window``, pool bounds), the mocker's timing
  model slowed down (``--mock-speedup`` < 1) so that a moderate request rate, which this
  2-core machine can generate, route and stream, makes real work for the pools;
* the load: open-loop Poisson arrivals, phase by phase: prompt-heavy (long prompts, 2 output
  tokens: prefill work), generation-heavy (short prompts, below ``--disagg-threshold`` so the
  decode workers prefill them, and long outputs: many concurrent sequences), idle (a trickle of
  short requests, so that latency is still measured while the pools shrink). Prompts are random
  token ids (no shared prefixes); requests stream (``return_token_ids`` tells how many tokens
  each SSE event carries) over a minimal keep-alive HTTP/1.1 client on raw asyncio streams
  (httpx costs more CPU per event than the gateway, on the same 2 cores);
* TTFT: request sent -> first token event; ITL: the gap between token events of a request,
  divided among the tokens of the later event (what the workers report too);
* windows of ``--window`` seconds (default: the planner window) from the start of the load.
  Per window: offered load (arrivals/s, their prompt tokens/s and requested output tokens/s),
  ready replicas per pool (registry cards with status "ready", sampled every 0.25 s, averaged),
  the planner's decisions (from ``planner.decisions``), TTFT p90 over the requests whose first
  token came in the window, ITL p90 over the token gaps that ended in the window;
* steady windows: those that start at least ``--settle`` seconds after their phase began and end
  by the phase's end; a steady window meets the SLA when TTFT p90 <= target and ITL p90 <= target
  (a window without any sample of a metric does not fail on it);
* replica-seconds: the integral over the load's duration of ready prefill + ready decode
  replicas (workers starting up or draining are not counted; "+draining" counts those draining
  too). The fixed peak allocation: (the most ready prefill replicas at any time + the most ready
  decode replicas at any time) x the duration -- fixed pools big enough for both phases' peaks.
  ``--fixed P,D`` runs the same load on such fixed pools to show what that allocation delivers.

This machine is shared: the run records what share of the cores the mesh and this load generator
used and what other processes did (from /proc), CPU by process role per phase, and how late this
process's event loop woke up (its lag inflates the latencies it measures). For diagnosis the JSON
also holds every load report and, per window, how long requests took to be routed (the router's
``router.decisions``) and from routing to their first token.

Results: a table per phase and the replica-seconds ratio on stdout, JSON under
``bench/out/planner/``, the timeline as ``docs/img/planner_timeline.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.common.registry import ROOT
from bench.common.sse_client import Connection
from mesh.bus import Bus
from mesh.loads import subscribe_loads
from mesh.natsserver import free_port
from mesh.protocol import LoadReport, PlannerDecision, RouterDecision
from mesh.registry import Membership

BENCHMARK = Benchmark(
    name="planner",
    measures="the planner against a three-phase load (prompt-heavy, generation-heavy, idle) on `mesh up --mock`: "
             "the share of steady windows that meet the TTFT/ITL SLA, and replica-seconds against a fixed peak",
    target="SLA met in >= 90% of steady windows with <= 70% of the peak allocation's replica-seconds",
    minutes=4,
    smoke=("--dry-run",),
)
VOCAB = 32000  # the mocker's
POOLS = ("prefill", "decode")
TARGET_SLA_SHARE = 0.90
TARGET_REPLICA_SECONDS_RATIO = 0.70


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate: float  # requests/s (Poisson arrivals)
    prompt_tokens: int
    output_tokens: int


def phases(quick: bool, spec: str | None = None) -> list[Phase]:
    """The default three phases, or ``name:seconds:rate:prompt_tokens:output_tokens,...``."""
    if spec:
        return [Phase(n, float(sec), float(rate), int(pt), int(ot))
                for n, sec, rate, pt, ot in (p.split(":") for p in spec.split(","))]
    s = 30.0 if quick else 60.0
    return [
        Phase("prompt-heavy", s, 3.5, 1024, 2),
        Phase("generation-heavy", s, 12.0, 32, 100),
        Phase("idle", s, 1.0, 32, 8),
    ]


def tokens_in(event: bytes) -> int:
    """How many tokens an SSE completion event carries (its ``token_ids`` list)."""
    i = event.find(b'"token_ids":[')
    if i < 0:
        return 0
    j = event.find(b"]", i)
    inner = event[i + 13:j]
    return inner.count(b",") + 1 if inner.strip() else 0


# -- the load -------------------------------------------------------------------------------


@dataclass
class Request:
    phase: int
    sent: float  # seconds since the load began
    prompt_tokens: int
    output_tokens: int
    first: float | None = None  # time of the first token
    done: float | None = None
    tokens: int = 0
    gaps: list[tuple[float, float, int]] = field(default_factory=list)  # (time, gap per token, tokens)
    error: str = ""
    rid: str = ""  # the gateway's request id (from the first event)


class LoadGenerator:
    def __init__(self, url: str, model: str, t0: float, max_in_flight: int = 600):
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.host, self.port, self.model, self.t0 = host, int(port), model, t0
        self.idle: list[Connection] = []
        self.requests: list[Request] = []
        self.in_flight = 0
        self.max_in_flight = max_in_flight
        self.shed = 0  # arrivals not sent because max_in_flight were outstanding
        self.tasks: set[asyncio.Task] = set()

    async def run(self, plan: list[Phase], seed: int = 1) -> None:
        rng = random.Random(seed)
        start = 0.0
        for i, ph in enumerate(plan):
            t = start + rng.expovariate(ph.rate)
            while t < start + ph.seconds:
                await asyncio.sleep(max(0.0, self.t0 + t - time.monotonic()))
                if self.in_flight >= self.max_in_flight:
                    self.shed += 1
                else:
                    req = Request(i, t, ph.prompt_tokens, ph.output_tokens)
                    ids = [rng.randrange(10, VOCAB) for _ in range(ph.prompt_tokens)]
                    task = asyncio.create_task(self._one(req, ids))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                t += rng.expovariate(ph.rate)
            start += ph.seconds
        await asyncio.sleep(max(0.0, self.t0 + start - time.monotonic()))

    async def finish(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
        for t in list(self.tasks):
            t.cancel()
        for c in self.idle:
            await c.close()

    async def _one(self, req: Request, ids: list[int]) -> None:
        self.requests.append(req)
        self.in_flight += 1
        conn = self.idle.pop() if self.idle else Connection(self.host, self.port)
        body = json.dumps({"model": self.model, "prompt": ids, "max_tokens": req.output_tokens,
                           "ignore_eos": True, "stream": True, "return_token_ids": True}).encode()
        last = None
        try:
            async for now, data in conn.post_sse("/v1/completions", body):
                n = tokens_in(data)
                if not n:
                    continue
                rel = now - self.t0
                if last is None:
                    req.first = rel  # more tokens in the first event: their gaps are unknown
                    i = data.find(b'"id":"')
                    req.rid = data[i + 6:data.find(b'"', i + 6)].decode() if i >= 0 else ""
                else:
                    req.gaps.append((rel, (now - last) / n, n))
                req.tokens += n
                last = now
            req.done = time.monotonic() - self.t0
            self.idle.append(conn)
        except Exception as e:  # recorded: every failure is reported
            req.error = f"{type(e).__name__}: {e}"[:200]
            await conn.close()
        finally:
            self.in_flight -= 1


# -- what the mesh did -----------------------------------------------------------------------


class MeshWatcher:
    """Ready/draining replicas per pool (sampled), the planner's decisions, workers' load reports."""

    def __init__(self, bus: Bus, membership: Membership, t0_wall: float, t0: float):
        self.bus, self.membership = bus, membership
        self.t0_wall, self.t0 = t0_wall, t0
        self.samples: list[tuple[float, int, int, int, int]] = []  # (t, prefill, decode, draining p, d)
        self.decisions: list[dict] = []
        self.role_cpu: dict[str, list[tuple[float, float]]] = {}  # role -> (t, CPU seconds in the last second)
        self._roles: dict[int, str] = {}
        self.lag: list[tuple[float, float]] = []  # (t, how late this process's event loop woke up)
        self.routed: dict[str, float] = {}  # gateway request id -> when the router decided (diagnosis)
        self.reports: list[dict] = []  # what the workers told the planner
        self.cpu: list[tuple[float, float, float]] = []  # (t, machine busy, mesh + bench busy): shares of all cores

    @classmethod
    async def open(cls, nats_url: str, t0_wall: float, t0: float) -> MeshWatcher:
        bus = await Bus.connect(nats_url, "bench-planner")
        membership = Membership(bus)
        await membership.start(wait=1.0)
        w = cls(bus, membership, t0_wall, t0)
        await bus.subscribe(bus.subjects.planner_decisions(), w._on_decision, PlannerDecision)
        await subscribe_loads(bus, w._on_load)
        await bus.subscribe(bus.subjects.router_decisions(), w._on_route, RouterDecision)
        return w

    async def _on_route(self, d: RouterDecision, raw) -> None:
        self.routed[d.request_id.rsplit("-", 1)[0]] = d.timestamp - self.t0_wall

    async def _on_decision(self, d: PlannerDecision, raw) -> None:
        self.decisions.append({"t": d.timestamp - self.t0_wall, "pool": d.pool, "current": d.current,
                               "target": d.target, "reason": d.reason, "demand": d.demand,
                               "capacity": d.capacity, "latency_ms": d.latency_ms})

    async def _on_load(self, r: LoadReport, raw) -> None:
        self.reports.append({
            "t": round(r.timestamp - self.t0_wall, 2), "worker": r.worker_id, "role": r.role,
            "running": r.running, "waiting": r.waiting, "waiting_for_kv": r.waiting_for_kv,
            "active_jobs": r.active_jobs, "ttft_p90_ms": round(r.ttft_p90_ms, 1), "itl_p90_ms": round(r.itl_p90_ms, 1),
            "prefill_tokens": r.counters.get("prefill_tokens", 0),
            "local_prefill_tokens": r.counters.get("local_prefill_tokens", 0),
            "decode_tokens": r.counters.get("decode_tokens", 0)})

    def counts(self) -> tuple[int, int, int, int]:
        out = []
        for status in ("ready", "draining"):
            for role in POOLS:
                out.append(sum(1 for c in self.membership.cards(role=role) if c.status == status))
        return tuple(out)

    async def sample(self, root: int, every: float = 0.25) -> None:
        prev = await asyncio.to_thread(_cpu_times, root)
        next_cpu = time.monotonic() + 1.0
        while True:
            self.samples.append((time.monotonic() - self.t0, *self.counts()))
            if time.monotonic() >= next_cpu:
                now = await asyncio.to_thread(_cpu_times, root)
                busy, total = now[0] - prev[0], now[1] - prev[1]
                # a process that started since: all its time is new; one that exited: its last second is lost
                ours = sum(v - prev[2].get(pid, 0.0) for pid, v in now[2].items())
                t = time.monotonic() - self.t0
                for pid, v in now[2].items():
                    role = self._roles.get(pid) or self._roles.setdefault(pid, _role(pid, root))
                    self.role_cpu.setdefault(role, []).append((t, v - prev[2].get(pid, 0.0)))
                if total > 0:  # shares of all cores: the machine's, and the mesh's + this load generator's
                    self.cpu.append((time.monotonic() - self.t0, busy / total, min(busy, ours) / total))
                prev, next_cpu = now, next_cpu + 1.0
            before = time.monotonic()
            await asyncio.sleep(every)
            self.lag.append((before - self.t0, time.monotonic() - before - every))

    async def close(self) -> None:
        await self.membership.stop()
        await self.bus.close()


def _role(pid: int, root: int) -> str:
    if pid == os.getpid():
        return "load generator"
    if pid == root:
        return "mesh up (planner)"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "other"
    if "gateway" in words:
        return "gateway"
    if "worker" in words:
        return "decode workers" if words[words.index("worker") + 1] in ("decode", "mock") else "prefill workers"
    return "nats-server" if any("nats-server" in w for w in words) else "other"


def _cpu_times(root: int) -> tuple[float, float, dict[int, float]]:
    """The machine's busy and total CPU seconds (all cores), and those of ``root``, its descendants
    and this process, by pid."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    ours, todo = {}, [root, os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in ours:
            ours[pid] = stats[pid][1]
            todo.extend(children.get(pid, []))
    return (sum(v) - v[3] - v[4]) / tick, sum(v) / tick, ours


# -- numbers -------------------------------------------------------------------------------


def p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def weighted_p90(pairs: list[tuple[float, int]]) -> float | None:
    """p90 of values each counted ``n`` times."""
    if not pairs:
        return None
    pairs = sorted(pairs)
    total = sum(n for _, n in pairs)
    k = int(0.9 * total)
    seen = 0
    for v, n in pairs:
        seen += n
        if seen > k:
            return v
    return pairs[-1][0]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def integrate(samples: list[tuple], column: int, end: float) -> float:
    """Integral of a sampled step function over [0, end]."""
    total = 0.0
    for a, b in zip(samples, [*samples[1:], None], strict=False):
        lo = max(0.0, a[0])
        hi = min(end, b[0] if b else end)
        if hi > lo:
            total += a[column] * (hi - lo)
    return total


def windows(plan: list[Phase], reqs: list[Request], watch: MeshWatcher, width: float, settle: float,
            ttft_ms: float, itl_ms: float) -> list[dict]:
    starts = [sum(p.seconds for p in plan[:i]) for i in range(len(plan))]
    end = sum(p.seconds for p in plan)
    out = []
    for k in range(math.ceil(end / width - 1e-9)):
        lo, hi = k * width, min(end, (k + 1) * width)
        ph = max(i for i, s in enumerate(starts) if s <= lo)
        arrived = [r for r in reqs if lo <= r.sent < hi]
        ttft = [(r.first - r.sent) * 1000 for r in reqs if r.first is not None and lo <= r.first < hi]
        itl = [(g * 1000, n) for r in reqs for (t, g, n) in r.gaps if lo <= t < hi]
        reps = [s for s in watch.samples if lo <= s[0] < hi]
        cpu = [c for c in watch.cpu if lo <= c[0] < hi]
        w = {
            "t0": lo, "t1": hi, "phase": plan[ph].name,
            "steady": lo >= starts[ph] + settle and hi <= starts[ph] + plan[ph].seconds + 1e-9,
            "req_per_s": len(arrived) / (hi - lo),
            "prompt_tok_per_s": sum(r.prompt_tokens for r in arrived) / (hi - lo),
            "output_tok_per_s": sum(r.output_tokens for r in arrived) / (hi - lo),
            "delivered_tok_per_s": sum(n for r in reqs for (t, _, n) in r.gaps if lo <= t < hi) / (hi - lo),
            "prefill": _mean([s[1] for s in reps]), "decode": _mean([s[2] for s in reps]),
            "ttft_p90_ms": p90(ttft), "itl_p90_ms": weighted_p90(itl), "ttft_n": len(ttft),
            "errors": sum(1 for r in arrived if r.error),
            # where a first token's time went: sent -> routed (the gateway took the request), routed -> token
            "to_route_p90_ms": p90([(watch.routed[r.rid] - r.sent) * 1000 for r in reqs
                                    if r.first is not None and lo <= r.first < hi and r.rid in watch.routed]),
            "route_to_token_p90_ms": p90([(r.first - watch.routed[r.rid]) * 1000 for r in reqs
                                          if r.first is not None and lo <= r.first < hi and r.rid in watch.routed]),
            "cpu_busy": _mean([c[1] for c in cpu]) if cpu else None,
            "cpu_mesh": _mean([c[2] for c in cpu]) if cpu else None,
            "client_lag_max_ms": 1000 * max((x for t, x in watch.lag if lo <= t < hi), default=0.0),
            "decisions": [f"{d['pool']} {d['current']}->{d['target']}" for d in watch.decisions
                          if lo <= d["t"] < hi and d["target"] != d["current"]],
        }
        w["sla_met"] = ((w["ttft_p90_ms"] is None or w["ttft_p90_ms"] <= ttft_ms)
                        and (w["itl_p90_ms"] is None or w["itl_p90_ms"] <= itl_ms))
        out.append(w)
    return out


def summarize(plan: list[Phase], reqs: list[Request], wins: list[dict], watch: MeshWatcher) -> dict:
    end = sum(p.seconds for p in plan)
    starts = [sum(p.seconds for p in plan[:i]) for i in range(len(plan))]
    per_phase = []
    for i, ph in enumerate(plan):
        mine = [r for r in reqs if r.phase == i]
        steady = [w for w in wins if w["phase"] == ph.name and w["steady"]]
        reps = [s for s in watch.samples if starts[i] <= s[0] < starts[i] + ph.seconds]
        per_phase.append({
            "phase": ph.name, "seconds": ph.seconds, "rate": ph.rate, "prompt_tokens": ph.prompt_tokens,
            "output_tokens": ph.output_tokens, "requests": len(mine), "errors": sum(1 for r in mine if r.error),
            "ttft_p90_ms": p90([(r.first - r.sent) * 1000 for r in mine if r.first is not None]),
            "itl_p90_ms": weighted_p90([(g * 1000, n) for r in mine for (_, g, n) in r.gaps]),
            "steady_ttft_p90_ms": p90([(r.first - r.sent) * 1000 for r in mine if r.first is not None
                                       and any(w["t0"] <= r.first < w["t1"] for w in steady)]),
            "steady_itl_p90_ms": weighted_p90([(g * 1000, n) for r in mine for (t, g, n) in r.gaps
                                               if any(w["t0"] <= t < w["t1"] for w in steady)]),
            "mean_prefill": sum(s[1] for s in reps) / max(1, len(reps)),
            "mean_decode": sum(s[2] for s in reps) / max(1, len(reps)),
            "steady_windows": len(steady), "steady_met": sum(1 for w in steady if w["sla_met"]),
            "cpu_cores": {  # CPU seconds per second of the phase, by process role
                role: round(sum(v for t, v in xs if starts[i] <= t < starts[i] + ph.seconds) / ph.seconds, 3)
                for role, xs in sorted(watch.role_cpu.items())},
            "cpu_machine_cores": (os.cpu_count() or 1) * _mean(
                [c[1] for c in watch.cpu if starts[i] <= c[0] < starts[i] + ph.seconds]),
        })
    ready = integrate(watch.samples, 1, end) + integrate(watch.samples, 2, end)
    draining = integrate(watch.samples, 3, end) + integrate(watch.samples, 4, end)
    in_run = [s for s in watch.samples if 0 <= s[0] < end] or [(0, 0, 0, 0, 0)]
    peak_p, peak_d = max(s[1] for s in in_run), max(s[2] for s in in_run)
    steady = [w for w in wins if w["steady"]]
    return {
        "phases": per_phase,
        "steady_windows": len(steady), "steady_met": sum(1 for w in steady if w["sla_met"]),
        "sla_share": sum(1 for w in steady if w["sla_met"]) / max(1, len(steady)),
        "replica_seconds": ready, "replica_seconds_with_draining": ready + draining,
        "peak_prefill": peak_p, "peak_decode": peak_d, "fixed_peak_replica_seconds": (peak_p + peak_d) * end,
        "ratio": ready / ((peak_p + peak_d) * end) if peak_p + peak_d else float("nan"),
        "ratio_with_draining": (ready + draining) / ((peak_p + peak_d) * end) if peak_p + peak_d else float("nan"),
        "cpu_busy": _mean([c[1] for c in watch.cpu]), "cpu_mesh": _mean([c[2] for c in watch.cpu]),
        "requests": len(reqs), "errors": sum(1 for r in reqs if r.error),
        "unfinished": sum(1 for r in reqs if r.done is None and not r.error),
    }


# -- output ----------------------------------------------------------------------------------


def fmt(v, nd: int = 0) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}"


def report(args, plan: list[Phase], wins: list[dict], s: dict, decisions: list[dict]) -> str:
    lines = [f"planner bench: targets TTFT p90 <= {args.ttft_ms:.0f} ms, ITL p90 <= {args.itl_ms:.0f} ms; "
             f"window {args.window:.0f} s; steady = a window starting >= {args.settle:.0f} s into its phase",
             "", "windows (cpu%: machine busy / this mesh + load generator, shares of all cores; lag: the load "
             "generator's worst event-loop delay, ms):",
             f"{'t':>5} {'phase':<17}{'req/s':>6} {'ptok/s':>7} {'otok/s':>7} {'P':>4} {'D':>4} "
             f"{'TTFT90':>7} {'ITL90':>6} {'cpu%':>7} {'lag':>4}  sla  decisions"]
    for w in wins:
        sla = ("ok " if w["sla_met"] else "MISS") if w["steady"] else "  . "
        lines.append(f"{w['t0']:5.0f} {w['phase']:<17}{w['req_per_s']:6.1f} {w['prompt_tok_per_s']:7.0f} "
                     f"{w['output_tok_per_s']:7.0f} {w['prefill']:4.1f} {w['decode']:4.1f} "
                     f"{fmt(w['ttft_p90_ms']):>7} {fmt(w['itl_p90_ms']):>6} "
                     f"{_pct(w['cpu_busy']):>3}/{_pct(w['cpu_mesh']):>3} {w['client_lag_max_ms']:4.0f}  {sla} "
                     f"{', '.join(w['decisions'])}")
    lines += ["", "per phase (p90 over the whole phase | over its steady windows):",
              f"{'phase':<17} {'load':<24} {'TTFT p90 ms':>15} {'ITL p90 ms':>13} {'prefill':>8} {'decode':>7} "
              f"{'SLA met':>8}"]
    for p in s["phases"]:
        load = f"{p['rate']:g}/s {p['prompt_tokens']}->{p['output_tokens']} tok"
        lines.append(f"{p['phase']:<17} {load:<24} {fmt(p['ttft_p90_ms']):>6} | {fmt(p['steady_ttft_p90_ms']):>6} "
                     f"{fmt(p['itl_p90_ms']):>5} | {fmt(p['steady_itl_p90_ms']):>5} {p['mean_prefill']:8.2f} "
                     f"{p['mean_decode']:7.2f} {p['steady_met']:>4}/{p['steady_windows']}")
    lines += [
        "",
        f"SLA met in {s['steady_met']}/{s['steady_windows']} steady windows = {100 * s['sla_share']:.0f}% "
        f"(target >= {100 * TARGET_SLA_SHARE:.0f}%)",
        f"replica-seconds: {s['replica_seconds']:.0f} ready ({s['replica_seconds_with_draining']:.0f} with draining) "
        f"vs fixed peak allocation ({s['peak_prefill']} prefill + {s['peak_decode']} decode) x "
        f"{sum(p.seconds for p in plan):.0f} s = {s['fixed_peak_replica_seconds']:.0f}: "
        f"ratio {100 * s['ratio']:.0f}% ({100 * s['ratio_with_draining']:.0f}% with draining) "
        f"(target <= {100 * TARGET_REPLICA_SECONDS_RATIO:.0f}%)",
        f"CPU (shares of all {os.cpu_count()} cores): machine {_pct(s['cpu_busy'])}%, of which this mesh and its "
        f"load generator {_pct(s['cpu_mesh'])}%, other processes {_pct(s['cpu_busy'] - s['cpu_mesh'])}%",
        f"requests: {s['requests']}, errors {s['errors']}, unfinished {s['unfinished']}, "
        f"shed by the client cap {s.get('shed', 0)}",
        "", "CPU by process, in cores (of the machine's cores in use by everything):",
    ]
    for p in s["phases"]:
        roles = ", ".join(f"{r} {v:.2f}" for r, v in p["cpu_cores"].items())
        lines.append(f"  {p['phase']:<17} {roles} (machine {p['cpu_machine_cores']:.2f})")
    lines += ["", "planner scale decisions:"]
    for d in decisions:
        if d["target"] != d["current"]:
            lines.append(f"  {d['t']:6.1f} s  {d['pool']:<7} {d['current']} -> {d['target']}  ({d['reason']})")
    return "\n".join(lines)


def plot(path: Path, args, plan: list[Phase], wins: list[dict], samples: list, s: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mid = [(w["t0"] + w["t1"]) / 2 for w in wins]
    fig, ax = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    starts = [sum(p.seconds for p in plan[:i]) for i in range(len(plan))]
    for a in ax:
        for i in range(len(plan)):
            a.axvspan(starts[i], starts[i] + args.settle, color="0.92", lw=0)
            a.axvline(starts[i], color="0.6", lw=0.8)
    for i, ph in enumerate(plan):
        ax[0].text(starts[i] + 1, 1.0, ph.name, transform=ax[0].get_xaxis_transform(), va="bottom", fontsize=9)
    ax[0].step(mid, [w["prompt_tok_per_s"] for w in wins], where="mid", label="prompt tokens/s")
    ax[0].step(mid, [w["output_tok_per_s"] for w in wins], where="mid", label="output tokens/s (requested)")
    ax[0].set_ylabel("tokens/s offered")
    r = ax[0].twinx()
    r.step(mid, [w["req_per_s"] for w in wins], where="mid", color="k", ls=":", label="requests/s")
    r.set_ylabel("requests/s")
    h1, l1 = ax[0].get_legend_handles_labels()
    h2, l2 = r.get_legend_handles_labels()
    ax[0].legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    t = [x[0] for x in samples]
    ax[1].step(t, [x[1] for x in samples], where="post", label="prefill (ready)")
    ax[1].step(t, [x[2] for x in samples], where="post", label="decode (ready)")
    ax[1].axhline(s["peak_prefill"] + s["peak_decode"], color="0.5", ls="--", lw=0.8,
                  label=f"fixed peak allocation ({s['peak_prefill']}+{s['peak_decode']})")
    ax[1].step(t, [x[1] + x[2] for x in samples], where="post", color="0.3", lw=0.8, label="total")
    ax[1].set_ylabel("replicas")
    ax[1].legend(loc="upper right", fontsize=8)
    for col, key, target, name in ((2, "ttft_p90_ms", args.ttft_ms, "TTFT"), (3, "itl_p90_ms", args.itl_ms, "ITL")):
        ys = [w[key] if w[key] is not None else float("nan") for w in wins]
        ax[col].plot(mid, ys, marker="o", ms=3, label=f"{name} p90 (client, per window)")
        ax[col].axhline(target, color="r", ls="--", lw=1, label=f"target {target:.0f} ms")
        for w, m, y in zip(wins, mid, ys, strict=True):
            if w["steady"] and y > target:  # a steady window this metric failed
                ax[col].plot([m], [y], "rx")
        ax[col].set_ylabel(f"{name} p90 (ms)")
        ax[col].set_ylim(bottom=0)
        ax[col].legend(loc="upper right", fontsize=8)
    ax[3].set_xlabel("seconds since the load began (grey: settling, not counted in the SLA share)")
    fig.suptitle(f"planner: SLA met in {100 * s['sla_share']:.0f}% of steady windows, "
                 f"{100 * s['ratio']:.0f}% of the fixed peak allocation's replica-seconds", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# -- the run -------------------------------------------------------------------------------


def up_command(args, port: int) -> list[str]:
    flags = ["--mock", "--mock-speedup", str(args.speedup), "--port", str(port), "--host", "127.0.0.1",
             "--disagg-threshold", str(args.disagg_threshold)] + (["--router", args.router] if args.router else [])
    if args.fixed:
        p, d = args.fixed
        flags += ["--no-planner", "--prefill", str(p), "--decode", str(d)]
    else:
        flags += ["--prefill", str(args.min_prefill), "--decode", str(args.min_decode),
                  "--min-prefill", str(args.min_prefill), "--max-prefill", str(args.max_prefill),
                  "--min-decode", str(args.min_decode), "--max-decode", str(args.max_decode),
                  "--planner-window", str(args.window), "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms)]
    return [sys.executable, "-m", "cli", "up", *flags]


def start_mesh(args) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = up_command(args, port)
    print("$", " ".join(["mesh", *cmd[3:]]), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "pdmesh is up" in line:
            nats = line.split("NATS ", 1)[1].split(")", 1)[0]
            return proc, f"http://127.0.0.1:{port}", nats
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"mesh up did not come up: {proc.stdout.read()}")


def replot(args) -> int:
    """Draw the timeline again from a saved JSON (``--replot``), without running anything; its figures
    are the saved run's."""
    saved = json.loads(Path(args.replot).read_text())
    run = argparse.Namespace(**saved["args"])
    plan = [Phase(**p) for p in saved["phases"]]
    png = Path(args.png) if args.png else ROOT / "docs" / "img" / "planner_timeline.png"
    plot(png, run, plan, saved["windows"], saved["replicas"], saved["summary"])
    print(f"wrote {png}")
    return emit(BENCHMARK, {"phases": saved["phases"], "summary": saved["summary"], "replotted": args.replot}, args)


async def main_async(args) -> dict:
    plan = phases(args.quick, args.phases)
    proc, url, nats_url = start_mesh(args)
    drain_log = asyncio.create_task(asyncio.to_thread(proc.stdout.read))  # keep the pipe from filling up
    try:
        await asyncio.sleep(2.0)  # both first workers registered and warm
        t0 = time.monotonic() + 1.0
        t0_wall = time.time() + 1.0
        watch = await MeshWatcher.open(nats_url, t0_wall, t0)
        sampler = asyncio.create_task(watch.sample(proc.pid))
        gen = LoadGenerator(url, "mock", t0)
        await gen.run(plan, seed=args.seed)
        await gen.finish(timeout=60)
        sampler.cancel()
        await watch.close()
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.to_thread(proc.wait, 90)
        drain_log.cancel()
    wins = windows(plan, gen.requests, watch, args.window, args.settle, args.ttft_ms, args.itl_ms)
    s = summarize(plan, gen.requests, wins, watch)
    s["shed"] = gen.shed
    text = report(args, plan, wins, s, watch.decisions)
    print(text)
    out_dir = ROOT / "bench" / "out" / "planner"
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"fixed{args.fixed[0]}x{args.fixed[1]}" if args.fixed else "planner"
    tag += "-quick" if args.quick else ""
    tag += "-custom" if args.phases else ""
    tag += f"-{args.router}" if args.router else ""
    (out_dir / f"{tag}.json").write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items()}, "phases": [asdict(p) for p in plan], "summary": s,
        "windows": wins, "decisions": watch.decisions, "replicas": watch.samples,
        "worker_reports": watch.reports, "cpu": watch.cpu,
        "failed": [asdict(r) | {"gaps": len(r.gaps)} for r in gen.requests if r.error][:50],
    }, indent=1))
    (out_dir / f"{tag}.txt").write_text(text + "\n")
    png = Path(args.png) if args.png else (ROOT / "docs" / "img" / "planner_timeline.png" if not (args.fixed or args.quick or args.phases)
                                          else out_dir / f"{tag}.png")
    plot(png, args, plan, wins, watch.samples, s)
    print(f"\nwrote {out_dir / (tag + '.json')} and {png}")
    return {"phases": [asdict(p) for p in plan], "summary": s}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--quick", action="store_true", help="30 s phases instead of 60 s")
    p.add_argument("--speedup", type=float, default=0.1, help="mocker timing model speedup (< 1: slower)")
    p.add_argument("--ttft-ms", type=float, default=2500.0)
    p.add_argument("--itl-ms", type=float, default=200.0)
    p.add_argument("--window", type=float, default=4.0, help="planner window and measurement window (s)")
    p.add_argument("--settle", type=float, default=None, help="seconds of each phase not counted (default 20, quick 12)")
    p.add_argument("--min-prefill", type=int, default=1)
    p.add_argument("--max-prefill", type=int, default=4)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=5)
    p.add_argument("--disagg-threshold", type=int, default=512)
    p.add_argument("--fixed", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                   help="P,D: fixed pools (--no-planner) instead of the planner")
    p.add_argument("--phases", default=None, help="name:seconds:rate:prompt_tokens:output_tokens,... instead")
    p.add_argument("--router", default=None, help="the gateway's routing mode (default: mesh up's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--png", default=None, help="where to write the timeline (default docs/img/planner_timeline.png)")
    p.add_argument("--replot", default=None, help="a saved JSON: draw its timeline again, run nothing")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.settle is None:
        args.settle = 12.0 if args.quick else 20.0
    if args.replot:
        return replot(args)
    if args.dry_run:
        plan = phases(args.quick, args.phases)
        print(f"DRY RUN: {' '.join(['mesh', *up_command(args, 0)[3:]])}; phases "
              + ", ".join(f"{ph.name} {ph.seconds:g} s at {ph.rate:g}/s" for ph in plan))
        return emit(BENCHMARK, {"phases": [asdict(ph) for ph in plan], "summary": {}}, args)
    return emit(BENCHMARK, asyncio.run(main_async(args)), args)
