"""KV transfer between two simulated hosts (``python -m bench transfer --hosts 2``): nixl against a plain
TCP socket and the nats channel, over the same veth link, in the same run.

Host A (a network namespace) runs the nats-server and the receiver (the decode worker's side: a
KV pool with the real ``NatsReceiver`` and ``NixlReceiver``, and a TCP server that ``recv_into``s
a buffer); host B runs the sender (the real senders; ``sendall`` for the socket). One transfer
moves N MB of consecutive blocks (256 KB each: 8 layers x 4 KV heads x 64 dims x 16 tokens,
fp32). Each is timed as the mesh pays it: from the sender starting until the receiver knows the
bytes are in its blocks (nats: the receiver's ``finish`` returned, after a one-way message like
the PrefillDone the real path sends; nixl: the PrefillDone came in the notification after the
bytes, as the decode worker takes it) or in its buffer (socket: its last ``recv_into``). The
receiver reads the clock there (CLOCK_MONOTONIC: one kernel, so one clock for both namespaces)
and says when in its untimed answer. nixl's write grant is asked before, as the prefill worker
asks it when it takes a job, and ``--compute-ms`` pass before the send as the prefill's compute
would (the receiver's progress thread is then past its fast polls, as in the mesh). The socket's
sender waits as long before each transfer (``--hot-socket``: it does not): a process that idled
50 ms on a busy machine runs its next millisecond 2x slower than one that did not (cold caches,
a wake-up to wait for: the same 1 MB nixl send took 1.4-2.1 ms right after its grant and 2.4-4.9
ms 50 ms after it, load 7-14), and before 2026-12-03 evening only the socket ran hot. Root only.

    sudo python -m bench transfer --transport nixl --hosts 2 [--mb 1 16 256] [--repeat 5]

The two sides run this module in their namespaces: ``python -m bench.kv.transfer_hosts receiver|sender``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

LAYERS, HEADS, DIM, BS = 8, 4, 64, 16
MODEL, WORKER = "bench", "bench-decode"
TCP_PORT, NATS_PORT = 17411, 17422
ROOT = Path(__file__).resolve().parents[2]
SIDE = [sys.executable, "-m", "bench.kv.transfer_hosts"]  # one side of the transfer, in a namespace


def spec(num_blocks: int):
    from kvstore.cache import KVCacheSpec

    return KVCacheSpec(LAYERS, num_blocks, BS, HEADS, DIM, torch.float32)


def digest(kv, ids: list[int]) -> str:
    return hashlib.sha1(kv.read_blocks(ids).contiguous().numpy().tobytes()).hexdigest()


# -- host A: the receiver ------------------------------------------------------------------
def tcp_server(addr: str, max_bytes: int) -> None:
    buf = bytearray(max_bytes)
    srv = socket.create_server((addr, TCP_PORT))
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            view = memoryview(buf)
            while (head := conn.recv(8, socket.MSG_WAITALL)) and len(head) == 8:
                n, got = int.from_bytes(head, "little"), 0
                while got < n:
                    k = conn.recv_into(view[got:n])
                    if not k:
                        return
                    got += k
                conn.sendall(struct.pack("<d", time.perf_counter()))  # when the bytes were all in


async def receiver(url: str, addr: str, num_blocks: int) -> None:
    from kvstore.cache import KVCache
    from kvstore.transfer import make_receiver
    from mesh.bus import Bus
    from mesh.protocol import PrefillDone, decode

    kv = KVCache(spec(num_blocks), torch.device("cpu"))
    threading.Thread(target=tcp_server, args=(addr, num_blocks * spec(1).block_bytes), daemon=True).start()
    bus = await Bus.connect(url, "bench-receiver")
    rxs = {n: make_receiver(n, kv=kv, bus=bus, model=MODEL, worker_id=WORKER) for n in ("nats", "nixl")}
    for rx in rxs.values():
        await rx.start()

    async def on_expect(msg):
        q = json.loads(msg.data)
        await msg.respond(json.dumps(rxs[q["transport"]].params(q["rid"], q["blocks"])).encode())

    def on_carried(rid: str, payload: bytes) -> None:  # nixl: the PrefillDone came in the notification
        landed = time.perf_counter()
        decode(payload, PrefillDone)  # as the decode worker does
        rxs["nixl"].forget(rid)
        finished[rid] = landed

    rxs["nixl"].on_done = on_carried

    async def on_finish(msg):  # the PrefillDone's part: the sender says it is done, one way
        q = json.loads(msg.data)
        ok = await rxs[q["transport"]].finish(q["rid"])
        landed = time.perf_counter()
        rxs[q["transport"]].forget(q["rid"])
        finished[q["rid"]] = landed if ok else -1.0

    async def on_when(msg):  # untimed: when the finish above returned
        rid = json.loads(msg.data)["rid"]
        for _ in range(1000):
            if rid in finished:
                break
            await asyncio.sleep(0.01)
        await msg.respond(json.dumps(finished.pop(rid, -1.0)).encode())

    finished: dict[str, float] = {}

    async def on_digest(msg):  # untimed: what the receiver's blocks hold
        await msg.respond(digest(kv, json.loads(msg.data)["blocks"]).encode())

    await bus.nc.subscribe("bench.expect", cb=on_expect)
    await bus.nc.subscribe("bench.finish", cb=on_finish)
    await bus.nc.subscribe("bench.when", cb=on_when)
    await bus.nc.subscribe("bench.digest", cb=on_digest)
    await bus.nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


# -- host B: the sender --------------------------------------------------------------------
async def sender(url: str, addr_a: str, mbs: list[int], repeat: int, transports: list[str], compute_s: float,
                 socket_idle: bool) -> None:
    from kvstore.cache import KVCache
    from kvstore.transfer import TransferTarget, make_sender
    from mesh.bus import Bus
    from mesh.protocol import PrefillDone, encode

    bb = spec(1).block_bytes
    n_max = max(mbs) * (1 << 20) // bb
    src = KVCache(spec(n_max), torch.device("cpu"))
    src.tensor.normal_()
    bus = await Bus.connect(url, "bench-sender")
    senders = {n: make_sender(n, bus=bus, worker_id="bench-prefill") for n in transports if n != "socket"}
    sock = socket.create_connection((addr_a, TCP_PORT), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def one(name: str, rid: str, ids: list[int], check: bool) -> tuple[float, float]:
        """(seconds in all, of which the sender's ``send``)."""
        if name == "socket":
            payload = memoryview(src.read_block_major(ids).view(-1).view(torch.uint8).numpy())
            if socket_idle:
                await asyncio.sleep(compute_s)  # the same idle sender as the others' (see the docstring)
            t0 = time.perf_counter()
            landed = await asyncio.to_thread(_socket_send, sock, payload)
            return landed - t0, time.perf_counter() - t0
        q = {"transport": name, "rid": rid, "blocks": ids}
        params = json.loads((await bus.nc.request("bench.expect", json.dumps(q).encode(), 10)).data)
        target = TransferTarget(rid, WORKER, ids, BS)
        if hasattr(senders[name], "prepare"):  # as the prefill worker does when it takes the job
            senders[name].prepare(target, params, src)
        await asyncio.sleep(compute_s)  # the prefill computes
        carries = getattr(senders[name], "carries_done", False)
        t0 = time.perf_counter()
        if carries:  # the PrefillDone rides in the notification, as the prefill worker sends it
            done = PrefillDone(request_id=rid, prefill_worker="bench-prefill", ok=True, token_id=1234,
                               transport=name, transfer_bytes=len(ids) * bb, compute_ms=compute_s * 1000,
                               token="0" * 32)
            await senders[name].send(target, params, src, ids, done=encode(done))
        else:
            await senders[name].send(target, params, src, ids)
        sent = time.perf_counter() - t0
        if not carries:
            await bus.nc.publish("bench.finish", json.dumps(q).encode())
        landed = json.loads((await bus.nc.request("bench.when", json.dumps(q).encode(), 60)).data)
        assert landed > 0, f"{name}: the receiver's finish failed"
        seconds = landed - t0
        if check:  # the receiver's blocks hold exactly our bytes
            theirs = await bus.nc.request("bench.digest", json.dumps(q).encode(), 60)
            assert theirs.data.decode() == digest(src, ids), f"{name}: the bytes differ"
        return seconds, sent

    rows = []
    for name in transports:  # warm-up: connections, the peer's metadata, registration
        await one(name, f"warm-{name}", list(range(4)), check=True)
    for mb in mbs:
        ids = list(range(mb * (1 << 20) // bb))
        for name in transports:
            times = [await one(name, f"{mb}-{name}-{r}", ids, check=r == 0) for r in range(repeat)]
            rows.append({"mb": mb, "transport": name, "seconds": [t for t, _ in times], "send": [s for _, s in times]})
    print("RESULT " + json.dumps(rows), flush=True)
    sock.close()
    await bus.close()


def _socket_send(sock: socket.socket, payload: memoryview) -> float:
    """When the receiver had every byte (its clock)."""
    sock.sendall(len(payload).to_bytes(8, "little"))
    sock.sendall(payload)
    ack = sock.recv(8, socket.MSG_WAITALL)
    if len(ack) != 8:
        raise RuntimeError("the socket receiver did not ack")
    return struct.unpack("<d", ack)[0]


# -- the driver (root namespace) -----------------------------------------------------------
def plan(mbs: list[int], repeat: int, transport: str, env: dict[str, str], compute_ms: float = 50.0,
         socket_idle: bool = True) -> list[dict]:
    """What ``run_hosts`` would run, printed, and its rows' shape with no times (the dry run)."""
    from bench.common.netns_pair import HostPair

    pair = HostPair()
    num_blocks = max(mbs) * (1 << 20) // spec(1).block_bytes + 8
    url = f"nats://{pair.addr_a}:{NATS_PORT}"
    print(f"DRY RUN: namespaces {pair.ns_a} ({pair.addr_a}) and {pair.ns_b} ({pair.addr_b}) on a veth pair; env "
          f"{env}\n  {pair.ns_a}: nats-server -a {pair.addr_a} -p {NATS_PORT} -js; "
          f"{' '.join(SIDE[1:])} receiver {url} {pair.addr_a} {num_blocks}\n  {pair.ns_b}: {' '.join(SIDE[1:])} "
          f"sender {url} {pair.addr_a} {json.dumps(mbs)} {repeat} {','.join(_transports(transport))} "
          f"{compute_ms / 1000} {int(socket_idle)}")
    return [{"mb": mb, "transport": t, "seconds": [], "send": []} for mb in mbs for t in _transports(transport)]


def _transports(transport: str) -> list[str]:
    return ["socket", "nats", transport] if transport not in ("socket", "nats") else ["socket", "nats"]


def run_hosts(mbs: list[int], repeat: int, transport: str, env: dict[str, str], compute_ms: float = 50.0,
              socket_idle: bool = True) -> list[dict]:
    from bench.common.netns_pair import HostPair
    from mesh.natsserver import find_binary

    transports = _transports(transport)
    num_blocks = max(mbs) * (1 << 20) // spec(1).block_bytes + 8
    procs: list[subprocess.Popen] = []
    env = {**env, "PYTHONPATH": str(ROOT)}
    js_dir = tempfile.mkdtemp(prefix="pdmx-js-")  # the nats-server's JetStream store, removed after
    with HostPair() as pair:
        url = f"nats://{pair.addr_a}:{NATS_PORT}"
        try:
            procs.append(pair.run(pair.ns_a, [find_binary(), "-a", pair.addr_a, "-p", str(NATS_PORT), "-js", "-sd",
                                              js_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(0.5)
            rx = pair.run(pair.ns_a, [*SIDE, "receiver", url, pair.addr_a, str(num_blocks)],
                          env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            procs.append(rx)
            for line in rx.stdout:  # NIXL logs on stdout too
                if line.strip() == "ready":
                    break
            else:
                raise SystemExit("the receiver did not start")
            tx = pair.run(pair.ns_b, [*SIDE, "sender", url, pair.addr_a, json.dumps(mbs),
                                      str(repeat), ",".join(transports), str(compute_ms / 1000), str(int(socket_idle))],
                          env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            procs.append(tx)
            out, _ = tx.communicate(timeout=1200)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if tx.returncode or not lines:
                raise SystemExit(f"the sender failed (exit {tx.returncode})")
            return json.loads(lines[-1][len("RESULT "):])
        finally:
            for p in reversed(procs):
                p.kill()
                p.wait(timeout=10)
            shutil.rmtree(js_dir, ignore_errors=True)


def report(rows: list[dict], repeat: int, env: dict[str, str]) -> dict:
    """Prints the GB/s table; returns the figures (GB/s per size and transport, the ratios, every time)."""
    by = {(r["mb"], r["transport"]): statistics.median(r["seconds"]) if r["seconds"] else float("nan")
          for r in rows}
    names = list(dict.fromkeys(r["transport"] for r in rows))
    print(f"KV transfer between two network namespaces over a veth pair ({', '.join(f'{k}={v}' for k, v in env.items())}),"
          f" median of {repeat}, GB/s (1e9 bytes/s)")
    print(f"{'MB':>5} | " + " | ".join(f"{n:>8}" for n in names)
          + (" | nixl/socket | nixl/nats" if "nixl" in names else ""))
    sizes = []
    for mb in dict.fromkeys(r["mb"] for r in rows):
        g = {n: mb * (1 << 20) / by[(mb, n)] / 1e9 for n in names}
        sizes.append({"mb": mb, **{f"{n}_gbps": v for n, v in g.items()}})
        line = f"{mb:>5} | " + " | ".join(f"{g[n]:>8.3f}" for n in names)
        if "nixl" in g:
            line += f" | {g['nixl'] / g['socket']:>11.2f} | {g['nixl'] / g['nats']:>9.2f}"
        print(line)
    for r in rows:
        print(f"  {r['mb']:>4} MB {r['transport']:>6}: " + " ".join(f"{s * 1000:.1f}" for s in r["seconds"])
              + " ms (sender side: " + " ".join(f"{s * 1000:.1f}" for s in r["send"]) + ")")
    return {"hosts": 2, "env": env, "repeat": repeat, "sizes": sizes, "transfers": rows}


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "receiver":
        asyncio.run(receiver(rest[0], rest[1], int(rest[2])))
    elif role == "sender":
        asyncio.run(sender(rest[0], rest[1], json.loads(rest[2]), int(rest[3]), rest[4].split(","), float(rest[5]),
                           rest[6] == "1"))
