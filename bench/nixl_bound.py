"""What NIXL/UCX alone can do between two simulated hosts, against the same plain TCP socket
``bench/transfer.py --hosts 2`` compares with: the bound for the mesh's nixl transport.

Two network namespaces on a veth pair (``bench/netns_pair.py``, root). No asyncio, no NATS, no
grant: each side is one plain loop. The sender WRITEs N MB (as 1 descriptor, or as 16: one per
(layer, K|V) plane, as a run of the pool's blocks is) with a notification and polls the transfer;
the receiver polls its notifications. Both poll either without pause ("busy": on two shared
cores 10-20 ms a 1 MB write, 20x slower, as a spinning side takes the core the other needs) or
every ``--polls-us`` (a ``time.sleep``, as the mesh's progress thread waits on a condition), with
``--slack-ns`` of timer slack (1 us, as the progress thread; Linux's default of 50 us made a
0.05 ms sleep last 0.10-0.16 ms). ``--cpus`` pins the two sides (``taskset``). A transfer
is timed from the sender starting until the receiver has the notification (socket: its last
``recv_into``), on the receiver's clock (CLOCK_MONOTONIC, one kernel); a control connection
carries the times back.

Repetitions are interleaved: each round runs every kind (socket, then each descriptor count at
each poll, in a shuffled order) once, so a burst of load hits them all alike. Reported: median and
quartiles of each kind, and of the paired ratio socket time / nixl time of the same round
(>= 0.8 is the issue's target).

``--sweep`` runs the UCX settings of ``SWEEP`` (each a fresh pair of processes: UCX reads its
environment once), in ``--rounds`` passes so that each setting meets the machine's load at
several moments. Every setting carries ``UCX_TLS=tcp``: without it UCX takes its shared-memory
transports between the namespaces (one kernel), which is not two hosts.

    sudo python bench/nixl_bound.py [--mb 1] [--descs 1 16] [--polls-us 0 50] [--repeat 60] [--slack-ns 1000] [--idle-ms 50 [--busy]]
    sudo python bench/nixl_bound.py --sweep [--rounds 2] [--repeat 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

CTL_PORT, TCP_PORT = 17501, 17502
HERE = Path(__file__).resolve()
SEG256K = {"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}
# name -> UCX settings on top of UCX_TLS=tcp. NIXL's WRITE is an RMA put (UCX_RNDV_* and the
# eager/rendezvous thresholds govern tagged and active messages: its notification, not its bytes)
SWEEP: dict[str, dict[str, str]] = {
    "defaults": {},
    "seg256k": SEG256K,
    "seg1m": {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"},
    "seg256k+poll-drain": {**SEG256K, "UCX_TCP_MAX_POLL": "-1"},
    "seg256k+iov16": {**SEG256K, "UCX_TCP_MAX_IOV": "16"},
    "seg256k+iov128": {**SEG256K, "UCX_TCP_MAX_IOV": "128"},
    "seg256k+iov1024": {**SEG256K, "UCX_TCP_MAX_IOV": "1024"},
    "iov128": {"UCX_TCP_MAX_IOV": "128"},
    "seg1m+iov128": {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m", "UCX_TCP_MAX_IOV": "128"},
    "seg256k+put-off": {**SEG256K, "UCX_TCP_PUT_ENABLE": "n"},
    "seg256k+proto-v1": {**SEG256K, "UCX_PROTO_ENABLE": "n"},
    "seg256k+zcopy-inf": {**SEG256K, "UCX_ZCOPY_THRESH": "inf"},
    "seg256k+buf4m": {**SEG256K, "UCX_TCP_SNDBUF": "4m", "UCX_TCP_RCVBUF": "4m"},
    "seg256k+rndv": {**SEG256K, "UCX_RNDV_THRESH": "inf", "UCX_RNDV_SCHEME": "put_zcopy", "UCX_MAX_RNDV_RAILS": "1"},
    "seg256k+no-adaptive": {**SEG256K, "UCX_ADAPTIVE_PROGRESS": "n"},
}


def agent(name: str):
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                              sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))


def timer_slack(ns: int) -> None:
    """This thread's timer slack (Linux: 50 us by default, so a 50 us sleep takes ~100 us)."""
    import ctypes

    if ns and ctypes.CDLL(None, use_errno=True).prctl(29, ns, 0, 0, 0):  # PR_SET_TIMERSLACK
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_TIMERSLACK)")


def send_json(sock: socket.socket, obj) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def until(predicate, poll_s: float) -> None:
    while not predicate():
        if poll_s:
            time.sleep(poll_s)


def receiver(addr: str, size: int, slack_ns: int) -> None:
    import numpy as np

    timer_slack(slack_ns)
    buf = np.zeros(size, dtype=np.uint8)
    ag = agent("rx")
    ag.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    ctl_srv, tcp_srv = socket.create_server((addr, CTL_PORT)), socket.create_server((addr, TCP_PORT))
    print("ready", flush=True)
    ctl, _ = ctl_srv.accept()
    lines = ctl.makefile("r")
    send_json(ctl, {"md": ag.get_agent_metadata().hex(), "addr": buf.ctypes.data})
    tcp, _ = tcp_srv.accept()
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view, seen = memoryview(buf), set()
    for line in lines:
        q = json.loads(line)
        if q["op"] == "socket":
            got = 0
            while got < q["n"]:
                got += tcp.recv_into(view[got : q["n"]])
        else:
            key = q["key"].encode()

            def landed(key: bytes = key) -> bool:
                seen.update(bytes(m) for msgs in ag.get_new_notifs().values() for m in msgs)
                return key in seen

            until(landed, q["poll"])
        send_json(ctl, {"t": time.perf_counter()})


def sender(addr: str, mbs: list[int], descs: list[int], polls: list[float], repeat: int, slack_ns: int,
           idle_s: float = 0.0, busy: bool = False) -> dict:
    import numpy as np

    timer_slack(slack_ns)
    size = max(mbs) << 20
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    ag = agent("tx")
    ag.register_memory([(src.ctypes.data, size, 0, "")], "DRAM")
    ctl = socket.create_connection((addr, CTL_PORT), timeout=30)
    lines = ctl.makefile("r")
    peer = json.loads(lines.readline())
    ag.add_remote_agent(bytes.fromhex(peer["md"]))
    tcp = socket.create_connection((addr, TCP_PORT), timeout=30)
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def pause(s: float) -> None:
        if busy:  # a compute-bound prefill: the core stays busy
            end = time.perf_counter() + s
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(s)

    def socket_once(n: int) -> float:
        send_json(ctl, {"op": "socket", "n": n})
        pause(idle_s)  # --idle-ms: as a prefill worker's compute before its send
        t0 = time.perf_counter()
        tcp.sendall(memoryview(src)[:n])
        return json.loads(lines.readline())["t"] - t0

    def nixl_once(n: int, d: int, poll: float, key: str) -> float:
        piece = n // d
        send_json(ctl, {"op": "nixl", "key": key, "poll": poll})
        pause(idle_s)
        t0 = time.perf_counter()
        local = ag.get_xfer_descs([(src.ctypes.data + i * piece, piece, 0) for i in range(d)], "DRAM")
        remote = ag.get_xfer_descs([(peer["addr"] + i * piece, piece, 0) for i in range(d)], "DRAM")
        handle = ag.initialize_xfer("WRITE", local, remote, "rx", key.encode())
        if ag.transfer(handle) == "ERR":
            raise RuntimeError("NIXL refused the transfer")
        until(lambda: ag.check_xfer_state(handle) == "DONE", poll)
        t = json.loads(lines.readline())["t"] - t0
        ag.release_xfer_handle(handle)
        return t

    order = random.Random(0)
    out: dict[str, list[float]] = {}
    for mb in mbs:
        n = mb << 20
        kinds = [("socket", 0, 0.0)] + [("nixl", d, p) for d in descs for p in polls]
        for r in range(repeat + 1):  # the first round is a warm-up
            order.shuffle(kinds)
            for what, d, poll in kinds:
                name = f"{mb} MB socket" if what == "socket" else f"{mb} MB x{d} {'busy' if not poll else f'{poll * 1e6:g}us'}"
                t = socket_once(n) if what == "socket" else nixl_once(n, d, poll, f"{mb}-{d}-{poll}-{r}")
                if r:
                    out.setdefault(name, []).append(t)
    ctl.close()
    return out


def run_pair(env: dict[str, str], mbs: list[int], descs: list[int], polls: list[float], repeat: int,
             cpus: tuple[str, str] | None = None, slack_ns: int = 0, idle_s: float = 0.0,
             busy: bool = False) -> dict:
    sys.path.insert(0, str(HERE.parent))
    from netns_pair import HostPair

    pin_rx, pin_tx = (["taskset", "-c", c] for c in cpus) if cpus else ([], [])
    with HostPair() as pair:
        rx = pair.run(pair.ns_a, [*pin_rx, sys.executable, str(HERE), "receiver", pair.addr_a, str(max(mbs) << 20),
                                  str(slack_ns)],
                      env=env, stdout=subprocess.PIPE, text=True)
        try:
            for line in rx.stdout:  # NIXL logs on stdout too
                if line.strip() == "ready":
                    break
            else:
                raise SystemExit("the receiver did not start")
            tx = pair.run(pair.ns_b, [*pin_tx, sys.executable, str(HERE), "sender", pair.addr_a, json.dumps(mbs),
                                      json.dumps(descs), json.dumps(polls), str(repeat), str(slack_ns),
                                      str(idle_s), str(int(busy))],
                          env=env, stdout=subprocess.PIPE, text=True)
            try:
                out, _ = tx.communicate(timeout=600)
            finally:
                tx.kill()
                tx.wait(timeout=10)
        finally:
            rx.kill()
            rx.wait(timeout=10)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if tx.returncode or not lines:
        raise RuntimeError(f"the sender failed (exit {tx.returncode})")
    return json.loads(lines[-1])


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def report(title: str, rows: dict[str, list[float]]) -> None:
    print(title)
    print(f"{'':>18}  {'ms: q1':>7} {'median':>7} {'q3':>7}  {'socket/nixl, paired: q1':>23} {'median':>6} {'q3':>6}")
    for name, ts in sorted(rows.items(), key=lambda kv: (int(kv[0].split()[0]), "socket" not in kv[0], kv[0])):
        q1, med, q3 = quartiles(ts)
        line = f"{name:>18}  {q1 * 1e3:7.3f} {med * 1e3:7.3f} {q3 * 1e3:7.3f}"
        sock = rows.get(f"{name.split()[0]} MB socket")
        if sock is not None and "socket" not in name:
            r1, rm, r3 = quartiles([s / t for s, t in zip(sock, ts, strict=True)])
            line += f"  {r1:23.2f} {rm:6.2f} {r3:6.2f}"
        print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, nargs="+", default=[1])
    p.add_argument("--descs", type=int, nargs="+", default=[1, 16])
    p.add_argument("--polls-us", type=float, nargs="+", default=[50.0],
                   help="0: busy polling (on 2 busy cores: 10-20 ms a 1 MB write, 20x the 50 us polls)")
    p.add_argument("--repeat", type=int, default=60, help="interleaved rounds (after one warm-up round)")
    p.add_argument("--sweep", action="store_true", help="every UCX setting of SWEEP, instead of the environment's")
    p.add_argument("--only", nargs="+", default=None, help="with --sweep: these settings of SWEEP only")
    p.add_argument("--rounds", type=int, default=1, help="with --sweep: passes over the settings")
    p.add_argument("--cpus", nargs=2, default=None, metavar=("RX", "TX"),
                   help="pin the receiver and the sender to these CPU lists (taskset -c)")
    p.add_argument("--slack-ns", type=int, default=1000,
                   help="each side's timer slack (prctl), as the mesh's progress thread; 0: Linux's 50 us")
    p.add_argument("--idle-ms", type=float, default=0.0,
                   help="the sender sleeps this long before each transfer, socket and nixl alike (as the mesh "
                        "bench's --compute-ms: a process that idled runs its next millisecond slower)")
    p.add_argument("--busy", action="store_true", help="with --idle-ms: spin instead of sleeping (a CPU-bound prefill)")
    p.add_argument("--json", type=Path, default=None, help="append every run's raw times here (one JSON line each)")
    args = p.parse_args()
    polls = [u / 1e6 for u in args.polls_us]
    if args.sweep:
        names = args.only or list(SWEEP)
        unknown = [n for n in names if n not in SWEEP]
        if unknown:
            raise SystemExit(f"no such setting: {', '.join(unknown)} (known: {', '.join(SWEEP)})")
        runs = [(f"{n} (pass {i + 1})", {"UCX_TLS": "tcp", **SWEEP[n]}) for i in range(args.rounds) for n in names]
    else:
        env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")} or {"UCX_TLS": "tcp", **SEG256K}
        if env.get("UCX_TLS") != "tcp":
            raise SystemExit("set UCX_TLS=tcp: other transports (shared memory) would cross the namespaces")
        runs = [("environment", env)]
    for name, env in runs:
        load = loadavg()
        name += f", cpus rx {args.cpus[0]} tx {args.cpus[1]}" if args.cpus else ""
        name += f", slack {args.slack_ns} ns" if args.slack_ns else ", default slack"
        if args.idle_ms:
            name += f", sender {'spins' if args.busy else 'sleeps'} {args.idle_ms:g} ms before each"
        settings = " ".join(f"{k}={v}" for k, v in env.items())
        try:
            rows = run_pair(env, args.mb, args.descs, polls, args.repeat, args.cpus, args.slack_ns, args.idle_ms / 1e3,
                            args.busy)
        except RuntimeError as e:  # e.g. UCX_PROTO_ENABLE=n: NIXL's UCX backend refuses to post
            print(f"== {name}: {settings}: {e}", flush=True)
            continue
        report(f"== {name}: {settings}; {args.repeat} interleaved rounds, {time.strftime('%H:%M:%S')}, "
               f"load {load} -> {loadavg()}", rows)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps({"name": name, "env": env, "load": load, "rows": rows}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "receiver":
        receiver(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "sender":
        print(json.dumps(sender(sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]),
                                json.loads(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), float(sys.argv[8]),
                                bool(int(sys.argv[9])))),
              flush=True)
    else:
        main()
