"""The mesh across three simulated hosts (``tests.helpers.hostbed``; needs root): chaos load, or TTFT.

Chaos (default): the tiny model, disaggregated (``--disagg-threshold 64``), every process with
``--js-replicas 3``:

    host 1  nats-server, gateway, decode worker mh-dec-1
    host 2  nats-server, prefill worker mh-pre-2, decode worker mh-dec-2
    host 3  nats-server, prefill worker mh-pre-3, decode worker mh-dec-3

Clients stream greedy completions of prompts whose outputs the engine computed in this process
(reference outputs) and check every token. At 1/3 of the run host 3 is killed whole (restarted
15 s later), at 2/3 host 2 is cut off for 10 s. Prints requests, correct, incorrect, hung, clear
errors by kind (5xx), the gateway's migrations and re-sends, and which transports carried the KV.
Target: 0 incorrect, 0 hung.

TTFT (``--ttft``): the ``small`` model, 4k-token prompts (each new: no prefix hit), one at a time;
TTFT p50 with prefill on host 2 and decode on host 3 (the KV crosses hosts) against everything on
host 1 (prefill and decode workers on one host, the KV over shm). Target: across within 1.3x.

    sudo python -m bench multihost [--seconds 120] [--clients 4] [--ttft [--requests 8]]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.mesh.chaos import Outcome, report, summary
from tests.helpers.hostbed import HostBed, unavailable_reason
from tests.helpers.multihost import (
    BUS_FLAGS,
    checked_request,
    gateway_counter,
    open_watcher,
    wait_gateway,
)

BENCHMARK = Benchmark(
    name="multihost",
    measures="the mesh across three simulated hosts (network namespaces, root): every token checked while a "
             "host is killed and another cut off; or (--ttft) TTFT with the KV crossing hosts against one host",
    target="0 incorrect, 0 hung; TTFT across hosts within 1.3x of one host (issue 31)",
    minutes=2.5,
    smoke=("--dry-run",),
)
GW_FLAGS = (*BUS_FLAGS, "--first-token-timeout", "10", "--idle-timeout", "10")


def reference_pool(model_dir: Path, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, greedy output) pairs of the tiny model, from the engine in this process."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.choice([24, 48, 96, 200, 320]))] for _ in range(n)]
    lengths = [rng.randrange(8, 40) for _ in range(n)]
    engine = Engine(EngineConfig(model_dir, num_kv_blocks=2048))
    out = []
    for p, k in zip(prompts, lengths, strict=True):
        (seq,) = engine.generate([p], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
        out.append((p, seq.output_token_ids))
    return out


def start_chaos_mesh(bed: HostBed, model_dir: Path) -> str:
    model = ["--model", str(model_dir), "--device-kv-blocks", "1024", *BUS_FLAGS, "--prefill-timeout", "5"]
    for i in (1, 2, 3):
        bed.worker(i, "decode", *model, "--worker-id", f"mh-dec-{i}", "--disagg-threshold", "64")
    for i in (2, 3):
        bed.worker(i, "prefill", *model, "--worker-id", f"mh-pre-{i}", "--prefill-capacity", "8")
    return bed.gateway(1, "--model", str(model_dir), *GW_FLAGS)


async def monkey(bed: HostBed, seconds: float, out: Outcome, log) -> None:
    """Host 3 killed at 1/3 (back 15 s later), host 2 cut off for 10 s at 2/3."""
    t0 = time.monotonic()
    await asyncio.sleep(seconds / 3)
    log(f"  [{time.monotonic() - t0:5.1f}s] kill host 3")
    out.faults.append(time.monotonic())
    bed.kill_host(3)
    out.kills += 1
    await asyncio.sleep(15)
    log(f"  [{time.monotonic() - t0:5.1f}s] restart host 3")
    await asyncio.to_thread(bed.restart_host, 3)
    out.restarts += 1
    await asyncio.sleep(max(0.0, 2 * seconds / 3 - (time.monotonic() - t0)))
    log(f"  [{time.monotonic() - t0:5.1f}s] partition host 2 for 10 s")
    out.faults.append(time.monotonic())
    with bed.partition(2):
        await asyncio.sleep(10)
    log(f"  [{time.monotonic() - t0:5.1f}s] host 2 healed")


async def transport_totals(bed: HostBed) -> dict[str, int]:
    """KV transfers by transport, summed over the decode workers' latest load reports."""
    w = await open_watcher(bed.hosts[1].nats_url)
    try:
        await asyncio.sleep(2.5)  # a load report of every worker
        totals: dict[str, int] = {}
        for wid, r in w.loads.items():
            if wid.startswith("mh-dec"):
                for k, v in r.counters.items():
                    if k.startswith("transport_"):
                        totals[k[len("transport_"):]] = totals.get(k[len("transport_"):], 0) + v
        return totals
    finally:
        await w.close()


async def run_chaos(seconds: float, clients: int, seed: int, log=print) -> tuple[Outcome, dict]:
    from engine.tiny import write_tiny_model

    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="pdmesh-mh-")) / "tiny")
    pool = reference_pool(model_dir, 64, seed)
    with HostBed(3, name="mh") as bed:
        url = start_chaos_mesh(bed, model_dir)
        w = await open_watcher(bed.hosts[1].nats_url)
        await w.wait_for(lambda: len(w.membership.cards("tiny")) >= 5, 180, "every worker")
        await w.close()
        await wait_gateway(url)
        out = Outcome()
        end = time.monotonic() + seconds

        async def user(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            async with httpx.AsyncClient(timeout=60) as client:
                while time.monotonic() < end:
                    prompt, expected = rng.choice(pool)
                    await checked_request(client, url, prompt, expected, out, 60.0)

        await asyncio.gather(monkey(bed, seconds, out, log), *(user(i) for i in range(clients)))
        out.migrations = await gateway_counter(url, "pdmesh_gateway_migrations")
        out.reroutes = await gateway_counter(url, "pdmesh_gateway_reroutes")
        return out, await transport_totals(bed)


async def ttft_of(url: str, prompts: list[list[int]]) -> list[float]:
    """Seconds to the first streamed token of each prompt, one request at a time."""
    out = []
    async with httpx.AsyncClient(timeout=300) as client:
        for p in prompts:
            body = {"model": "small", "prompt": p, "max_tokens": 4, "stream": True, "ignore_eos": True}
            t0 = time.monotonic()
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                assert r.status_code == 200, r.status_code
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: ") and line != "data: [DONE]":
                        out.append(time.monotonic() - t0)
                        break
                async for _ in lines:  # the rest of the stream
                    pass
    return out


async def ttft_layout(model_dir: Path, pre: int, dec: int, prompts: list[list[int]], log) -> list[float]:
    """TTFTs with the prefill worker on host ``pre`` and the decode worker on host ``dec`` (the first
    prompt warms up)."""
    with HostBed(3, name="mh") as bed:
        model = ["--model", str(model_dir), "--device-kv-blocks", "1024", *BUS_FLAGS]
        bed.worker(pre, "prefill", *model, "--worker-id", "tt-pre")
        bed.worker(dec, "decode", *model, "--worker-id", "tt-dec", "--disagg-threshold", "64",
                   "--prefill-timeout", "120")
        # a 4k-token prefill of the small model takes seconds on a CPU
        url = bed.gateway(1, "--model", str(model_dir), *BUS_FLAGS, "--first-token-timeout", "300")
        w = await open_watcher(bed.hosts[1].nats_url)
        try:
            await w.wait_for(lambda: w.membership.get("tt-pre") and w.membership.get("tt-dec"), 180, "both workers")
            await w.fresh_load("tt-pre", timeout=30)
            await wait_gateway(url)
            await ttft_of(url, prompts[:1])
            ttfts = await ttft_of(url, prompts[1:])
            r = (await w.fresh_load("tt-dec")).counters
            log(f"  prefill on host {pre}, decode on host {dec}: remote prefills {r.get('remote_prefill_done', 0)}, "
                f"transports {({k: v for k, v in r.items() if k.startswith('transport_')})}")
            return ttfts
        finally:
            await w.close()


async def run_ttft(requests: int, prompt_len: int, seed: int, log=print) -> dict[str, list[float]]:
    from engine.tiny import write_tiny_model

    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="pdmesh-mh-")) / "small", size="small")
    rng = random.Random(seed)
    results = {}
    for layout, (pre, dec) in {"one host": (1, 1), "across hosts": (2, 3)}.items():
        prompts = [[rng.randrange(3, 4096) for _ in range(prompt_len)] for _ in range(requests + 1)]
        results[layout] = await ttft_layout(model_dir, pre, dec, prompts, log)
    return results


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft", action="store_true", help="TTFT of 4k-token prompts across hosts vs on one host")
    p.add_argument("--requests", type=int, default=8, help="--ttft: prompts per layout")
    p.add_argument("--prompt-len", type=int, default=4096, help="--ttft: tokens per prompt")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    reason = unavailable_reason()
    if args.dry_run:
        print(f"DRY RUN: three hosts (network, mount and UTS namespaces){'; here: ' + reason if reason else ''}")
        if args.ttft:
            print(f"DRY RUN: TTFT of {args.requests} prompts of {args.prompt_len} tokens, prefill and decode on host 1, "
                  "then prefill on host 2 and decode on host 3")
            return emit(BENCHMARK, ttft_figures({}, args.prompt_len), args)
        print(f"DRY RUN: {args.clients} clients for {args.seconds:g} s; host 3 killed at 1/3 (back 15 s later), "
              "host 2 cut off for 10 s at 2/3")
        return emit(BENCHMARK, {**summary(Outcome(), args.seconds), "kv_transfers": {}}, args)
    if reason:
        sys.exit(f"python -m bench multihost: {reason}")
    if args.ttft:
        res = asyncio.run(run_ttft(args.requests, args.prompt_len, args.seed))
        figures = ttft_figures(res, args.prompt_len)
        for k, v in res.items():
            print(f"{k}: TTFT p50 {figures['layouts'][k]['p50_ms']:.0f} ms over {len(v)} prompts of "
                  f"{args.prompt_len} tokens (min {min(v) * 1e3:.0f}, max {max(v) * 1e3:.0f})")
        print(f"across / one host: {figures['across_over_one_host']:.2f}x (target <= 1.3x)")
        return emit(BENCHMARK, figures, args)
    out, transports = asyncio.run(run_chaos(args.seconds, args.clients, args.seed))
    print(report(out, args.seconds).replace("1 NATS restart", "1 host partition (10 s)"))
    print(f"KV transfers by transport (decode workers' counters, host 3's restarted ones): {transports}")
    emit(BENCHMARK, {**summary(out, args.seconds), "kv_transfers": transports}, args)
    return 1 if out.incorrect or out.hung else 0


def ttft_figures(res: dict[str, list[float]], prompt_len: int) -> dict:
    layouts = {k: {"p50_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3, "max_ms": max(v) * 1e3,
                   "prompts": len(v)} for k, v in res.items()}
    ratio = (layouts["across hosts"]["p50_ms"] / layouts["one host"]["p50_ms"]
             if {"across hosts", "one host"} <= layouts.keys() else None)
    return {"prompt_len": prompt_len, "layouts": layouts, "across_over_one_host": ratio}
