"""Shutdown at scale: how long ``mesh up`` takes to be gone after Ctrl-C (or SIGTERM).

Starts ``mesh up --mock --decode N --prefill 0 --no-planner`` in its own process
group, opens some long streaming completions, then sends SIGINT to the whole
group (what a terminal's Ctrl-C does: ``mesh up``, the gateway and every
worker get it at once) or SIGTERM to ``mesh up`` alone (``--signal term``:
what systemd or a container runtime does). It polls /proc until every process
``mesh up`` started is gone and prints, per role, the seconds from the signal
to the last exit, whether the nats-server outlived every role that used it,
and how each open stream ended (finished, an error event, or cut off).

    python -m bench shutdown [--decode 32] [--streams 8] [--signal int|term]
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from mesh.natsserver import free_port

BENCHMARK = Benchmark(
    name="shutdown",
    measures="seconds from Ctrl-C (SIGINT to the group, or SIGTERM to `mesh up`) until every process of "
             "`mesh up --mock` with 32 decode workers and 8 open streams is gone",
    target="every process gone within 5 s of Ctrl-C at 32 workers",
    minutes=1,
    smoke=("--dry-run",),
)


def _ppid_and_cmd(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), cmd


def descendants(root: int) -> dict[int, str]:
    """pid -> role of every live process below ``root``."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _ppid_and_cmd(int(entry))) is not None:
            table[int(entry)] = info
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmd) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = role_of(cmd)
                frontier.append(pid)
    return found


def role_of(cmd: str) -> str:
    for role in ("nats-server", "gateway", "worker"):
        if role in cmd:
            return role
    return "other"


async def stream_one(base: str, outcome: dict, started: asyncio.Event, counter: list[int], n: int) -> None:
    body = {"model": "mock", "prompt": [5, 6, 7, 8], "max_tokens": 4000, "stream": True, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client, \
                client.stream("POST", f"{base}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                counter[0] += 1
                if counter[0] >= n:
                    started.set()
                if line == "data: [DONE]":
                    outcome["finished"] = outcome.get("finished", 0) + 1
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    key = f"error: {event['error']['message'][:60]}"
                    outcome[key] = outcome.get(key, 0) + 1
                    return
        outcome["ended without [DONE]"] = outcome.get("ended without [DONE]", 0) + 1
    except httpx.HTTPError as e:
        key = f"cut off ({type(e).__name__})"
        outcome[key] = outcome.get(key, 0) + 1


async def wait_workers(base: str, n: int, timeout: float = 600.0) -> None:
    """Until the gateway sees ``n`` ready decode workers (``mesh up`` is "up" at the first)."""
    want = f'pdmesh_gateway_live_workers{{model="mock"}} {n}'
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if want in (await client.get(f"{base}/metrics")).text:
                return
            await asyncio.sleep(0.5)
    raise SystemExit(f"{n} workers did not come up in {timeout:.0f}s")


def up_command(args, port: int) -> list[str]:
    return [sys.executable, "-m", "cli", "up", "--mock", "--decode", str(args.decode), "--prefill", "0",
            "--no-planner", "--port", str(port), "--mock-speedup", "4"]


def summary(args, procs: dict[int, str], gone: dict[int, float], outcome: dict[str, int]) -> dict:
    """Seconds from the signal until each role's processes were gone (first, median, last), and everything."""
    roles = {}
    for role in sorted(set(procs.values())):
        done = sorted(gone[pid] for pid, r in procs.items() if r == role and pid in gone)
        roles[role] = {"processes": sum(1 for r in procs.values() if r == role), "gone": len(done),
                       "first_s": done[0] if done else None, "median_s": done[len(done) // 2] if done else None,
                       "last_s": done[-1] if done else None}
    return {"decode_workers": args.decode, "signal": args.signal, "roles": roles,
            "everything_s": max(gone.values()) if gone else None, "left_alive": len(procs) - len(gone),
            "open_streams": outcome}


async def run(args) -> dict:
    port = free_port()
    cmd = up_command(args, port)
    t0 = time.monotonic()
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = await asyncio.to_thread(up.stdout.readline)
        if "is up" not in line:
            raise SystemExit(f"mesh up did not come up: {line!r}")
        base = f"http://127.0.0.1:{port}"
        await wait_workers(base, args.decode)
        print(f"up with {args.decode} decode workers in {time.monotonic() - t0:.1f}s", flush=True)
        outcome: dict[str, int] = {}
        started, counter = asyncio.Event(), [0]
        streams = [asyncio.create_task(stream_one(base, outcome, started, counter, 4 * args.streams))
                   for _ in range(args.streams)]
        if streams:
            await asyncio.wait_for(started.wait(), 60)
        procs = descendants(up.pid)
        procs[up.pid] = "mesh up"
        roles = sorted(set(procs.values()))
        print("processes: " + ", ".join(f"{sum(1 for r in procs.values() if r == role)} {role}" for role in roles))
        sig = signal.SIGINT if args.signal == "int" else signal.SIGTERM
        t_sig = time.monotonic()
        if args.signal == "int":
            os.killpg(up.pid, sig)  # a terminal's Ctrl-C: the whole foreground group
        else:
            up.send_signal(sig)
        gone: dict[int, float] = {}
        while len(gone) < len(procs) and time.monotonic() - t_sig < args.limit:
            now = time.monotonic() - t_sig  # one time per sweep: the order within a sweep is unknown
            for pid in procs:
                if pid not in gone and ((pid == up.pid and up.poll() is not None) or
                                        (pid != up.pid and _ppid_and_cmd(pid) is None)):
                    gone[pid] = now
            await asyncio.sleep(0.02)
        await asyncio.gather(*streams)
        left = [pid for pid in procs if pid not in gone]
        for pid in left:  # with PYTHONFAULTHANDLER=1 in the environment, SIGABRT prints every thread's stack
            os.kill(pid, signal.SIGABRT if args.abort_hung else signal.SIGKILL)
        print(f"signal: SIG{args.signal.upper()} ({'process group' if args.signal == 'int' else 'mesh up only'})")
        for role in roles:
            times = [gone.get(pid) for pid, r in procs.items() if r == role]
            done = [t for t in times if t is not None]
            last = f"{max(done):.2f}s" if done else "-"
            first = f"{min(done):.2f}s" if done else "-"
            median = f"{sorted(done)[len(done) // 2]:.2f}s" if done else "-"
            print(f"  {role:12s} {len(done)}/{len(times)} gone: first {first}, median {median}, last {last}")
        if args.verbose:
            for pid, role in sorted(procs.items(), key=lambda kv: gone.get(kv[0], 1e9)):
                print(f"    {pid} {role} {gone.get(pid, float('inf')):.2f}s")
        total = max(gone.values()) if gone else float("nan")
        print(f"everything gone after: {total:.2f}s" + (f" ({len(left)} still alive at {args.limit:.0f}s: killed)"
                                                       if left else ""))
        nats_t = [gone.get(p) for p, r in procs.items() if r == "nats-server"]
        users = [gone.get(p, float("inf")) for p, r in procs.items() if r in ("gateway", "worker")]
        if nats_t:
            ok = all(t is not None for t in nats_t) and min(nats_t) >= max(users)
            print(f"nats-server stopped after every role that uses it: {'yes' if ok else 'NO'} "
                  "(to the 20 ms of a /proc sweep)")
        print("open streams: " + (", ".join(f"{v} {k}" for k, v in sorted(outcome.items())) or "none"))
        return summary(args, procs, gone, outcome)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--streams", type=int, default=8, help="streaming completions open when the signal comes")
    p.add_argument("--signal", choices=["int", "term"], default="int")
    p.add_argument("--abort-hung", action="store_true",
                   help="SIGABRT instead of SIGKILL what is left at --limit (stacks, with PYTHONFAULTHANDLER=1)")
    p.add_argument("--verbose", action="store_true", help="every process's exit time")
    p.add_argument("--limit", type=float, default=120.0, help="give up (and SIGKILL) after this many seconds")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.dry_run:
        print(f"DRY RUN: {' '.join(up_command(args, 0)[1:])}; {args.streams} streams open, then "
              f"SIG{args.signal.upper()}; /proc polled every 20 ms for {args.limit:g} s at most")
        return emit(BENCHMARK, summary(args, {}, {}, {}), args)
    return emit(BENCHMARK, asyncio.run(run(args)), args)
