"""KV transfer throughput: shm and nats against an in-process memcpy of the same bytes.

A receiver process plays the decode worker: its KV pool lives in shared
memory and it runs the real ``NatsReceiver``. This process plays the prefill
worker with the real senders. One transfer moves a whole prompt's KV (2k or
32k tokens of the ``small`` model: 10 layers x 5 KV heads x 64 dims, fp32,
25.6 KB per token) and ends when the bytes are in the receiver's blocks.

    python -m bench transfer [--tokens 2048 32768] [--repeat 3] [--fragmented]

Between two simulated hosts (network namespaces on a veth pair; root): nixl against a plain TCP
socket and the nats channel over the same link (``bench/kv/transfer_hosts.py``):

    sudo python -m bench transfer --transport nixl --hosts 2 [--mb 1 16 256] [--repeat 5]
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.kv import transfer_hosts
from kvstore.cache import KVCache, KVCacheSpec
from kvstore.transfer import TransferTarget, host_id, make_receiver, make_sender
from mesh.bus import Bus
from mesh.natsserver import EmbeddedNats

BENCHMARK = Benchmark(
    name="transfer",
    measures="GB/s of one prompt's KV over shm and nats between two processes, against an in-process memcpy; "
             "--hosts 2: nixl against a TCP socket and nats between two network namespaces (root)",
    target="shm >= 0.5x memcpy; between hosts nixl >= 0.8x the socket and >= 3x nats (issue 31)",
    minutes=1,
    smoke=("--tokens", "64", "--repeat", "1"),
)
LAYERS, HEADS, DIM, BS = 10, 5, 64, 16
MODEL, WORKER = "small", "bench-decode"


def spec(num_blocks: int) -> KVCacheSpec:
    return KVCacheSpec(LAYERS, num_blocks, BS, HEADS, DIM, torch.float32)


def receiver_main(url: str, shm_path: str, num_blocks: int, ready) -> None:
    asyncio.run(_receiver(url, shm_path, num_blocks, ready))


async def _receiver(url, shm_path, num_blocks, ready) -> None:
    kv = KVCache(spec(num_blocks), torch.device("cpu"), shm_path=shm_path)
    bus = await Bus.connect(url, "bench-receiver")
    rx = make_receiver("nats", kv=kv, bus=bus, model=MODEL, worker_id=WORKER)
    await rx.start()

    async def on_expect(msg):
        rid, blocks = msg.data.decode().split(":", 1)
        await msg.respond(str(rx.params(rid, [int(b) for b in blocks.split(",")])["bytes"]).encode())

    async def on_finish(msg):
        ok = await rx.finish(msg.data.decode())
        await msg.respond(b"ok" if ok else b"fail")

    await bus.nc.subscribe("bench.expect", cb=on_expect)
    await bus.nc.subscribe("bench.finish", cb=on_finish)
    await bus.nc.flush()
    ready.set()
    await asyncio.Event().wait()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def run(args) -> dict:
    max_tokens = max(args.tokens)
    num_blocks = -(-max_tokens // BS) + 8
    from kvstore.transfer.shm import segment_name
    from kvstore.transfer.shm import shm_path as kv_file

    with EmbeddedNats() as nats:
        shm_path = kv_file(f"bench-{os.getpid()}")  # the shm transport serves files of its own directory only
        atexit.register(lambda: Path(shm_path).unlink(missing_ok=True))
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=receiver_main, args=(nats.url, shm_path, num_blocks, ready), daemon=True)
        proc.start()
        if not ready.wait(60):
            raise SystemExit("receiver did not start")
        src = KVCache(spec(num_blocks), torch.device("cpu"))
        src.tensor.normal_()
        bus = await Bus.connect(nats.url, "bench-sender")
        senders = {"shm": make_sender("shm", bus=bus), "nats": make_sender("nats", bus=bus)}
        shm_params = {"name": segment_name(shm_path), "host": host_id(), "spec": spec(num_blocks).to_dict()}
        dst_view = KVCache.attach(spec(num_blocks), shm_path)
        rows = []
        for tokens in args.tokens:
            n = -(-tokens // BS)
            src_ids = list(range(n))
            dst_ids = list(range(n))
            if args.fragmented:
                g = torch.Generator().manual_seed(0)
                dst_ids = torch.randperm(num_blocks, generator=g)[:n].tolist()
            nbytes = n * spec(1).block_bytes
            flat = src.read_block_major(src_ids).view(-1)
            out = torch.empty_like(flat)
            memcpy = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                out.copy_(flat)
                memcpy.append(time.perf_counter() - t0)
            results = {"memcpy": statistics.median(memcpy)}
            for name, sender in senders.items():
                times = []
                for r in range(args.repeat):
                    rid = f"t{tokens}-{name}-{r}"
                    target = TransferTarget(rid, WORKER, dst_ids, BS)
                    if name == "nats":
                        reply = await bus.nc.request("bench.expect", f"{rid}:{','.join(map(str, dst_ids))}".encode(), 10)
                        params = {"subject": bus.subjects.kv_data(MODEL, WORKER, rid), "bytes": int(reply.data)}
                    else:
                        params = shm_params
                    t0 = time.perf_counter()
                    await sender.send(target, params, src, src_ids)
                    if name == "nats":
                        done = await bus.nc.request("bench.finish", rid.encode(), 60)
                        assert done.data == b"ok"
                    times.append(time.perf_counter() - t0)
                    # the receiver's blocks now hold exactly our bytes
                    assert torch.equal(dst_view.read_blocks(dst_ids), src.read_blocks(src_ids)), name
                results[name] = statistics.median(times)
            rows.append((tokens, nbytes, results))
        await bus.close()
        proc.kill()
    layout = "fragmented destination blocks" if args.fragmented else "consecutive destination blocks"
    print(f"KV transfer, small model ({LAYERS} layers x {HEADS} KV heads x {DIM} dims, fp32), {layout}, "
          f"median of {args.repeat}")
    print(f"{'tokens':>7} {'MB':>8} | {'memcpy GB/s':>11} | {'shm GB/s':>9} {'x memcpy':>8} | "
          f"{'nats GB/s':>9} {'x memcpy':>8}")
    for tokens, nbytes, r in rows:
        m = gbps(nbytes, r["memcpy"])
        s = gbps(nbytes, r["shm"])
        n = gbps(nbytes, r["nats"])
        print(f"{tokens:>7} {nbytes / 1e6:>8.1f} | {m:>11.2f} | {s:>9.2f} {s / m:>8.2f} | {n:>9.2f} {n / m:>8.2f}")
    return {"hosts": 1, "layout": "fragmented" if args.fragmented else "consecutive", "repeat": args.repeat,
            "rows": [{"tokens": tokens, "bytes": nbytes, **{f"{k}_gbps": gbps(nbytes, v) for k, v in r.items()}}
                     for tokens, nbytes, r in rows]}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fragmented", action="store_true", help="scatter the destination blocks")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                   help="2: between two network namespaces (root), against a TCP socket and nats")
    p.add_argument("--transport", default="nixl", help="with --hosts 2: the transport to compare (nixl)")
    p.add_argument("--mb", type=int, nargs="+", default=[1, 16, 256], help="with --hosts 2: MB per transfer")
    p.add_argument("--compute-ms", type=float, default=50.0,
                   help="with --hosts 2: ms between taking a job (nixl asks its grant) and sending (the prefill)")
    p.add_argument("--hot-socket", action="store_true",
                   help="with --hosts 2: the socket sends without the --compute-ms idle before (as before 2026-12-03)")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.hosts == 2:
        # UCX over TCP with 256k segments (8k/64k by default: 16 MB writes at half the speed);
        # any UCX_* variable given replaces these
        env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")} or {
            "UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}
        if args.dry_run:
            rows = transfer_hosts.plan(args.mb, args.repeat, args.transport, env, args.compute_ms, not args.hot_socket)
        else:
            rows = transfer_hosts.run_hosts(args.mb, args.repeat, args.transport, env, args.compute_ms,
                                            not args.hot_socket)
        figures = transfer_hosts.report(rows, args.repeat, env)
        print(f"(the socket's sender {'sends at once' if args.hot_socket else f'idles {args.compute_ms:g} ms before each send, as the others'})")
        return emit(BENCHMARK, figures, args)
    if args.dry_run:
        n = -(-max(args.tokens) // BS)
        print(f"DRY RUN: a receiver process with a shm KV pool of {n + 8} blocks, then shm and nats transfers of "
              f"{', '.join(map(str, args.tokens))} tokens, {args.repeat} each")
        return emit(BENCHMARK, {"hosts": 1, "layout": "fragmented" if args.fragmented else "consecutive",
                                "repeat": args.repeat, "rows": []}, args)
    return emit(BENCHMARK, asyncio.run(run(args)), args)
