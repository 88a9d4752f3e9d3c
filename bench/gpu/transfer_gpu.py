"""KV transfer throughput on GPU: cuda_ipc and nccl next to a device-to-device memcpy of the same bytes.

A receiver process plays the decode worker: its KV pool on CUDA, the real
``cuda_ipc`` and ``nccl`` receivers. This process plays the prefill worker with
the real senders. One transfer moves one prompt's KV of an 8B-shaped model
(32 layers x 8 KV heads x 128 dims, bf16, 16-token blocks: 128 KiB per token,
so 256 MiB for 2k tokens and 4 GiB for 32k) from consecutive source blocks
into the receiver's blocks, consecutive or scattered (``fragmented``, as a busy
decode pool hands them out).

A transfer ends when the bytes are in the destination blocks: ``cuda_ipc`` when
``send()`` returns (it synchronizes its copy); ``nccl`` when the receiver's
``finish()`` returns (it scatters the staging buffer), one NATS round trip later.
Each row also shows, in this process, a flat device-to-device copy of the same
number of bytes (``memcpy``, the ceiling) and the block copy ``cuda_ipc`` does,
into a local pool (``blocks``: what the strided copy costs without IPC).

With one GPU both processes share it. NCCL refuses two ranks on one GPU, so the
two processes get different NCCL_HOSTID values and NCCL moves the bytes through
its socket transport over loopback: that column then measures NCCL's network
path, not NVLink, and says so. With two GPUs the receiver uses the second one.

    python -m bench transfer-gpu [--tokens 2048 32768] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time

import torch

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from kvstore.cache import KVCache, KVCacheSpec
from kvstore.transfer import TransferTarget, make_receiver, make_sender
from kvstore.transfer.cuda_ipc import cupy_module
from kvstore.transfer.nccl import nccl_module
from mesh.bus import Bus
from mesh.natsserver import EmbeddedNats

BENCHMARK = Benchmark(
    name="transfer-gpu",
    measures="GB/s of one prompt's KV (8B shape, bf16) over cuda_ipc and nccl between two processes, beside a "
             "device memcpy and a local block copy, consecutive and scattered blocks (CUDA)",
    minutes=2,
    smoke=("--dry-run",),
)
LAYERS, HEADS, DIM, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
MODEL, WORKER = "bench-8b", "bench-gpu-decode"
TRANSPORTS = ("cuda_ipc", "nccl")


def spec(num_blocks: int) -> KVCacheSpec:
    return KVCacheSpec(LAYERS, num_blocks, BS, HEADS, DIM, DTYPE)


def one_gpu_nccl_env(role: str) -> dict[str, str]:
    return {"NCCL_HOSTID": f"pdmesh-bench-{role}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def digest(kv: KVCache, blocks: list[int]) -> str:
    data = kv.read_block_major(blocks).cpu().contiguous().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


# -- the receiver process -----------------------------------------------------------


def receiver_main(url: str, device: int, num_blocks: int, env: dict, ready) -> None:
    os.environ.update(env)
    asyncio.run(_receiver(url, device, num_blocks, ready))


async def _receiver(url: str, device: int, num_blocks: int, ready) -> None:
    kv = KVCache(spec(num_blocks), torch.device("cuda", device))
    bus = await Bus.connect(url, "bench-gpu-receiver")
    receivers = {}
    for name in TRANSPORTS:
        try:
            rx = make_receiver(name, kv=kv, bus=bus, model=MODEL, worker_id=WORKER)
        except ValueError as e:
            print(f"receiver: no {name}: {e}", file=sys.stderr)
            continue
        if hasattr(rx, "start"):
            await rx.start()
        receivers[name] = rx

    async def on_params(msg):
        q = json.loads(msg.data)
        rx = receivers.get(q["transport"])
        await msg.respond(json.dumps(rx.params(q["rid"], q["dest"]) if rx else None).encode())

    async def on_finish(msg):
        q = json.loads(msg.data)
        rx = receivers[q["transport"]]
        ok = await rx.finish(q["rid"])
        rx.forget(q["rid"])
        await msg.respond(b"ok" if ok else b"fail")

    async def on_digest(msg):
        await msg.respond(digest(kv, json.loads(msg.data)).encode())

    for subject, cb in (("bench.gpu.params", on_params), ("bench.gpu.finish", on_finish),
                        ("bench.gpu.digest", on_digest)):
        await bus.nc.subscribe(subject, cb=cb)
    await bus.nc.flush()
    ready.set()
    await asyncio.Event().wait()


# -- this process: the prefill side ------------------------------------------------


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed_sync(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def median_time(fn, repeat: int) -> float:
    return statistics.median(timed_sync(fn) for _ in range(repeat))


async def request(bus: Bus, subject: str, payload, timeout: float = 120.0) -> bytes:
    return (await bus.nc.request(subject, json.dumps(payload).encode(), timeout=timeout)).data


async def one_transfer(bus: Bus, sender, name: str, rid: str, src: KVCache, src_ids, dst_ids) -> float:
    params = json.loads(await request(bus, "bench.gpu.params", {"transport": name, "rid": rid, "dest": dst_ids}))
    if params is None or not sender.usable(params):
        raise RuntimeError(f"{name} is not usable between these processes")
    target = TransferTarget(rid, WORKER, dst_ids, BS)
    t0 = time.perf_counter()
    await sender.send(target, params, src, src_ids)
    elapsed = time.perf_counter() - t0
    done = await request(bus, "bench.gpu.finish", {"transport": name, "rid": rid})
    if done != b"ok":
        raise RuntimeError(f"{name}: the receiver did not get the bytes")
    if name == "nccl":  # its bytes are in place only once finish() has scattered them
        elapsed = time.perf_counter() - t0
    return elapsed


async def check_bytes(bus: Bus, src: KVCache, src_ids: list[int], dst_ids: list[int]) -> bool:
    """Sampled blocks (first, last, a few between) hold exactly our bytes on the receiver."""
    picks = sorted({0, len(src_ids) - 1, *random.Random(0).sample(range(len(src_ids)), min(6, len(src_ids)))})
    theirs = (await request(bus, "bench.gpu.digest", [dst_ids[i] for i in picks])).decode()
    return theirs == digest(src, [src_ids[i] for i in picks])


async def run(args) -> dict:
    rx_device = 1 if torch.cuda.device_count() >= 2 else 0
    one_gpu = rx_device == 0
    if one_gpu:
        os.environ.update(one_gpu_nccl_env("prefill"))
    nccl_path = "NCCL sockets over loopback (one GPU, NCCL_HOSTID per process)" if one_gpu else "NCCL, two GPUs"
    max_blocks = -(-max(args.tokens) // BS)
    num_blocks = max_blocks + 64
    block_bytes = spec(1).block_bytes
    rows = []
    with EmbeddedNats() as nats:
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        env = one_gpu_nccl_env("decode") if one_gpu else {}
        proc = ctx.Process(target=receiver_main, args=(nats.url, rx_device, num_blocks, env, ready), daemon=True)
        proc.start()
        if not await asyncio.to_thread(ready.wait, 120):
            raise SystemExit("python -m bench transfer-gpu: the receiver process did not start")
        src = KVCache(spec(num_blocks), torch.device("cuda", 0))
        src.tensor.normal_()
        local = KVCache(spec(num_blocks), torch.device("cuda", 0))
        bus = await Bus.connect(nats.url, "bench-gpu-sender")
        senders = {"cuda_ipc": make_sender("cuda_ipc", bus=bus)}
        if nccl_module() is not None:
            senders["nccl"] = make_sender("nccl", bus=bus)
        broken: dict[str, str] = {}
        for name, sender in senders.items():  # warm up: open the IPC handle, join the communicator
            try:
                await one_transfer(bus, sender, name, f"warm-{name}", src, [0], [0])
            except Exception as e:
                broken[name] = f"{type(e).__name__}: {e}"
                print(f"{name}: {broken[name]}", file=sys.stderr)
        for tokens in args.tokens:
            n = -(-tokens // BS)
            nbytes = n * block_bytes
            src_ids = list(range(n))
            flat = src.read_block_major(src_ids).view(-1)
            out = torch.empty_like(flat)
            memcpy = median_time(lambda o=out, f=flat: o.copy_(f), args.repeat)
            del flat, out
            for layout in ("consecutive", "fragmented"):
                dst_ids = list(range(n))
                if layout == "fragmented":
                    dst_ids = random.Random(tokens).sample(range(num_blocks), n)
                blocks = median_time(lambda s=src_ids, d=dst_ids: src.copy_blocks_to(local, s, d), args.repeat)
                row = {"tokens": tokens, "layout": layout, "bytes": nbytes, "memcpy_gbps": gbps(nbytes, memcpy),
                       "blocks_gbps": gbps(nbytes, blocks)}
                for name, sender in senders.items():
                    if name in broken:
                        continue
                    try:
                        times = [await one_transfer(bus, sender, name, f"{name}-{tokens}-{layout}-{r}", src,
                                                    src_ids, dst_ids) for r in range(args.repeat)]
                        row[f"{name}_gbps"] = gbps(nbytes, statistics.median(times))
                        row[f"{name}_bytes_ok"] = await check_bytes(bus, src, src_ids, dst_ids)
                    except Exception as e:
                        broken[name] = f"{type(e).__name__}: {e}"
                        print(f"{name}: {broken[name]}", file=sys.stderr)
                rows.append(row)
        for sender in senders.values():
            if hasattr(sender, "close"):
                await sender.close()
        await bus.close()
        proc.kill()
    return {
        "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "receiver_device": rx_device,
        "spec": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "block_size": BS, "dtype": "bfloat16",
                 "bytes_per_token": block_bytes // BS},
        "nccl_path": nccl_path if "nccl" in senders else "CuPy has no NCCL", "repeat": args.repeat,
        "failed": broken, "rows": rows,
    }


def print_table(res: dict) -> None:
    print(f"KV transfer on {res['device']} ({res['gpus']} GPU(s), receiver on cuda:{res['receiver_device']}), "
          f"8B-shaped KV: {LAYERS} layers x {HEADS} KV heads x {DIM} dims, bf16, {BS}-token blocks; "
          f"median of {res['repeat']}; nccl: {res['nccl_path']}")
    print(f"{'tokens':>7} {'MiB':>7} {'layout':>11} | {'memcpy':>8} {'blocks':>8} | {'cuda_ipc':>8} {'x memcpy':>8} | "
          f"{'nccl':>8} {'x memcpy':>8}   (GB/s)")
    for r in res["rows"]:
        m = r["memcpy_gbps"]
        cells = []
        for name in TRANSPORTS:
            v = r.get(f"{name}_gbps")
            if v is None:
                cells.append(f"{'-':>8} {'-':>8}")
            else:
                cells.append(f"{v:>8.1f} {v / m:>8.3f}" + ("" if r[f"{name}_bytes_ok"] else " BYTES DIFFER"))
        print(f"{r['tokens']:>7} {r['bytes'] / 2**20:>7.0f} {r['layout']:>11} | {m:>8.1f} {r['blocks_gbps']:>8.1f} | "
              + " | ".join(cells))
    for name, why in res["failed"].items():
        print(f"{name} failed: {why}")


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.dry_run:
        block_bytes = spec(1).block_bytes
        for tokens in args.tokens:
            print(f"DRY RUN: {tokens} tokens = {-(-tokens // BS)} blocks, {tokens * block_bytes // BS / 2**20:.0f} MiB "
                  f"per transfer; CuPy {'found' if cupy_module() else 'missing'}, NCCL "
                  f"{'found' if nccl_module() else 'missing'}")
        return emit(BENCHMARK, {"device": None, "gpus": 0, "receiver_device": None, "spec": {
            "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "block_size": BS, "dtype": "bfloat16",
            "bytes_per_token": block_bytes // BS}, "nccl_path": None, "repeat": args.repeat, "failed": {},
            "rows": []}, args)
    if not torch.cuda.is_available():
        sys.exit(f"python -m bench transfer-gpu: CUDA is not available here (torch {torch.__version__})")
    if cupy_module() is None:
        sys.exit("python -m bench transfer-gpu: CuPy is not installed (pip install cupy-cuda13x)")
    res = asyncio.run(run(args))
    print_table(res)
    emit(BENCHMARK, res, args)
    bad = [r for r in res["rows"] for t in TRANSPORTS if r.get(f"{t}_bytes_ok") is False]
    return 1 if bad or "cuda_ipc" in res["failed"] else 0
