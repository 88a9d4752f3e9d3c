"""CPU seconds an idle decode worker (the tiny model) spends over 10 s once registered, for each
``--transports`` given: what a worker with nixl costs when it moves no KV.

    python bench/idle_cpu.py [shm,nats shm,nixl,nats] [--seconds 10]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.tiny import write_tiny_model
from mesh.natsserver import EmbeddedNats


def cpu_seconds(pid: int) -> float:
    """User + system time of every thread of ``pid`` (from /proc)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("transports", nargs="*", default=["shm,nats", "shm,nixl,nats"])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--settle", type=float, default=25.0, help="seconds to start, load and register first")
    args = p.parse_args()
    model = write_tiny_model(Path(tempfile.mkdtemp(prefix="pdmesh-idle-")) / "tiny")
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp")}
    with EmbeddedNats() as nats:
        for transports in args.transports:
            worker = subprocess.Popen(
                [sys.executable, "-m", "cli", "worker", "decode", "--model", str(model), "--nats", nats.url,
                 "--transports", transports, "--worker-id", f"idle-{transports.replace(',', '-')}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            try:
                time.sleep(args.settle)
                before = cpu_seconds(worker.pid)
                time.sleep(args.seconds)
                used = cpu_seconds(worker.pid) - before
                print(f"--transports {transports}: {used:.2f} CPU s in {args.seconds:.0f} s idle", flush=True)
            finally:
                worker.terminate()
                worker.wait(30)


if __name__ == "__main__":
    main()
