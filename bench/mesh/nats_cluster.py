"""The mesh on a 3-node NATS cluster: chaos load while a server is killed -9 and restarted.

Three nats-servers on loopback form one JetStream cluster; the registry bucket and the
prefill streams are replicated on all three (``--js-replicas 3``); every process gets the
three URLs (``--nats a,b,c``). Mocker decode and prefill workers and a gateway serve the load
of ``python -m bench chaos`` (streamed completions whose tokens are checked one by one). Mid-run the
server that carries the gateway's connection is killed -9 and restarted ``--down`` seconds
later (``--kills`` times, each time the gateway's server of the moment). At the end every
request is correct, a clear error (an HTTP status or an SSE error event) or hung: hung and
incorrect must be 0. It prints those counts, the errors by kind, latency with and without a
fault in flight, and how long after each kill requests completed again.

    python -m bench nats-cluster [--seconds 120] [--clients 6] [--kills 1] [--down 5]
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.mesh.chaos import Outcome, Proc, one_request, report, scrape_counters, summary
from mesh.natsserver import EmbeddedNatsCluster, free_port
from mesh.procutil import die_with_parent

BENCHMARK = Benchmark(
    name="nats-cluster",
    measures="the chaos load on a 3-node JetStream cluster while the server carrying the gateway's connection is "
             "killed -9 and restarted: correct, clear errors, hung, time to the next completion",
    target="0 incorrect, 0 hung, errors only clear 5xx",
    minutes=2.5,
    smoke=("--dry-run",),
)


class LoggedProc(Proc):
    """A chaos ``Proc`` whose log (INFO) goes to a file of ``log_dir`` (``--logs``), or nowhere."""

    log_dir: Path | None = None

    def start(self) -> None:
        if self.log_dir is None:
            super().start()
            return
        name = self.argv[self.argv.index("--worker-id") + 1] if "--worker-id" in self.argv else self.role
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.proc = subprocess.Popen(self.argv, preexec_fn=die_with_parent, stdout=subprocess.DEVNULL,
                                         stderr=log, env={**os.environ, "MESH_LOG_LEVEL": "INFO"})


async def gateway_server(cluster: EmbeddedNatsCluster, client: httpx.AsyncClient) -> int:
    """The index of the server the gateway is connected to now (its /connz lists it)."""
    for i, node in enumerate(cluster.nodes):
        if node.proc is None or node.proc.poll() is not None:
            continue
        try:
            conns = (await client.get(f"{cluster.monitor(i)}/connz", params={"limit": 1024})).json()
        except (httpx.HTTPError, ValueError):
            continue
        if any(c.get("name") == "gateway" for c in conns.get("connections") or []):
            return i
    return 0


async def run_cluster_chaos(seconds: float = 120.0, clients: int = 6, kills: int = 1, down: float = 5.0,
                            decode: int = 3, prefill: int = 2, request_timeout: float = 60.0, seed: int = 0,
                            log=print, log_dir: Path | None = None) -> tuple[Outcome, list[float]]:
    """(outcome, seconds from each kill to the next request that completed after it)."""
    cluster = EmbeddedNatsCluster(3).start()
    LoggedProc.log_dir = log_dir
    py = [sys.executable, "-m", "cli"]
    bus = ["--nats", cluster.url, "--ns", "cluster", "--js-replicas", "3", "--nats-connect-timeout", "30"]
    common = ["--mock-speedup", "20", "--prefill-timeout", "4"]
    workers = [LoggedProc("decode", [*py, "worker", "mock", *bus, *common, "--worker-id", f"cl-dec-{i}",
                               "--disagg-threshold", "512"]) for i in range(decode)]
    workers += [LoggedProc("prefill", [*py, "worker", "prefill", "--mock", *bus, *common, "--worker-id", f"cl-pre-{i}"])
                for i in range(prefill)]
    port = free_port()
    gateway = LoggedProc("gateway", [*py, "gateway", *bus, "--host", "127.0.0.1", "--port", str(port),
                               "--first-token-timeout", "8", "--idle-timeout", "8"])
    url = f"http://127.0.0.1:{port}"
    for p in [*workers, gateway]:
        p.start()
    out = Outcome()
    kill_times: list[float] = []
    try:
        async with httpx.AsyncClient(timeout=request_timeout) as client:
            want = f'pdmesh_gateway_live_workers{{model="mock"}} {decode}'
            for _ in range(480):
                try:
                    if want in (await client.get(f"{url}/metrics")).text:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
            else:
                raise RuntimeError("the mesh did not come up on the cluster")
            start = time.monotonic()
            end = start + seconds

            async def user(i: int) -> None:
                r = random.Random(seed * 1000 + i)
                while time.monotonic() < end:
                    await one_request(client, url, r, out, request_timeout)

            async def killer() -> None:
                for k in range(kills):
                    await asyncio.sleep(max(0.0, start + seconds * (k + 1) / (kills + 1) - time.monotonic()))
                    victim = await gateway_server(cluster, client)
                    log(f"  [{time.monotonic() - start:5.1f}s] kill -9 nats-server {victim} (the gateway's)")
                    out.faults.append(time.monotonic())
                    kill_times.append(time.monotonic())
                    cluster.kill(victim)
                    out.kills += 1
                    await asyncio.sleep(down)
                    await asyncio.to_thread(cluster.restart, victim)
                    out.restarts += 1
                    log(f"  [{time.monotonic() - start:5.1f}s] nats-server {victim} is back")

            await asyncio.gather(killer(), *(user(i) for i in range(clients)))
            out.migrations, out.reroutes = await scrape_counters(client, url)
    finally:
        gateway.stop()
        for p in workers:
            p.stop()
        cluster.stop()
    recovery = []
    for t in kill_times:
        after = [t1 for _, t1 in out.spans if t1 > t]
        recovery.append(min(after) - t if after else float("inf"))
    return out, recovery


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--kills", type=int, default=1, help="servers killed -9 (one at a time) over the run")
    p.add_argument("--down", type=float, default=5.0, help="seconds a killed server stays down")
    p.add_argument("--decode", type=int, default=3)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", type=Path, default=None, help="write each process's log (INFO) here")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.dry_run:
        print(f"DRY RUN: 3 nats-servers in one JetStream cluster, {args.decode} decode + {args.prefill} prefill mock "
              f"workers and a gateway (--js-replicas 3); {args.clients} clients for {args.seconds:g} s; {args.kills} "
              f"kill(s) of the gateway's server, each down {args.down:g} s")
        return emit(BENCHMARK, {**summary(Outcome(), args.seconds), "recovery_s": []}, args)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    out, recovery = asyncio.run(run_cluster_chaos(args.seconds, args.clients, args.kills, args.down, args.decode,
                                                  args.prefill, seed=args.seed, log_dir=args.logs))
    text = report(out, args.seconds).replace("1 NATS restart", f"{out.kills} of 3 nats-servers killed -9 "
                                             f"and restarted after {args.down:g}s, no worker killed")
    print(text.replace(f"{out.kills} kills, {out.restarts} restarts, ", ""))
    print("a request completed again " + ", ".join(f"{r:.2f}s" for r in recovery) + " after each kill")
    emit(BENCHMARK, {**summary(out, args.seconds), "recovery_s": recovery}, args)
    return 1 if out.incorrect or out.hung else 0
