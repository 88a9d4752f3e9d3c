"""``mesh top``: a live view of the mesh from the bus.

Workers by model and pool with their layout (``tp2xpp2``: TP ranks per stage x
pipeline stages), their load and KV usage, speculative decoding (acceptance rate
and tokens a drafting row emits per step, since the worker started), the request rate (from the workers' request counters), and the
planner's latest decisions.
Everything comes from what workers and the planner publish; nothing is asked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field

from cli.flags import add_bus_flags, nats_config
from mesh.loads import subscribe_loads
from mesh.protocol import LoadReport, PlannerDecision, WorkerCard


def add_parser(sub) -> None:
    p = sub.add_parser("top", help="a live view of the mesh: workers, load, KV usage, planner")
    add_bus_flags(p)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mesh.config import settings

    nats = nats_config(args, "planner")  # it reads what the planner reads
    asyncio.run(run_top(nats, args.ns or settings().ns, args.interval, args.once))
    return 0


@dataclass
class TopState:
    cards: list[WorkerCard] = field(default_factory=list)
    loads: dict[str, LoadReport] = field(default_factory=dict)
    previous: dict[str, tuple[float, int]] = field(default_factory=dict)  # worker -> (time, requests)
    rates: dict[str, float] = field(default_factory=dict)  # worker -> requests/s
    decisions: dict[tuple[str, str], PlannerDecision] = field(default_factory=dict)  # (model, pool) -> latest

    def on_load(self, r: LoadReport) -> None:
        prev = self.previous.get(r.worker_id)
        now_requests = r.counters.get("requests", r.requests_total)
        if prev is not None and r.timestamp > prev[0]:
            self.rates[r.worker_id] = max(0.0, (now_requests - prev[1]) / (r.timestamp - prev[0]))
        self.previous[r.worker_id] = (r.timestamp, now_requests)
        self.loads[r.worker_id] = r


def render(state: TopState, now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"pdmesh top  {time.strftime('%H:%M:%S', time.localtime(now))}  "
             f"{len(state.cards)} workers"]
    models = sorted({c.model for c in state.cards})
    for model in models:
        cards = [c for c in state.cards if c.model == model]
        rate = sum(state.rates.get(c.worker_id, 0.0) for c in cards if c.role == "decode")
        lines.append("")
        lines.append(f"model {model}: {rate:.1f} req/s")
        lines.append(f"  {'worker':<34} {'role':<8} {'layout':<9} {'status':<9} {'run':>4} {'wait':>4} {'kv%':>5} "
                     f"{'ttft p90':>9} {'itl p90':>8} {'jobs':>5} {'spec acc':>8} {'tok/step':>8}")
        for c in sorted(cards, key=lambda c: (c.role, c.worker_id)):
            r = state.loads.get(c.worker_id)
            if r is None:
                lines.append(f"  {c.worker_id:<34} {c.role:<8} {c.layout.describe():<9} {c.status:<9} "
                             "(no load report yet)")
                continue
            kv = 100.0 * r.kv_blocks_used / r.kv_blocks_total if r.kv_blocks_total else 0.0
            lines.append(
                f"  {c.worker_id:<34} {c.role:<8} {c.layout.describe():<9} {c.status:<9} {r.running:>4} "
                f"{r.waiting + r.waiting_for_kv:>4} "
                f"{kv:>5.1f} {r.ttft_p90_ms:>7.0f}ms {r.itl_p90_ms:>6.1f}ms {r.active_jobs:>5} {spec_columns(r)}"
            )
        for pool in ("prefill", "decode"):
            d = state.decisions.get((model, pool)) or state.decisions.get(("", pool))
            if d is not None:
                lines.append(f"  planner {pool}: {d.current} -> {d.target} ({d.reason})")
    if not models:
        lines.append("no workers registered")
    return "\n".join(lines)


def spec_columns(r: LoadReport) -> str:
    """Speculative decoding since the worker started, every method together (its ``spec_*``
    counters, ``worker.base.speculative_counters``): accepted / drafted tokens, and the tokens a
    drafting row emits per step; dashes where it drafts nothing."""
    total: dict[str, int] = {}
    for key, value in r.counters.items():
        if key.startswith("spec_") and ":" in key:
            kind = key[len("spec_"):].partition(":")[0]
            total[kind] = total.get(kind, 0) + value
    if not total.get("drafted"):
        return f"{'-':>8} {'-':>8}"
    per_step = total.get("emitted", 0) / total["rows"] if total.get("rows") else 0.0
    return f"{total.get('accepted', 0) / total['drafted']:>8.2f} {per_step:>8.2f}"


async def run_top(nats, ns: str, interval: float = 1.0, once: bool = False) -> None:
    """``nats``: a URL, or a ``NatsConfig`` (credentials, TLS)."""
    from mesh.bus import Bus  # here, not above: every ``mesh`` command builds this module's parser
    from mesh.registry import Membership

    config = nats if not isinstance(nats, str) else None
    bus = await Bus.connect(nats if isinstance(nats, str) else nats.url, "mesh-top", ns=ns, config=config)
    membership = Membership(bus)
    await membership.start()
    state = TopState()

    async def on_load(r: LoadReport, raw) -> None:
        state.on_load(r)

    async def on_decision(d: PlannerDecision, raw) -> None:
        state.decisions[(d.model, d.pool)] = d

    await subscribe_loads(bus, on_load)
    await bus.subscribe(bus.subjects.planner_decisions(), on_decision, PlannerDecision)
    try:
        if once:
            await asyncio.sleep(max(interval, 1.5))  # one round of load reports
            state.cards = membership.cards()
            print(render(state), flush=True)
            return
        while True:
            state.cards = membership.cards()
            sys.stdout.write("\x1b[H\x1b[2J" + render(state) + "\n")
            sys.stdout.flush()
            await asyncio.sleep(interval)
    finally:
        with contextlib.suppress(Exception):
            await membership.stop()
        await bus.close()
