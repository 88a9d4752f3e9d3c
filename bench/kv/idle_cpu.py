"""CPU seconds an idle decode worker (the tiny model) spends over 10 s once registered, for each
``--transports`` given: what a worker with nixl costs when it moves no KV.

    python -m bench idle-cpu [shm,nats shm,nixl,nats] [--seconds 10]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.common.models import generated
from mesh.natsserver import EmbeddedNats

BENCHMARK = Benchmark(
    name="idle-cpu",
    measures="CPU seconds an idle decode worker (the tiny model) spends in 10 s once registered, per set of "
             "--transports: what nixl costs a worker that moves no KV",
    minutes=1.5,
    smoke=("--dry-run",),
)


def cpu_seconds(pid: int) -> float:
    """User + system time of every thread of ``pid`` (from /proc)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def worker_command(model: str, url: str, transports: str) -> list[str]:
    return [sys.executable, "-m", "cli", "worker", "decode", "--model", model, "--nats", url,
            "--transports", transports, "--worker-id", f"idle-{transports.replace(',', '-')}"]


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("transports", nargs="*", default=["shm,nats", "shm,nixl,nats"])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--settle", type=float, default=25.0, help="seconds to start, load and register first")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp")}
    rows = []
    if args.dry_run:
        for transports in args.transports:
            print(f"DRY RUN: UCX_TLS={env['UCX_TLS']} {' '.join(worker_command('MODEL', 'nats://HOST:PORT', transports))}")
        return emit(BENCHMARK, {"seconds": args.seconds, "rows": rows}, args)
    model = str(generated("tiny"))
    with EmbeddedNats() as nats:
        for transports in args.transports:
            worker = subprocess.Popen(worker_command(model, nats.url, transports),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            try:
                time.sleep(args.settle)
                before = cpu_seconds(worker.pid)
                time.sleep(args.seconds)
                used = cpu_seconds(worker.pid) - before
                print(f"--transports {transports}: {used:.2f} CPU s in {args.seconds:.0f} s idle", flush=True)
                rows.append({"transports": transports, "cpu_seconds": used})
            finally:
                worker.terminate()
                worker.wait(30)
    return emit(BENCHMARK, {"seconds": args.seconds, "rows": rows}, args)
