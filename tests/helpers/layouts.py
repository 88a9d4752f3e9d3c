"""Workers of a layout (``--tp``, ``--pp``) as real processes: the helper ranks a worker started,
and a prefill worker of one layout feeding a decode worker of another (tests/integration/
test_tp_workers.py, test_pp_workers.py)."""

from __future__ import annotations

import asyncio
import subprocess
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
    prefill_before: LoadReport  # the prefill worker's load report from just before the prompts

    def prefill_delta(self, counter: str) -> int:
        """What the prefill worker counted while the prompts ran (it may have served others before)."""
        return self.prefill.counters.get(counter, 0) - self.prefill_before.counters.get(counter, 0)


def start_split(cluster: Cluster, model, ns: str, prefill: list[str], decodes: dict[str, tuple[str, list[str]]],
                threshold: int) -> list[subprocess.Popen]:
    """In namespace ``ns``: the decode workers of ``decodes`` (id -> (the one transport it offers, its
    layout flags); prompts of ``threshold`` tokens and more go to the prefill worker) and one prefill
    worker ``pre-<ns>`` with ``prefill``'s layout flags, offering each of their transports (it sends
    over the one the job's decode worker offers). Their processes."""
    flags = ["--ns", ns, "--model", str(model), "--device-kv-blocks", "1024"]
    transports = ",".join(dict.fromkeys(t for t, _ in decodes.values()))
    procs = [cluster.worker("decode", *flags, "--transports", t, *layout, "--disagg-threshold", str(threshold),
                            "--worker-id", dec) for dec, (t, layout) in decodes.items()]
    procs.append(cluster.worker("prefill", *flags, "--transports", transports, *prefill, "--worker-id", f"pre-{ns}",
                                "--prefill-capacity", "16"))
    return procs


async def run_on(cluster: Cluster, ns: str, dec: str, prompts: list[list[int]], max_tokens: int) -> SplitRun:
    """Every prompt of ``prompts`` generated greedily, at once, on decode worker ``dec`` of a split
    (``start_split``), once it and the prefill worker are registered and it has heard the prefill
    worker's load."""
    pre = f"pre-{ns}"
    w = await Watcher.open(cluster.nats_url, ns=ns)
    try:
        await w.wait_for(lambda: w.membership.get(dec) and w.membership.get(pre), 120, "both workers")
        await w.fresh_load(pre)  # the decode worker hears prefill load reports too
        await asyncio.sleep(1.2)
        before = await w.fresh_load(pre)
        results = await run_all(w.bus, dec, prompts, max_tokens=max_tokens)
        return SplitRun([toks for toks, _ in results], await w.fresh_load(dec), await w.fresh_load(pre),
                        w.membership.get(dec), w.membership.get(pre), before)
    finally:
        await w.close()


async def run_split(cluster: Cluster, model, ns: str, transport: str, prefill: list[str], decode: list[str],
                    prompts: list[list[int]], max_tokens: int, threshold: int) -> SplitRun:
    """A prefill worker with ``prefill``'s layout flags feeding a decode worker with ``decode``'s
    (prompts of ``threshold`` tokens and more go to the prefill worker) over ``transport``: every
    prompt of ``prompts`` generated greedily, at once; both workers stopped after."""
    dec = f"dec-{ns}"
    procs = start_split(cluster, model, ns, prefill, {dec: (transport, decode)}, threshold)
    try:
        return await run_on(cluster, ns, dec, prompts, max_tokens)
    finally:
        stop_processes(procs)
