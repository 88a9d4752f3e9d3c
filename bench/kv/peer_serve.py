"""Does serving peer fetches slow a worker's own decoding? One worker, its ITL with and without fetches.

    python -m bench peer-serve --fetch-rate 4 --fetch-blocks 60      # the replay's per-holder rate (mocker)
    python -m bench peer-serve --model tiny-small --streams 4         # a real model worker, real bytes
    python -m bench peer-serve --model tiny-small --holder-cpus 0     # ... on a core of its own

With ``--model`` (a model directory, or ``tiny`` / ``tiny-small`` for the generated test models) the
worker is a real ``mesh worker decode --peer-fetch`` with a host tier, and the fetches are a
peer's (``decode/peerfetch.py``): over ``--channel shm`` the holder lends the pinned blocks and
the requester process copies them out of the holder's shared files, then releases them; over
``--channel nats`` the holder copies them between its steps and sends them as ``KvChunk``s.

Without ``--model``: a real nats-server and one real ``mesh worker mock`` process (the mocker engine at ``--speedup``,
a device pool and a host tier). The bench warms it with ``--prefixes`` prompts (so it holds blocks
on device and in its host tier to send), then keeps ``--streams`` long decodes running on it and
alternates phases of ``--seconds``: *off* (decoding only) and *on* (also serving ``KvFetchRequest``s
for ``--fetch-blocks`` blocks of a random warm prefix, Poisson arrivals at ``--fetch-rate`` per
second, as the peer-fetch replay sends to one holder). What serving costs the holder, all of it
real except the bytes: the fetch's bus messages and handler on its event loop, pinning and
unpinning between its steps, pinned blocks out of its free pool, and the timing model's HBM
contention while it sends from device memory (``TimingModel.serve_slowdown``).

The fetching peer is a process of its own (its buffers and read-backs never delay the event loop
that timestamps the holder's tokens); ``--holder-cpus`` gives the holder cores of its own too, as
it would have on its own machine (the requester, this process and nats-server share the rest).

ITL: the gaps between a stream's token chunks at this client (each gap counts in the phase it
ended in). Reported per phase kind: p50, p90, p99, and p99 on / off (target: <= 1.10).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.common.registry import ROOT
from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from mesh.bus import Bus
from mesh.client import generate
from mesh.natsserver import EmbeddedNats
from mesh.protocol import (
    GenerateRequest,
    KvFetchDone,
    KvFetchRelease,
    KvFetchRequest,
    SamplingOptions,
)

BENCHMARK = Benchmark(
    name="peer-serve",
    measures="a holder worker's own decode ITL while it serves peer fetches (60 blocks at 4/s) against while it "
             "does not, in alternating phases; the mocker, or a real model worker with real bytes",
    target="holder ITL p99 <= 1.10x while serving fetches (issue 20)",
    minutes=2,
    smoke=("--dry-run",),
)
WORKER = "serve-holder"
MODEL = "mock"  # the served model's name (run() sets it from --model)
BS = 16
VOCAB = 32000


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


class Phases:
    """Which phase a moment falls in: ``(start, end, kind)`` windows."""

    def __init__(self):
        self.windows: list[tuple[float, float, str]] = []

    def kind_at(self, t: float) -> str | None:
        for start, end, kind in self.windows:
            if start <= t < end:
                return kind
        return None


async def stream_forever(bus: Bus, rng: random.Random, gaps: list[tuple[float, float]], stop: asyncio.Event,
                         max_tokens: int) -> None:
    while not stop.is_set():
        prompt = [rng.randrange(1, VOCAB) for _ in range(256)]
        req = GenerateRequest(uuid.uuid4().hex, MODEL, prompt,
                              SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        last = None
        async for chunk in generate(bus, WORKER, req):
            now = time.monotonic()
            if last is not None and chunk.token_ids:
                gaps.append((now, (now - last) / len(chunk.token_ids)))
            last = now
            if stop.is_set():
                break


async def fetch_load(bus: Bus, prefixes: list[list[int]], rate: float, blocks: int, on: asyncio.Event,
                     stop: asyncio.Event, done: list[KvFetchDone], rng: random.Random, channel=None,
                     block_bytes: int = 0) -> None:
    subject = bus.subjects.kv_fetch(MODEL, WORKER)
    tasks: set[asyncio.Task] = set()

    async def one() -> None:
        hashes = rng.choice(prefixes)[:blocks]
        fetch_id = uuid.uuid4().hex[:16]
        req = KvFetchRequest(uuid.uuid4().hex, MODEL, "bench", hashes, deadline=time.time() + 10.0,
                             fetch_id=fetch_id)
        try:
            if channel is not None:  # a real worker writes the bytes into our buffer
                req.transports = {channel.name: await channel.params(fetch_id, len(hashes) * block_bytes)}
            d = await bus.request(subject, req, KvFetchDone, 10.0)
            try:
                if channel is not None and d.ok and (not d.transfer_bytes or await channel.take(
                        fetch_id, d.transfer_bytes, d.lent.to_dict() if d.lent else None) is None):
                    raise RuntimeError(f"{d.num_blocks} blocks said written, bytes missing")
            finally:
                if d.lent:  # read out of the holder's files: its pins go
                    await bus.publish(bus.subjects.kv_fetch_release(MODEL, WORKER),
                                      KvFetchRelease("bench", fetch_id, d.release_key))
            done.append(d)
        except Exception as e:
            print(f"  fetch failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            if channel is not None:
                await channel.forget(fetch_id)

    while not stop.is_set():
        await asyncio.sleep(rng.expovariate(rate))
        if on.is_set():
            t = asyncio.create_task(one())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)


def model_dir(name: str) -> Path:
    if name in ("tiny", "tiny-small"):
        from cli.up import default_model_dir
        from engine.tiny import write_tiny_model

        path = default_model_dir().parent / name
        if not (path / "config.json").is_file():
            write_tiny_model(path, "small" if name == "tiny-small" else "tiny")
        return path
    return Path(name)


def split_cpus(args) -> tuple[set[int], set[int]] | None:
    """``--holder-cpus``: the holder's cores and the rest (this process, its requester and nats-server)."""
    if not args.holder_cpus:
        return None
    holder = {int(c) for c in args.holder_cpus.split(",")}
    rest = set(os.sched_getaffinity(0)) - holder
    if not holder or not rest:
        raise SystemExit("--holder-cpus must name some, not all, of this machine's cores")
    return holder, rest


def worker_command(args, url: str) -> list[str]:
    base = [sys.executable, "-m", "cli", "worker"]
    common = ["--nats", url, "--worker-id", WORKER, "--device-kv-blocks", str(args.device_blocks),
              "--host-kv-blocks", str(args.host_blocks), "--metrics-port", "-1"]
    if args.model is None:
        return [*base, "mock", *common, "--mock-speedup", str(args.speedup)]
    return [*base, "decode", *common, "--model", str(model_dir(args.model)), "--peer-fetch",
            "--transports", args.channel, "--max-num-seqs", str(max(8, args.streams))]


async def run(args) -> dict:
    global MODEL, VOCAB
    rng = random.Random(args.seed)
    if args.model is not None:
        from engine.config import ModelConfig

        path = model_dir(args.model)
        MODEL, VOCAB = path.name, ModelConfig.from_dir(path).vocab_size
    cpus = split_cpus(args)
    env, pin = None, None
    if cpus is not None:  # the requester's CPU out of the holder's measurement: it is another machine in a mesh
        holder, rest = cpus
        os.sched_setaffinity(0, rest)  # nats-server inherits this
        env = {**os.environ, "OMP_NUM_THREADS": str(len(holder))}

        def pin() -> None:
            os.sched_setaffinity(0, holder)
    with EmbeddedNats() as nats:
        worker = subprocess.Popen(worker_command(args, nats.url), cwd=ROOT, stdout=subprocess.DEVNULL, env=env,
                                  preexec_fn=pin)
        bus = await Bus.connect(nats.url, "peer-serve-bench")
        try:
            return await measure(args, bus, rng, nats.url)
        finally:
            await bus.close()
            worker.terminate()
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


async def wait_ready(bus: Bus, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            req = GenerateRequest(uuid.uuid4().hex, MODEL, [1, 2, 3], SamplingOptions(max_tokens=1))
            async for _ in generate(bus, WORKER, req, first_timeout=2.0):
                pass
            return
        except Exception:
            await asyncio.sleep(0.5)
    raise RuntimeError("the worker did not come up")


def real_channel(args, bus: Bus):
    """The buffer channel for fetches from a real worker; None for the mocker (no bytes move)."""
    if args.model is None:
        return None
    from kvstore.transfer.fetch import make_channels

    (channel,) = make_channels([args.channel], bus=bus, model=MODEL, worker_id="bench").values()
    return channel


async def measure(args, bus: Bus, rng: random.Random, url: str) -> dict:
    await wait_ready(bus, 180.0)
    channel = real_channel(args, bus)
    seed = hash_seed(DEFAULT_HASH_KEY, MODEL)
    prompts = [[rng.randrange(1, VOCAB) for _ in range((args.fetch_blocks + 1) * BS)] for _ in range(args.prefixes)]
    for i in range(0, len(prompts), 8):  # warm: the worker holds every prefix (the oldest in its host tier)
        await asyncio.gather(*(
            _drain(generate(bus, WORKER, GenerateRequest(uuid.uuid4().hex, MODEL, p, SamplingOptions(max_tokens=1))))
            for p in prompts[i:i + 8]))
    prefixes = [block_hashes(p, BS, seed) for p in prompts]
    block_bytes = 0
    if channel is not None:  # one probe fetch into a roomy buffer says how big a block is
        probe: list[KvFetchDone] = []
        one = asyncio.Event()
        one.set()
        await fetch_load(bus, [prefixes[-1][:1]], 1e9, 1, one, _set_after(one), probe, rng, channel, 1 << 24)
        block_bytes = probe[0].transfer_bytes // probe[0].num_blocks
    gaps: list[tuple[float, float]] = []
    stop = asyncio.Event()
    streams = [asyncio.create_task(stream_forever(bus, random.Random(rng.random()), gaps, stop, args.max_tokens))
               for _ in range(args.streams)]
    # The requester is a process of its own: its buffers and read-backs must not hold up this
    # process's event loop, which timestamps the holder's tokens.
    mp = multiprocessing.get_context("spawn")
    on, fetching_stop, results = mp.Event(), mp.Event(), mp.Queue()
    requester = mp.Process(target=requester_main, daemon=True, args=(
        url, MODEL, prefixes, args.fetch_rate, args.fetch_blocks, block_bytes,
        args.channel if channel is not None else None, rng.random(), on, fetching_stop, results))
    requester.start()
    phases = Phases()
    await asyncio.sleep(args.settle)
    for _ in range(args.rounds):
        for kind in ("off", "on"):
            (on.set if kind == "on" else on.clear)()
            start = time.monotonic()
            await asyncio.sleep(args.seconds)
            phases.windows.append((start, time.monotonic(), kind))
    fetching_stop.set()
    done: list[KvFetchDone] = await asyncio.to_thread(results.get, True, 60.0)
    await asyncio.to_thread(requester.join, 10.0)
    stop.set()
    for t in streams:
        t.cancel()
    await asyncio.gather(*streams, return_exceptions=True)

    by_kind: dict[str, list[float]] = {"off": [], "on": []}
    for t, gap in gaps:
        if (kind := phases.kind_at(t)) is not None:
            by_kind[kind].append(gap)
    served = [d for d in done if d.ok]
    tiers: dict[str, int] = {}
    for d in served:
        for k, n in d.tiers.items():
            tiers[k] = tiers.get(k, 0) + n
    on_seconds = args.rounds * args.seconds
    who = f"mock speedup {args.speedup:g}" if args.model is None else f"model {MODEL} ({args.channel} channel)"
    if args.holder_cpus:
        who += f", holder on cores {args.holder_cpus}, requester on the others"
    print(f"holder: {who}, {args.streams} decoding streams, fetches of {args.fetch_blocks} "
          f"blocks at {args.fetch_rate:g}/s in the 'on' phases ({args.rounds} x {args.seconds:g} s each)")
    lent = sum(1 for d in served if d.lent)
    print(f"fetches served: {len(served)} of {len(done)}, {lent} of them lent ({len(served) / on_seconds:.2f}/s, "
          f"{sum(d.num_blocks for d in served) / on_seconds:,.0f} blocks/s; by tier {tiers}); "
          f"holder-side time p50 {pct([d.transfer_ms for d in served], 0.5):.1f} ms")
    print("| phase | gaps | ITL p50 | ITL p90 | ITL p99 |")
    print("|---|---|---|---|---|")
    for kind, v in by_kind.items():
        print(f"| {kind} | {len(v):,} | {pct(v, 0.5) * 1e3:.2f} ms | {pct(v, 0.9) * 1e3:.2f} ms | "
              f"{pct(v, 0.99) * 1e3:.2f} ms |")
    ratio = pct(by_kind["on"], 0.99) / pct(by_kind["off"], 0.99)
    print(f"ITL p99 serving / not serving: {ratio:.3f}x (target <= 1.10x)")
    return summary(args, by_kind, served, len(done), lent, tiers, on_seconds)


def summary(args, by_kind: dict[str, list[float]], served: list, fetches: int, lent: int, tiers: dict,
            on_seconds: float) -> dict:
    """The figures: per phase kind the ITL percentiles (ms), the fetches served, and p99 on / off."""
    phases = {kind: {"gaps": len(v), "itl_p50_ms": pct(v, 0.5) * 1e3, "itl_p90_ms": pct(v, 0.9) * 1e3,
                     "itl_p99_ms": pct(v, 0.99) * 1e3} for kind, v in by_kind.items()}
    on, off = phases.get("on", {}), phases.get("off", {})
    return {"holder": "mock" if args.model is None else f"{args.model} ({args.channel})", "phases": phases,
            "fetches": fetches, "served": len(served), "lent": lent, "blocks_by_tier": tiers,
            "fetches_per_s": len(served) / on_seconds if on_seconds else None,
            "holder_ms_p50": pct([d.transfer_ms for d in served], 0.5),
            "itl_p99_on_off": on["itl_p99_ms"] / off["itl_p99_ms"] if on and off else None}


def requester_main(url: str, model: str, prefixes: list[list[int]], rate: float, blocks: int, block_bytes: int,
                   channel_name: str | None, seed: float, on, stop, results) -> None:
    """The fetching peer, in a process of its own: ``fetch_load`` until ``stop``, then its
    ``KvFetchDone``s into ``results``. ``on`` and ``stop`` are multiprocessing events (``is_set``
    is all ``fetch_load`` asks of them)."""
    global MODEL
    MODEL = model

    async def go() -> list[KvFetchDone]:
        bus = await Bus.connect(url, "peer-serve-requester")
        try:
            channel = None
            if channel_name is not None:
                from kvstore.transfer.fetch import make_channels

                (channel,) = make_channels([channel_name], bus=bus, model=MODEL, worker_id="bench").values()
            done: list[KvFetchDone] = []
            await fetch_load(bus, prefixes, rate, blocks, on, stop, done, random.Random(seed), channel, block_bytes)
            return done
        finally:
            await bus.close()

    results.put(asyncio.run(go()))


def _set_after(on: asyncio.Event) -> asyncio.Event:
    """A stop event that is set once ``fetch_load`` has sent its first fetch (it checks stop after each)."""
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, stop.set)
    return stop


async def _drain(agen) -> None:
    async for _ in agen:
        pass


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--speedup", type=float, default=3.0, help="mocker speedup (the replay's loaded phase: 3)")
    p.add_argument("--streams", type=int, default=8, help="concurrent decoding requests on the holder")
    p.add_argument("--max-tokens", type=int, default=400, help="tokens per decoding request")
    p.add_argument("--fetch-rate", type=float, default=4.0, help="fetches per second in the 'on' phases")
    p.add_argument("--fetch-blocks", type=int, default=60, help="blocks per fetch")
    p.add_argument("--prefixes", type=int, default=48, help="warm prompts the fetches ask for")
    p.add_argument("--device-blocks", type=int, default=2048)
    p.add_argument("--host-blocks", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    p.add_argument("--rounds", type=int, default=3, help="off/on pairs")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of decoding before the first phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None,
                   help="a real model worker: a model directory, or tiny / tiny-small (generated); default: the mocker")
    p.add_argument("--holder-cpus", default="",
                   help="cores for the holder alone (e.g. 0); this process, the requester and nats-server get the "
                        "rest, and the holder's torch as many threads as it has cores")
    p.add_argument("--channel", default="shm", choices=("shm", "nats"), help="with --model: where the bytes go")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.dry_run:
        print(f"DRY RUN: {' '.join(worker_command(args, 'nats://HOST:PORT'))}")
        print(f"DRY RUN: {args.streams} streams of {args.max_tokens} tokens; {args.rounds} x (off, on) phases of "
              f"{args.seconds:g} s; fetches of {args.fetch_blocks} blocks at {args.fetch_rate:g}/s when on")
        return emit(BENCHMARK, summary(args, {"off": [], "on": []}, [], 0, 0, {}, 0.0), args)
    return emit(BENCHMARK, asyncio.run(run(args)), args)
