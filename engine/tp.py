"""Tensor parallelism: one engine over ``tp`` ranks, each a process holding a slice of the model.

Megatron-style sharding (``Shard``): each rank holds ``1/tp`` of the attention
heads (query and KV alike: its slice of ``qkv_proj``, its share of the KV
cache) and of the MLP columns; ``o_proj`` and ``down_proj`` are row-parallel,
so their partial sums meet in one all-reduce each per layer. Embeddings,
norms and ``lm_head`` are replicated (small next to the layers, and it keeps
sampling on rank 0 with no gather).

Rank 0 is the engine a worker runs (scheduler, block pool, sampler, the bus);
``TensorParallel`` starts ranks 1..tp-1 as helper processes
(``python -m engine.tp_rank``) and feeds them each step's flat batch:

    rank 0                                        rank r (helper)
    ------                                        ---------------
    spawn, send RankSetup  --pipe-->              load its shard, make its KV shard
    load its own shard                            (CPU: a file in /dev/shm)
    wait for "ready"       <--pipe--              ready(where its KV shard is)
    join the process group <------------------->  join the process group (gloo on CPU, NCCL on CUDA)
    per step: StepInputs   --pipe-->              plan + forward
      forward, all-reduces <------------------->    all-reduces
      logits, sample
    EAGLE-3 states of tokens not computed here (while scheduling; engine.eagle3):
      RebuildStep          --pipe-->              plan + the layers up to the last auxiliary one
      those layers         <------------------->    all-reduces
      keep the states (whole on rank 0)
    close: None            --pipe-->              exit

The pipe is the ranks' lifeline: a helper leaves when it reads end-of-file,
so a rank 0 that dies (even by SIGKILL) takes its helpers with it, and a
helper that dies breaks rank 0's next collective or send. (Not
PR_SET_PDEATHSIG: it fires when the spawning *thread* exits, and workers
build their engine in a pool thread.) After a failed step
the ranks may disagree on which collective comes next, so the group is closed
and every later step fails (the worker has to be restarted).
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
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from kvstore.cache import KVCache, KVCacheSpec

log = logging.getLogger(__name__)

# One layer's compute between two all-reduces is all a rank may wait for in a collective.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
READY_TIMEOUT = 600.0  # seconds for a helper to load its shard


@dataclass
class Shard:
    """Which slice of the model this process holds, and how partial sums meet."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # the process group; joined once every rank has its weights

    def part(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's share of ``n`` heads or columns."""
        per = n // self.size
        return self.rank * per, per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x


@dataclass(frozen=True)
class RankSetup:
    """What a helper rank needs to build its part of the engine (sent pickled over its pipe)."""

    config: object  # EngineConfig, attention_backend resolved by rank 0
    rank: int
    size: int
    store_port: int
    num_blocks: int
    max_len: int
    kv_path: str | None  # CPU: this rank's KV shard file, for rank 0 to map
    threads: int
    log_level: int


def shard_spec(mc, config, num_blocks: int, dtype: torch.dtype) -> KVCacheSpec:
    """The KV spec of one rank's share of the heads."""
    return mc.kv_cache_spec(num_blocks, config.block_size, dtype, config.tp)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CUDA: rank r on the r-th GPU after the configured one; CPU: all on the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def join_group(store: dist.Store, rank: int, size: int, device: torch.device):
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, size)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # the ranks share a host
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, options)


class TensorParallelError(RuntimeError):
    """A rank is gone: this engine can never step again (the worker should exit and be replaced)."""

    fatal = True


class TensorParallel:
    """Rank 0's side: starts the helper ranks, hands them each step, stops them."""

    def __init__(self, config, num_blocks: int, max_len: int, kv_base: str | None):
        self.size = config.tp
        self.shard = Shard(0, self.size)
        self.device = config.torch_device
        if self.device.type == "cuda" and (self.device.index or 0) + self.size > torch.cuda.device_count():
            raise ValueError(f"--tp {self.size} needs a GPU per rank from {self.device}: "
                             f"{torch.cuda.device_count()} visible")
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=READY_TIMEOUT))
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._paths = [f"{kv_base}.r{r}" for r in range(1, self.size)] if kv_base else []
        self._broken: str | None = None
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._paths)
        threads = max(1, torch.get_num_threads() // self.size)
        for r in range(1, self.size):
            setup = RankSetup(config, r, self.size, self._store.port, num_blocks, max_len,
                              self._paths[r - 1] if self._paths else None, threads,
                              logging.getLogger().getEffectiveLevel() or logging.WARNING)
            self._spawn(setup)

    def _spawn(self, setup: RankSetup) -> None:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.tp_rank", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()  # the helper's end lives only in the helper: its death is our EOF
        conn = Connection(ours.detach())
        self._procs.append(proc)
        self._conns.append(conn)
        conn.send(setup)

    def join(self) -> list[KVCache]:
        """Wait for every helper's KV shard, then join the process group. The shards come
        back in rank order, mapped (CPU) or opened (CUDA IPC) in this process."""
        deadline = time.monotonic() + READY_TIMEOUT
        shards = [self._await_ready(r, deadline) for r in range(1, self.size)]
        self.shard.group = join_group(self._store, 0, self.size, self.device)
        return shards

    def _await_ready(self, rank: int, deadline: float) -> KVCache:
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        while not conn.poll(0.2):
            if proc.poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with status {proc.returncode}")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank {rank} not ready in {READY_TIMEOUT:.0f}s")
        try:
            spec_dict, where = conn.recv()
        except EOFError:
            raise TensorParallelError(f"tensor-parallel rank {rank} failed while loading") from None
        spec = KVCacheSpec.from_dict(spec_dict)
        if isinstance(where, str):
            return KVCache.attach(spec, where)
        rebuild, args = where  # a CUDA IPC handle, as torch.multiprocessing sends it
        return KVCache.of_tensor(spec, rebuild(*args))

    def broadcast(self, step) -> None:
        """Hand this step's inputs to every helper (they then run the model with us)."""
        if self._broken:
            raise TensorParallelError(self._broken)
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError:
                self.abort(f"tensor-parallel rank {rank} is gone")
                raise TensorParallelError(self._broken) from None

    def abort(self, why: str) -> None:
        """A step failed: the ranks may be out of step, so stop them; later steps fail."""
        if not self._broken:
            log.error("tensor-parallel group closed: %s", why)
            self._broken = f"the tensor-parallel group is closed after a failed step ({why})"
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
