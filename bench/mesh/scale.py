"""Scale: the mesh at 10, 100 and 1,000 simulated workers, up to 4,096 streams, on one machine.

Each run starts a whole mesh: nats-server (JetStream, monitoring on), ``mesh gateway --workers G``
(the KV router in each process), ``mesh planner``, the workers as ``mesh worker mock --num-workers``
in at most 8 processes, and a closed-loop load of C streams (``bench/mesh/scale_probes.py client``:
token-id prompts, a 64-token system prompt every request shares and 192 tokens of its own, 64
tokens out, every token its own chunk). The simulated step is fixed, ``1000 * C / rate`` ms for any
batch, so the mesh carries ``--token-rate`` tokens a second (default 3,000: what two shared cores
carry beside 1,000 workers' own upkeep) whatever the number of workers, and a row at 1,000
workers does the same work as a row at 10 with the same streams. The workers of one process step
on one clock (``--mock-step-grid-ms`` = the step; ``--no-step-grid``: each on its own), as one
host's would: their token batches and KV events leave in one turn of its loop, and the gateway
wakes once per process per step rather than once per worker. Their load reports tick together
either way (``mesh.procutil.until_tick``); a process's token batches to a gateway share one
connection (``mesh.tokenlink.LinkPool``: a step's frames in one write), its load reports of a tick
leave as one message (``mesh.loads``), its KV event batches of a step as one (``mesh.kvevents.
KvBatcher``), and its workers' cards sit under a few set keys refreshed as one put every 2 s
(``mesh.cardset``), not a put per worker. Workers one per process (a real deployment) get none of
this; what they keep of issue 51's fixes is the registry view's cheaper refreshes
(``mesh.registry``), the router's exact slots and the admission check's.

Per run, over a window after a warm-up: every component's CPU seconds per second and RSS (from
/proc; the gateway with its processes, the workers summed over theirs); NATS messages and bytes per
second by subject family (a counting subscriber, ``scale_probes.py natscount``; nats-server's own
totals from its monitoring endpoint, /varz, beside them); the router's decision p50/p99 (the
gateway's ``pdmesh_router_decision_seconds``) and KV events indexed per second; TTFT and
inter-token p50/p99 at the client; the machine's load average. CPU per token: a component's CPU
seconds over the tokens the client received. ``--kill``: one more run where a process of 200
workers (of 1,000) is killed mid-load: how long until no decision names its workers and until the
registry has none of them, whether every stream finished with the mocker's exact tokens, and which
errors clients saw.

The router's own figures at 1,000 workers with 1M blocks indexed (``router``): the gateway's
``KvRouter`` in this process, fed as the bus feeds it (``scale_router.py``); decision p50/p99,
index bytes per block, ingest rate. ``checks``: the issue's targets (51) read off the runs.

    python -m bench scale [--quick | --dry-run] [--workers 10,100,1000] [--streams 512,4096]
                          [--gateway-workers 1] [--token-rate 3000] [--seconds 30] [--kill [--kill-streams N]]
                          [--no-step-grid] [--repeat N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Benchmark, emit, parse, parser
from bench.common.registry import ROOT
from bench.mesh.scale_mesh import (
    OWN_TOKENS,
    PROBES,
    SYSTEM_TOKENS,
    KillWatch,
    Mesh,
    Spec,
    cpu_seconds,
    figures,
    snapshot,
    wait_ready,
)
from bench.mesh.scale_router import router_figures

BENCHMARK = Benchmark(
    name="scale",
    measures="the mesh at 10, 100 and 1,000 simulated workers (at most 8 processes) and 512 and 4,096 "
             "streams at a fixed token rate: each component's CPU and RSS, NATS messages by family, router "
             "decisions, TTFT and ITL, the load; the router alone at 1,000 workers x 1M blocks; a 200-worker "
             "process killed mid-load",
    target="4,096 streams at 1,000 workers with no error; killed workers out of routing within 6 s, streams "
           "identical; router p99 <= 1 ms at 1,000 x 1M blocks; gateway CPU per token at 1,000 within 1.3x of 10",
    minutes=22,
    smoke=("--dry-run",),
)
MAX_PROCESSES = 8


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
        if keep:
            print(f"scale: the run's logs are in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


async def measure(mesh: Mesh, spec: Spec, vocab: int, ready_s: float) -> dict:
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-m", PROBES, "client", f"http://127.0.0.1:{mesh.port}", mesh.model_dir.name,
        "--streams", str(spec.streams), "--tokens", str(spec.tokens), "--system-tokens", str(SYSTEM_TOKENS),
        "--own-tokens", str(OWN_TOKENS), "--vocab", str(vocab), "--warmup", str(spec.settle_s()),
        "--seconds", str(spec.seconds), "--drain", str(spec.tokens * spec.step_ms / 1000 * 3 + 60),
        stdout=asyncio.subprocess.PIPE, start_new_session=True, cwd=ROOT)
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




def _by_client(run: dict) -> float | None:
    """The gateway's CPU per token over the client's (None: either unknown)."""
    u = run["cpu_us_per_token"]
    return u["gateway"] / u["client"] if u.get("gateway") and u.get("client") else None


def _pairs(small: list[dict], large: list[dict], measure) -> float | dict | None:
    """``measure`` of each large run over the small run's before it: the one ratio, or with
    ``--repeat`` each and their median (the upper of the middle two for an even count)."""
    each = [round(measure(b) / measure(a), 2) if measure(a) and measure(b) else None
            for a, b in zip(small, large, strict=False)]
    if len(each) == 1:
        return each[0]
    known = sorted(x for x in each if x is not None)
    return {"each": each, "median": known[len(known) // 2] if known else None}


def checks(out: dict) -> dict:
    """The issue's targets, read off the runs (None: the run that would say was not made)."""
    runs, router = out.get("runs", []), out.get("router") or {}
    by: dict[tuple, list[dict]] = {}
    for r in runs:  # with --repeat, a size's runs in the order they were made
        by.setdefault((r["workers"], r["streams"], r["gateways"]), []).append(r)
    ratios = {}
    for (w, c, g), rs in by.items():
        small = by.get((min(x[0] for x in by), c, g))
        if w == max(x[0] for x in by) and small is not None and small is not rs:
            # each large run against the small run just before it (the machine as it was then); and
            # the same over the client's CPU per token in each run: the client's work is the same at
            # every size (the streams, tokens and requests), so this cancels the machine's own speed,
            # which moved every component's CPU per token, the client's too, by up to 1.4x between runs
            ratios[f"{c} streams, {g} gateway"] = _pairs(small, rs, lambda r: r["cpu_us_per_token"]["gateway"])
            ratios[f"{c} streams, {g} gateway, over the client's"] = _pairs(small, rs, _by_client)
    biggest = max(runs, key=lambda r: (r["workers"], r["streams"]), default=None)
    kill = out.get("kill")
    return {
        "largest_run_clean": None if biggest is None else {
            "workers": biggest["workers"], "streams": biggest["streams"],
            "ok": not biggest["errors"] and not biggest["mismatched"] and not biggest["unfinished"]},
        "router_decision_p99_ms": router.get("decision_p99_ms"),
        "router_decision_cpu_p99_ms": router.get("decision_cpu_p99_ms"),
        "gateway_cpu_per_token_ratio_largest_vs_smallest": ratios,
        "kill": None if kill is None else {
            "killed_workers": kill["kill"]["killed_workers"],
            "left_routing_s": kill["kill"]["last_decision_to_killed_s"],
            "left_registry_s": kill["kill"]["left_registry_s"],
            "streams_resumed": kill.get("migrations"), "mismatched": kill["mismatched"],
            "unfinished": kill["unfinished"], "errors": kill["errors"]},
    }


def plan(args) -> tuple[list[Spec], Spec | None, tuple[int, int, int] | None]:
    """The runs, the kill run and the router's size (workers, blocks, decisions) the arguments ask for."""
    if args.quick:
        workers, streams, gws, kill_w, kill_p = [10, 40], [64], [1], 40, 4
        args.warmup, args.seconds = min(args.warmup, 4.0), min(args.seconds, 8.0)
        router = (100, 1000, 500)
    else:
        workers = [int(x) for x in args.workers.split(",")]
        streams = [int(x) for x in args.streams.split(",")]
        gws = [int(x) for x in args.gateway_workers.split(",")]
        kill_w, kill_p = 1000, 5
        router = (1000, 1000, 5000)

    def step(c: int) -> float:
        return max(10.0, round(1000 * c / args.token_rate, 1))

    specs = [Spec(w, c, g, min(MAX_PROCESSES, w), step(c), args.tokens, args.warmup, args.seconds,
                  step_grid=args.step_grid)
             for w in workers for c in streams for g in gws]
    kill = None
    if args.kill:
        c, seconds = args.kill_streams or streams[-1], max(args.seconds, 20.0)
        kill = Spec(kill_w, c, gws[0], kill_p, step(c), args.tokens, args.warmup, seconds, kill_after=seconds / 3,
                    step_grid=args.step_grid)
    return specs, kill, None if args.no_router else router


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--quick", action="store_true", help="a few minutes: 10 and 40 workers, 64 streams, a 10-worker "
                   "process of 40 killed (with --kill), the router at 100 workers x 1,000 blocks")
    p.add_argument("--dry-run", action="store_true", help="the plan and the router at 20 workers x 200 blocks "
                   "(in this process): no mesh started")
    p.add_argument("--workers", default="10,100,1000")
    p.add_argument("--streams", default="512,4096")
    p.add_argument("--gateway-workers", default="1", help="gateway processes per run, e.g. 1,4")
    p.add_argument("--token-rate", type=float, default=3000.0, help="tokens a second the mesh carries")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--kill", action="store_true", help="also the kill run (1,000 workers, 200 per process)")
    p.add_argument("--kill-streams", type=int, default=0, help="the kill run's streams (default: the most of --streams; "
                   "512: its requests last 11 s, not 87, and ~100 streams are on the killed workers)")
    p.add_argument("--step-grid", action=argparse.BooleanOptionalAction, default=True,
                   help="the workers of a process step on one clock (--mock-step-grid-ms: the step), so their "
                        "token batches and KV events leave together (default: on)")
    p.add_argument("--repeat", type=int, default=1, help="run every size this many times, interleaved (10, 1000, "
                   "10, 1000, ...): a ratio for each pair, and their median (the machine's drift between two "
                   "runs minutes apart: the 10-worker row's gateway CPU per token was 36.7 and 48.6 us in two runs of the "
                   "same code)")
    p.add_argument("--no-router", action="store_true", help="skip the in-process router figures")
    p.add_argument("--keep", action="store_true", help="keep each run's logs (their folder printed)")
    args = parse(BENCHMARK, p, argv)
    specs, kill, router = plan(args)
    out: dict = {"token_rate": args.token_rate}
    if args.dry_run:
        out["plan"] = [vars(s) for s in specs] + ([vars(kill)] if kill else [])
        out["router"] = router_figures(20, 200, 50)
        return emit(BENCHMARK, out, args)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the runs' cleanups: no mesh left behind
    model_dir = Path(tempfile.mkdtemp(prefix="pdmesh-scale-model-")) / "tiny"
    try:
        subprocess.run([sys.executable, "-m", "cli", "model", "tiny", str(model_dir)], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        if router is not None:
            out["router"] = router_figures(*router)
            print(f"router: {out['router']}", file=sys.stderr, flush=True)
        out["runs"] = []
        for _ in range(args.repeat):  # interleaved: each size once, then again (the machine drifts)
            for spec in specs:
                out["runs"].append(asyncio.run(run(spec, model_dir, vocab, args.keep)))
                print(json.dumps(out["runs"][-1]), file=sys.stderr, flush=True)
        if kill is not None:
            out["kill"] = asyncio.run(run(kill, model_dir, vocab, args.keep))
            print(json.dumps(out["kill"]), file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(model_dir.parent, ignore_errors=True)
    out["checks"] = checks(out)
    out["table"] = table(out["runs"] + ([out["kill"]] if "kill" in out else []))
    print(out["table"], file=sys.stderr)
    return emit(BENCHMARK, out, args)
