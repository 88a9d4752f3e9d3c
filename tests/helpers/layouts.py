"""Workers of a layout (``--tp``, ``--pp``) as real processes: the helper ranks a worker started,
and a prefill worker of one layout feeding a decode worker of another (tests/integration/
test_tp_workers.py, test_pp_workers.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from mesh.protocol import LoadReport, WorkerCard
from tests.helpers.cluster import Cluster, Watcher, run_all
from tests.helpers.procs import descendants, stop_processes


def rank_processes(pid: int) -> list[int]:
    """The helper ranks a worker started (the processes below it running engine.parallel.rank)."""
    out = []
    for child in descendants(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"engine.parallel.rank" in cmd:
            out.append(child)
    return out


@dataclass
class SplitRun:
    """What a disaggregated run left: each prompt's tokens, both workers' last load reports and cards."""

    tokens: list[list[int]]
    decode: LoadReport
    prefill: LoadReport
    decode_card: WorkerCard
    prefill_card: WorkerCard


async def run_split(cluster: Cluster, model, ns: str, transport: str, prefill: list[str], decode: list[str],
                    prompts: list[list[int]], max_tokens: int, threshold: int) -> SplitRun:
    """A prefill worker with ``prefill``'s layout flags feeding a decode worker with ``decode``'s
    (prompts of ``threshold`` tokens and more go to the prefill worker) over ``transport``: every
    prompt of ``prompts`` generated greedily, at once; both workers stopped after."""
    flags = ["--ns", ns, "--model", str(model), "--device-kv-blocks", "1024", "--transports", transport]
    dec, pre = f"dec-{ns}", f"pre-{ns}"
    procs = [
        cluster.worker("decode", *flags, *decode, "--disagg-threshold", str(threshold), "--worker-id", dec),
        cluster.worker("prefill", *flags, *prefill, "--worker-id", pre, "--prefill-capacity", "16"),
    ]
    w = await Watcher.open(cluster.nats_url, ns=ns)
    try:
        await w.wait_for(lambda: w.membership.get(dec) and w.membership.get(pre), 120, "both workers")
        await w.fresh_load(pre)  # the decode worker hears prefill load reports too
        await asyncio.sleep(1.2)
        results = await run_all(w.bus, dec, prompts, max_tokens=max_tokens)
        return SplitRun([toks for toks, _ in results], await w.fresh_load(dec), await w.fresh_load(pre),
                        w.membership.get(dec), w.membership.get(pre))
    finally:
        await w.close()
        stop_processes(procs)
