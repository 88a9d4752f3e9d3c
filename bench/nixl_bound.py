"""What NIXL/UCX alone can do between two simulated hosts, against the same plain TCP socket
``bench/transfer.py --hosts 2`` compares with: the bound for the mesh's nixl transport.

Two network namespaces on a veth pair (``bench/netns_pair.py``, root). No asyncio, no NATS, no
grant: each side is one plain loop. The sender WRITEs N MB (as 1 descriptor, or as 16: one per
(layer, K|V) plane, as a run of the pool's blocks is) with a notification, and polls the transfer
every ``--poll-us``; the receiver polls its notifications as often. A transfer is timed from the
sender starting until the receiver has the notification (socket: its last ``recv_into``), on the
receiver's clock (CLOCK_MONOTONIC, one kernel); a control connection carries the times back.

    sudo python bench/nixl_bound.py [--mb 1 16] [--descs 1 16] [--repeat 9] [--poll-us 50]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

CTL_PORT, TCP_PORT = 17501, 17502
HERE = Path(__file__).resolve()


def agent(name: str):
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                              sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))


def send_json(sock: socket.socket, obj) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def until(predicate, poll_s: float) -> None:
    while not predicate():
        time.sleep(poll_s)


def receiver(addr: str, size: int, poll_s: float) -> None:
    import numpy as np

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

            until(landed, poll_s)
        send_json(ctl, {"t": time.perf_counter()})


def sender(addr: str, mbs: list[int], descs: list[int], repeat: int, poll_s: float) -> dict:
    import numpy as np

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
    out: dict[str, list[float]] = {}
    for mb in mbs:
        n = mb << 20
        for r in range(repeat + 1):  # the first of each is a warm-up
            send_json(ctl, {"op": "socket", "n": n})
            t0 = time.perf_counter()
            tcp.sendall(memoryview(src)[:n])
            t = json.loads(lines.readline())["t"] - t0
            if r:
                out.setdefault(f"{mb} MB socket", []).append(t)
        for d in descs:
            piece = n // d
            for r in range(repeat + 1):
                key = f"{mb}-{d}-{r}"
                send_json(ctl, {"op": "nixl", "key": key})
                t0 = time.perf_counter()
                local = ag.get_xfer_descs([(src.ctypes.data + i * piece, piece, 0) for i in range(d)], "DRAM")
                remote = ag.get_xfer_descs([(peer["addr"] + i * piece, piece, 0) for i in range(d)], "DRAM")
                handle = ag.initialize_xfer("WRITE", local, remote, "rx", key.encode())
                if ag.transfer(handle) == "ERR":
                    raise RuntimeError("NIXL refused the transfer")
                until(lambda h=handle: ag.check_xfer_state(h) == "DONE", poll_s)
                t = json.loads(lines.readline())["t"] - t0
                ag.release_xfer_handle(handle)
                if r:
                    out.setdefault(f"{mb} MB nixl x{d}", []).append(t)
    ctl.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, nargs="+", default=[1, 16])
    p.add_argument("--descs", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--poll-us", type=float, default=50.0)
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent))
    import subprocess

    from netns_pair import HostPair

    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")} or {
        "UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}
    poll = str(args.poll_us / 1e6)
    with HostPair() as pair:
        rx = pair.run(pair.ns_a, [sys.executable, str(HERE), "receiver", pair.addr_a, str(max(args.mb) << 20), poll],
                      env=env, stdout=subprocess.PIPE, text=True)
        try:
            for line in rx.stdout:  # NIXL logs on stdout too
                if line.strip() == "ready":
                    break
            tx = pair.run(pair.ns_b, [sys.executable, str(HERE), "sender", pair.addr_a, json.dumps(args.mb),
                                      json.dumps(args.descs), str(args.repeat), poll],
                          env=env, stdout=subprocess.PIPE, text=True)
            out, _ = tx.communicate(timeout=600)
        finally:
            rx.kill()
            rx.wait(timeout=10)
    rows = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
    print(f"NIXL/UCX alone vs a TCP socket, two namespaces ({', '.join(f'{k}={v}' for k, v in env.items())}), "
          f"polled every {args.poll_us:g} us, median of {args.repeat}")
    for name, ts in rows.items():
        mb = int(name.split()[0])
        med = statistics.median(ts)
        print(f"{name:>18}: {med * 1e3:7.2f} ms  {mb * (1 << 20) / med / 1e9:6.2f} GB/s  "
              f"(all: {' '.join(f'{t * 1e3:.2f}' for t in ts)})")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "receiver":
        receiver(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "sender":
        print(json.dumps(sender(sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]),
                                int(sys.argv[5]), float(sys.argv[6]))), flush=True)
    else:
        main()
