"""``python -m bench parallel --hosts 2``: PP 2 with one stage per simulated host against PP 2 on one.

Three hosts of a bed (``tests.helpers.hostbed``; root): on host 1 a ``--pp 2`` decode worker with
both stages (``pp-one``) and one with its first stage only (``pp-two``, ``--local-ranks 1``), whose
second stage joins from host 2 (``mesh rank --join``, ``--threads`` as many as the one-host
worker's second rank has). Each round sends a batch of greedy requests (every prompt new) to
each worker in turn over the bus; decode tok/s is the tokens after each request's first over the
time from the last first token to the last token, the best round kept. Both workers' tokens are
compared. The hosts share this machine's cores: the difference is the crossing (TCP over veth,
the lifeline's heartbeats), not the hardware.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import emit
from kvstore.hashing import generate_hash_key
from mesh.client import generate
from mesh.protocol import GenerateRequest, SamplingOptions
from tests.helpers.hostbed import HostBed, unavailable_reason
from tests.helpers.multihost import BUS_FLAGS, open_watcher

WORKERS = {"one host": "pp-one", "across hosts": "pp-two"}


async def decode_rate(bus, worker: str, model: str, prompts: list[list[int]], n: int) -> tuple[float, list]:
    """Decode tok/s of ``prompts`` sent at once to ``worker``, and their tokens."""

    async def one(prompt: list[int]) -> tuple[float, float, list[int]]:
        req = GenerateRequest(uuid.uuid4().hex, model, prompt,
                              SamplingOptions(max_tokens=n, temperature=0.0, ignore_eos=True))
        first, tokens = 0.0, []
        async for chunk in generate(bus, worker, req, first_timeout=300, idle_timeout=120):
            if chunk.error:
                raise RuntimeError(f"{worker}: {chunk.error}")
            if chunk.token_ids and not first:
                first = time.perf_counter()
            tokens += chunk.token_ids
        return first, time.perf_counter(), tokens

    rows = await asyncio.gather(*(one(p) for p in prompts))
    start, end = max(r[0] for r in rows), max(r[1] for r in rows)
    return sum(len(r[2]) - 1 for r in rows) / (end - start), [r[2] for r in rows]


def start_workers(bed: HostBed, model_dir: Path, key: Path, batch: int, prompt_len: int, n: int, threads: int) -> None:
    flags = [*BUS_FLAGS, "--hash-key-file", str(key), "--model", str(model_dir), "--pp", "2",
             "--device-kv-blocks", str(batch * -(-(prompt_len + n) // 16) * 2 + 16), "--max-num-seqs", str(batch),
             "--max-num-batched-tokens", str(max(2048, batch * prompt_len)), "--disagg-threshold", "1000000"]
    bed.worker(1, "decode", *flags, "--worker-id", WORKERS["one host"])
    bed.worker(1, "decode", *flags, "--local-ranks", "1", "--worker-id", WORKERS["across hosts"])
    bed.cli(2, "rank", "--join", WORKERS["across hosts"], "--nats", bed.hosts[2].nats_url, *BUS_FLAGS,
            "--hash-key-file", str(key), "--threads", str(threads))


async def measure_hosts(model_dir: Path, batch: int, prompt_len: int, n: int, reps: int, seed: int) -> dict:
    key = Path(tempfile.mkdtemp(prefix="pdmesh-parallel-")) / "mesh.key"
    key.write_text(generate_hash_key().hex())
    # the one-host worker's second rank takes half of rank 0's threads (engine.parallel.group)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    rng = random.Random(seed)
    with HostBed(3, name="pp") as bed:
        start_workers(bed, model_dir, key, batch, prompt_len, n, threads)
        w = await open_watcher(bed.hosts[1].nats_url)
        try:
            await w.wait_for(lambda: all(w.membership.get(x) for x in WORKERS.values()), 300, "both workers")
            best: dict[str, float] = {}
            outs: dict[str, list] = {}
            for round_ in range(reps + 1):  # the first round warms up
                prompts = [[rng.randrange(8, 4096) for _ in range(prompt_len)] for _ in range(batch)]
                for name, worker in WORKERS.items():
                    rate, outs[name] = await decode_rate(w.bus, worker, model_dir.name, prompts, n)
                    if round_:
                        best[name] = max(best.get(name, 0.0), rate)
            identical = outs["one host"] == outs["across hosts"]
        finally:
            await w.close()
    return {"batch": batch, "new_tokens": n, "prompt_len": prompt_len, "second_rank_threads": threads,
            "decode_tok_s": best, "identical": identical,
            "one_host_over_across": best["one host"] / best["across hosts"]}


def run_hosts(bench, args) -> int:
    """``--hosts 2``: the measurement, or its plan (``--dry-run``)."""
    from bench.engine.parallel import small_model_dir

    batch = (args.batch or [32])[0]
    reason = unavailable_reason()
    if args.dry_run:
        print(f"DRY RUN: PP 2 decode workers on simulated hosts{'; here: ' + reason if reason else ''}: both stages "
              f"on host 1, and the second stage joined from host 2; batch {batch}, {args.new_tokens} new tokens, "
              f"best of {args.reps} rounds")
        return emit(bench, {"batch": batch, "decode_tok_s": {}, "one_host_over_across": None}, args)
    if reason:
        sys.exit(f"python -m bench parallel --hosts 2: {reason}")
    model_dir = Path(args.model) if args.model else small_model_dir()
    figures = asyncio.run(measure_hosts(model_dir, batch, args.prompt_len, args.new_tokens, args.reps, args.seed))
    for name, rate in figures["decode_tok_s"].items():
        print(f"{name:<13} batch {batch}: {rate:8.1f} decode tok/s")
    print(f"one host / across hosts: {figures['one_host_over_across']:.2f}x (target <= 1.3x); identical tokens: "
          f"{figures['identical']}")
    emit(bench, figures, args)
    return 0 if figures["identical"] else 1
