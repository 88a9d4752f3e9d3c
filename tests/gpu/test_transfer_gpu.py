"""The GPU KV transports, ``cuda_ipc`` and ``nccl``, between real processes on CUDA.

Block level: a spawned process plays the decode worker (a KV cache on CUDA and
the real receiver); this process plays the prefill worker with the real
sender. Blocks of known bytes go into scattered destination blocks; the decode
side hashes what landed and checks that every other block is still zero.

Cluster level: a nats-server, a decode and a prefill worker of the tiny model, and
of the tiny DeepSeek-V3 (latent blocks: one plane per layer)
(``mesh worker ... --device cuda --transports T``), long greedy prompts; the
output equals a single-process engine run, and the decode worker's load report
counts prefills that came over ``T``.

With one GPU, NCCL refuses two ranks on it ("Duplicate GPU detected"), so the
two processes of an nccl test get different ``NCCL_HOSTID`` values: NCCL takes
them for two hosts and connects them over loopback sockets. With two GPUs the
decode side uses the second one and nothing is faked.

Skips cleanly (collected, reported as skipped) without CUDA or CuPy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing as mp
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("cupy")

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from kvstore.cache import KVCache, KVCacheSpec
from kvstore.transfer import TransferTarget, make_receiver, make_sender
from kvstore.transfer import nccl as nccl_transport
from kvstore.transfer.cuda_ipc import device_uuid, export_tensor
from mesh.bus import Bus
from mesh.client import generate
from mesh.natsserver import EmbeddedNats
from mesh.protocol import GenerateRequest, LoadReport, SamplingOptions
from mesh.registry import Membership
from tests.helpers.cluster import wait_until
from tests.helpers.procs import stop_processes

pytestmark = pytest.mark.gpu

# Under 1 MB, so PyTorch's allocator puts it inside a shared 2 MB segment: the IPC offset is not 0.
SPEC = KVCacheSpec(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
SRC_SPEC = replace(SPEC, num_blocks=32)
MODEL, DECODE = "gpu-test", "gpu-test-decode"


def decode_device() -> int:
    return 1 if torch.cuda.device_count() >= 2 else 0


def nccl_env(role: str) -> dict[str, str]:
    """On one GPU NCCL must see two hosts; its network transport then runs over loopback."""
    if torch.cuda.device_count() >= 2:
        return {}
    return {"NCCL_HOSTID": f"pdmesh-test-{role}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def needs_nccl() -> None:
    if nccl_transport.nccl_module() is None:
        pytest.skip("CuPy has no NCCL here")


@pytest.fixture(scope="module")
def nats_url():
    with EmbeddedNats() as server:
        yield server.url


# -- the decode side: a process of its own ---------------------------------------


def decode_side(url: str, names: list[str], device: int, env: dict, conn) -> None:
    os.environ.update(env)  # before anything loads NCCL
    asyncio.run(_decode_side(url, names, device, conn))


async def _decode_side(url: str, names: list[str], device: int, conn) -> None:
    try:
        pad = torch.empty(512, dtype=torch.uint8, device=device)  # the KV tensor does not start its allocation
        kv = KVCache(SPEC, torch.device("cuda", device))
        bus = await Bus.connect(url, "test-decode-side")
        receivers = {}
        for name in names:
            rx = make_receiver(name, kv=kv, bus=bus, model=MODEL, worker_id=DECODE)
            if hasattr(rx, "start"):
                await rx.start()
            receivers[name] = rx
        conn.send(("ok", pad.data_ptr()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, *args = await asyncio.to_thread(conn.recv)
        if cmd == "stop":
            break
        try:
            if cmd == "params":
                out = receivers[args[0]].params(args[1], args[2])
            elif cmd == "finish":
                out = await receivers[args[0]].finish(args[1])
            elif cmd == "forget":
                out = receivers[args[0]].forget(args[1])
            elif cmd == "digest":  # (blocks to hash, every block written so far)
                others = [b for b in range(SPEC.num_blocks) if b not in set(args[1])]
                out = (digest(kv, args[0]), bool((kv.read_blocks(others) == 0).all()))
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    for rx in receivers.values():
        if hasattr(rx, "close"):
            await rx.close()
    await bus.close()


def digest(kv: KVCache, blocks: list[int]) -> str:
    data = kv.read_block_major(blocks).cpu().contiguous().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


class DecodeSide:
    """Start, command and stop the decode-side process."""

    def __init__(self, url: str, names: list[str], env: dict | None = None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decode_side, args=(url, names, decode_device(), env or {}, child), daemon=True)

    async def __aenter__(self) -> DecodeSide:
        self.proc.start()
        await self._reply(120)
        return self

    async def __aexit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("stop",))
        await asyncio.to_thread(self.proc.join, 20)
        if self.proc.is_alive():
            self.proc.kill()

    async def ask(self, *cmd, timeout: float = 60.0):
        self.conn.send(cmd)
        return await self._reply(timeout)

    async def _reply(self, timeout: float):
        # polled in a thread: this event loop keeps serving NATS meanwhile
        if not await asyncio.to_thread(self.conn.poll, timeout):
            raise AssertionError(f"the decode side did not answer in {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"decode side failed:\n{value}")
        return value


def source_cache() -> KVCache:
    src = KVCache(SRC_SPEC, torch.device("cuda", 0))
    g = torch.Generator(device="cuda").manual_seed(1)
    src.tensor.copy_(torch.randn(SRC_SPEC.shape, generator=g, device="cuda"))
    return src


def target(rid: str, dest: list[int]) -> TransferTarget:
    return TransferTarget(rid, DECODE, dest, SPEC.block_size)


async def transfer_and_check(name, sender, dec: DecodeSide, src: KVCache, transfers, written: list[int]):
    """Send each (rid, src blocks, dest blocks) concurrently, finish them, compare bytes."""
    params = {rid: await dec.ask("params", name, rid, d) for rid, _, d in transfers}
    for p in params.values():
        assert sender.usable(p)
    results = await asyncio.gather(*(sender.send(target(rid, d), params[rid], src, s) for rid, s, d in transfers))
    written += [b for _, _, d in transfers for b in d]
    for (rid, s, d), result in zip(transfers, results, strict=True):
        assert result.transport == name and result.bytes == len(s) * SPEC.block_bytes
        assert await dec.ask("finish", name, rid) is True
        got, untouched = await dec.ask("digest", d, written)
        assert got == digest(src, s), f"{rid}: the destination blocks differ from the source blocks"
        assert untouched, f"{rid}: a block outside the destination changed"
    return params


# -- block level -------------------------------------------------------------------


async def test_cuda_ipc_copies_blocks_bytewise_into_another_process(nats_url):
    src = source_cache()
    bus = await Bus.connect(nats_url, "test-prefill-side")
    sender = make_sender("cuda_ipc", bus=bus)
    written: list[int] = []
    try:
        async with DecodeSide(nats_url, ["cuda_ipc"]) as dec:
            # runs of consecutive ids on both sides, single blocks, a reversed run
            params = await transfer_and_check("cuda_ipc", sender, dec, src, [
                ("ipc-0", [3, 4, 5, 9, 10], [40, 41, 7, 8, 63]),
            ], written)
            p = params["ipc-0"]
            assert p["offset"] > 0, "the KV tensor should sit inside a larger allocation here"
            assert len(bytes.fromhex(p["handle"])) == 64
            await transfer_and_check("cuda_ipc", sender, dec, src, [
                ("ipc-1", list(range(12, 24)), list(range(30, 18, -1))),
                ("ipc-2", [0, 1], [50, 51]),
            ], written)
            assert not sender.usable({**p, "host": "another-host"})
            assert not sender.usable({**p, "pid": os.getpid()})  # no process opens its own handle
            assert not sender.usable({**p, "device_uuid": "no-such-gpu"})
    finally:
        await bus.close()


async def test_nccl_moves_blocks_bytewise_in_chunks_one_transfer_at_a_time(nats_url, monkeypatch):
    needs_nccl()
    for k, v in nccl_env("prefill").items():
        monkeypatch.setenv(k, v)
    # several sends per transfer, the last one shorter
    monkeypatch.setattr(nccl_transport, "CHUNK_BYTES", 3 * SPEC.block_bytes)
    src = source_cache()
    bus = await Bus.connect(nats_url, "test-prefill-side")
    sender = make_sender("nccl", bus=bus)
    written: list[int] = []
    try:
        async with DecodeSide(nats_url, ["nccl"], nccl_env("decode")) as dec:
            params = await transfer_and_check("nccl", sender, dec, src, [
                ("nccl-0", [3, 4, 5, 9, 10], [40, 41, 7, 8, 63]),  # connects first
            ], written)
            # concurrent sends share the communicator: the sender's lock orders them
            await transfer_and_check("nccl", sender, dec, src, [
                ("nccl-1", list(range(12, 24)), list(range(30, 18, -1))),
                ("nccl-2", [0, 1, 2, 6, 7, 8, 11], [50, 51, 52, 53, 54, 55, 56]),
                ("nccl-3", [31], [0]),
            ], written)
            # a request whose bytes never began is not finished, and forgetting it is harmless
            await dec.ask("params", "nccl", "never", [60])
            assert await dec.ask("finish", "nccl", "never") is False
            await dec.ask("params", "nccl", "dropped", [61])
            await dec.ask("forget", "nccl", "dropped")
            await transfer_and_check("nccl", sender, dec, src, [("nccl-4", [20], [62])], written)
            p = params["nccl-0"]
            if not nccl_transport.multi_rank_gpu_allowed():
                same_gpu = {**p, "nccl_host": nccl_transport.nccl_host(), "device_uuid": device_uuid(0)}
                assert not sender.usable(same_gpu)
    finally:
        await sender.close()
        await bus.close()


# -- cluster level -------------------------------------------------------------------


def spawn_worker(role: str, *flags: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "worker", role, *flags],
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env}, stdout=subprocess.DEVNULL, stderr=None,
    )


async def fresh_load(loads: dict[str, LoadReport], worker: str, timeout: float = 5.0) -> LoadReport:
    """The first load report of ``worker`` sent after now."""
    since = time.time()
    return await wait_until(lambda: (r := loads.get(worker)) and r.timestamp > since and r, timeout, "a load report",
                            interval=0.2)


async def run_prompt(bus: Bus, worker: str, model: str, rid: str, tokens: list[int], n: int) -> list[int]:
    req = GenerateRequest(rid, model, tokens, SamplingOptions(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    async for chunk in generate(bus, worker, req, first_timeout=120.0):
        assert chunk.error is None, chunk.error
        out += chunk.token_ids
    return out


def test_cuda_ipc_exports_from_a_thread_that_never_ran_cuda_work():
    # a worker builds its KV cache in the engine's thread and its receiver on the event loop's:
    # a thread without a current CUDA context must still find the allocation to export
    kv = KVCache(SPEC, torch.device("cuda", 0))
    out: dict = {}

    def export() -> None:
        try:
            out["exported"] = export_tensor(kv.tensor)
        except Exception as e:  # reported below, with the reason
            out["error"] = e

    t = threading.Thread(target=export)
    t.start()
    t.join(60)
    assert "error" not in out, out.get("error")
    handle, offset = out["exported"]
    assert len(handle) == 64 and offset == export_tensor(kv.tensor)[1]  # the offset seen from here


@pytest.mark.parametrize("family", ["tiny", "deepseek"])  # K/V blocks; latent ones (MLA: one plane)
@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
async def test_cluster_prefills_remotely_and_decodes_like_one_engine(transport, family, nats_url, request):
    if transport == "nccl":
        needs_nccl()
    tiny_model = request.getfixturevalue("tiny_model") if family == "tiny" else \
        request.getfixturevalue("deepseek_models")["deepseek"]
    model = Path(tiny_model).name
    decode_id, prefill_id = f"gpu-decode-{transport}-{family}", f"gpu-prefill-{transport}-{family}"
    common = ["--nats", nats_url, "--model", str(tiny_model), "--device-kv-blocks", "256",
              "--transports", transport]
    nccl = transport == "nccl"
    procs = [
        spawn_worker("decode", *common, "--device", f"cuda:{decode_device()}", "--worker-id", decode_id,
                     "--disagg-threshold", "16", "--prefill-timeout", "60",
                     env=nccl_env("decode") if nccl else {}),
        spawn_worker("prefill", *common, "--device", "cuda:0", "--worker-id", prefill_id,
                     env=nccl_env("prefill") if nccl else {}),
    ]
    bus = await Bus.connect(nats_url, "test-client")
    members = Membership(bus)
    loads: dict[str, LoadReport] = {}

    async def on_load(report: LoadReport, raw) -> None:
        loads[report.worker_id] = report

    try:
        await bus.subscribe(bus.subjects.load_model(model), on_load, LoadReport)
        await members.start(wait=1.0)
        await wait_until(lambda: members.get(decode_id) and members.get(prefill_id), 120, "both workers", interval=0.2)
        await wait_until(lambda: prefill_id in loads and decode_id in loads, 30, "load reports of both", interval=0.2)
        reference = Engine(EngineConfig(tiny_model, device="cuda:0", num_kv_blocks=128))
        rng = random.Random(5)
        counter = f"transport_{transport}"
        for i in range(3):  # the first may prefill locally if the decode worker has not yet seen the pool
            tokens = [rng.randrange(4096) for _ in range(300 + 37 * i)]
            got = await run_prompt(bus, decode_id, model, f"{transport}-{family}-{i}", tokens, 8)
            (ref,) = reference.generate([tokens], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            assert got == ref.output_token_ids, f"request {i}: remote prefill over {transport} changed the output"
            with contextlib.suppress(AssertionError):
                await fresh_load(loads, decode_id)
            if loads[decode_id].counters.get(counter, 0) > 0:
                break
        report = loads[decode_id]
        assert report.counters.get(counter, 0) > 0, f"no prefill came over {transport}: {report.counters}"
        assert report.counters.get("remote_prefill_failed", 0) == 0, report.counters
    finally:
        with contextlib.suppress(Exception):
            await members.stop()
        await bus.close()
        await asyncio.to_thread(stop_processes, procs)
