"""A worker's ranks, from rank 0's side: it starts ranks 1..N-1 of its layout as helper
processes, hands them each step, and stops them.

    rank 0 (the worker)                            rank r (helper: ``python -m engine.parallel.rank``)
    -------------------                            ---------------------------------------------------
    spawn, send RankSetup  --pipe-->               load its part (its stage's layers, its heads),
    load its own part                              make its KV part (CPU: a file in /dev/shm)
    wait for "ready"       <--pipe--               ready(where its KV part is)
    join the groups        <------------------->   join the groups (comm: TP groups, stage links)
    per step: StageStep    --pipe-->               its stage of each micro-batch (engine.parallel.stage)
      stage 0, all-reduces, activations  <----->     all-reduces, activations, rows back to rank 0
      logits, sample
    EAGLE-3 states (TP only): RebuildStep --pipe-->  the layers up to the last auxiliary one
    stats: StatsRequest    --pipe-->               its StageStats  --pipe--> rank 0
    close: None            --pipe-->               exit

The pipe is each helper's lifeline: a helper leaves when it reads end-of-file, so a rank 0
that dies (even by SIGKILL) takes its helpers with it, and a helper that dies breaks rank 0's
next send, collective or receive. (Not PR_SET_PDEATHSIG: it fires when the spawning *thread*
exits, and workers build their engine in a pool thread.) After a failed step the ranks may
disagree on which collective comes next, so the group is closed and every later step fails
(the worker has to be restarted).

Today every rank runs on rank 0's host, meeting at a store rank 0 serves on loopback; ranks
on other hosts would get the same ``RankSetup`` through another channel, with the store's
address in it.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.parallel.comm import READY_TIMEOUT, RankGroups, join_groups, open_store
from engine.parallel.layout import Layout
from engine.parallel.stage import StageStats, StageStep
from engine.tp import Shard
from kvstore.cache import KVCache, KVCacheSpec

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # the ranks share rank 0's host
STATS_TIMEOUT = 30.0  # seconds a helper may take to answer a StatsRequest (it answers between steps)


@dataclass(frozen=True)
class RankSetup:
    """What a helper rank needs to build its part of the engine (sent pickled over its pipe)."""

    config: object  # EngineConfig, attention_backend resolved by rank 0
    layout: Layout
    rank: int
    store_host: str
    store_port: int
    num_blocks: int
    max_len: int
    kv_path: str | None  # CPU: this rank's KV part file, for rank 0 to map
    threads: int
    log_level: int


@dataclass(frozen=True)
class StatsRequest:
    """Rank 0 asks a helper for its ``StageStats`` (and to start counting anew with ``reset``)."""

    reset: bool = False


def rank_kv_spec(mc, layout: Layout, stage: int, num_blocks: int, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """The KV spec of one rank's part: its stage's layers, its share of the heads."""
    return mc.kv_cache_spec(num_blocks, block_size, dtype, layout.tp, num_layers=len(layout.layers(stage)))


def check_devices(device: torch.device, layout: Layout) -> None:
    """CUDA: a GPU per rank, from ``device`` on (ValueError in one line)."""
    if device.type == "cuda" and (device.index or 0) + layout.size > torch.cuda.device_count():
        raise ValueError(f"--tp {layout.tp} x --pp {layout.pp} needs a GPU per rank ({layout.size}) from "
                         f"{device}: {torch.cuda.device_count()} visible")


class ParallelGroupError(RuntimeError):
    """A rank is gone: this engine can never step again (the worker should exit and be replaced)."""

    fatal = True


class RankGroup:
    """Rank 0's side of a worker's ranks: starts the helpers, hands them each step, stops them."""

    def __init__(self, config, layout: Layout, num_blocks: int, max_len: int, kv_base: str | None):
        self.layout = layout
        self.size = layout.size
        self.shard = Shard(0, layout.tp)
        self.groups = RankGroups()
        self.device = config.torch_device
        check_devices(self.device, layout)
        self._store = open_store(LOOPBACK, 0, self.size, master=True)
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._paths = [f"{kv_base}.r{r}" for r in range(1, self.size)] if kv_base else []
        self._broken: str | None = None
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._paths)
        threads = max(1, torch.get_num_threads() // self.size)
        level = logging.getLogger().getEffectiveLevel() or logging.WARNING
        for r in range(1, self.size):
            self._spawn(RankSetup(config, layout, r, LOOPBACK, self._store.port, num_blocks, max_len,
                                  self._paths[r - 1] if self._paths else None, threads, level))

    def _spawn(self, setup: RankSetup) -> None:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.parallel.rank", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()  # the helper's end lives only in the helper: its death is our EOF
        conn = Connection(ours.detach())
        self._procs.append(proc)
        self._conns.append(conn)
        conn.send(setup)

    def join(self) -> list[KVCache]:
        """Wait for every helper's KV part, then join the groups. The parts come back in rank
        order, mapped (CPU) or opened (CUDA IPC) in this process."""
        deadline = time.monotonic() + READY_TIMEOUT
        parts = [self._await_ready(r, deadline) for r in range(1, self.size)]
        self.groups = join_groups(self._store, self.layout, 0, self.device, LOOPBACK)
        self.shard.group = self.groups.tp
        return parts

    def _await_ready(self, rank: int, deadline: float) -> KVCache:
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        while not conn.poll(0.2):
            if proc.poll() is not None:
                raise ParallelGroupError(f"rank {rank} exited with status {proc.returncode} while loading")
            if time.monotonic() > deadline:
                raise ParallelGroupError(f"rank {rank} not ready in {READY_TIMEOUT:.0f}s")
        try:
            spec_dict, where = conn.recv()
        except EOFError:
            raise ParallelGroupError(f"rank {rank} failed while loading") from None
        spec = KVCacheSpec.from_dict(spec_dict)
        if isinstance(where, str):
            return KVCache.attach(spec, where)
        rebuild, args = where  # a CUDA IPC handle, as torch.multiprocessing sends it
        return KVCache.of_tensor(spec, rebuild(*args))

    def broadcast(self, message) -> None:
        """Hand every helper this step's message (a ``StageStep`` or an EAGLE-3 ``RebuildStep``:
        they then run it with us)."""
        if self._broken:
            raise ParallelGroupError(self._broken)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError:
                self.abort(f"rank {rank} is gone")
                raise ParallelGroupError(self._broken) from None

    def send_step(self, step) -> None:
        """Tensor parallelism alone: the step, whole, to every helper."""
        self.broadcast(StageStep.whole(step))

    def stats(self, reset: bool = False) -> list[StageStats]:
        """Every helper's ``StageStats``, in rank order (between steps)."""
        self.broadcast(StatsRequest(reset))
        out = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                if not conn.poll(STATS_TIMEOUT):
                    raise EOFError
                out.append(conn.recv())
            except (EOFError, OSError):
                self.abort(f"rank {rank} did not answer for its stats")
                raise ParallelGroupError(self._broken) from None
        return out

    def abort(self, why: str) -> None:
        """A step failed: the ranks may be out of step, so stop them; later steps fail."""
        if not self._broken:
            log.error("rank group (%s) closed: %s", self.layout.describe(), why)
            self._broken = f"the rank group is closed after a failed step ({why})"
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def close(self) -> None:
        self._broken = self._broken or "the engine is closed"
        self._finalizer()


def _stop(procs: list[subprocess.Popen], conns: list[Connection], paths: list[str]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(None))
        conn.close()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for path in paths:
        Path(path).unlink(missing_ok=True)
