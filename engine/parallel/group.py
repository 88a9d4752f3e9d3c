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

The pipe is each helper's lifeline (``engine.parallel.lifeline``): a helper leaves when it reads
end-of-file, so a rank 0 that dies (even by SIGKILL) takes its helpers with it, and a helper that
dies breaks rank 0's next send, collective or receive. (Not PR_SET_PDEATHSIG: it fires when the
spawning *thread* exits, and workers build their engine in a pool thread.) After a failed step
the ranks may disagree on which collective comes next, so the group is closed and every later
step fails (the worker has to be restarted).

Ranks on other hosts (``RemoteRanks``: ``--local-ranks``) join on their own (``mesh rank
--join``) and get the same ``RankSetup`` over a lifeline across hosts, which the kernel watches:
a rank lost there (dead, or cut off) calls ``on_lost`` from the lifeline's thread within seconds,
even while a step waits on it in a collective, so that the worker can leave within its lease. The
group then meets at a store on rank 0's address toward them, not on loopback.
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
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.parallel.comm import READY_TIMEOUT, RankGroups, join_groups, open_store, share_ids
from engine.parallel.experts import expert_shard
from engine.parallel.layout import Layout
from engine.parallel.lifeline import Lifeline
from engine.parallel.remote import RemoteKVPart, RemoteRanks
from engine.parallel.stage import StageStats, StageStep
from engine.tp import Shard
from kvstore.cache import KVCache, KVCacheSpec

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # where the ranks meet when they all share rank 0's host
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
    kv_path: str | None  # CPU: this rank's KV part file, for rank 0 to map (None: on another host)
    threads: int
    log_level: int


@dataclass(frozen=True)
class StatsRequest:
    """Rank 0 asks a helper for its ``StageStats`` (and to start counting anew with ``reset``)."""

    reset: bool = False


def rank_kv_spec(mc, layout: Layout, stage: int, num_blocks: int, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """The KV spec of one rank's part: its stage's layers, its share of the heads."""
    return mc.kv_cache_spec(num_blocks, block_size, dtype, layout.tp, num_layers=len(layout.layers(stage)))


def check_devices(device: torch.device, layout: Layout, here: int | None = None) -> None:
    """CUDA: a GPU per rank on this host (``here``, default all), from ``device`` on (ValueError in
    one line)."""
    here = layout.size if here is None else here
    if device.type == "cuda" and (device.index or 0) + here > torch.cuda.device_count():
        ep = f" x --ep {layout.ep}" if layout.ep > 1 else ""
        raise ValueError(f"--tp {layout.tp} x --pp {layout.pp}{ep} needs a GPU per rank on this host ({here}) "
                         f"from {device}: {torch.cuda.device_count()} visible")


class ParallelGroupError(RuntimeError):
    """A rank is gone: this engine can never step again (the worker should exit and be replaced)."""

    fatal = True


class RankGroup:
    """Rank 0's side of a worker's ranks: starts the helpers on its host, takes those that joined
    from other hosts (``remote``), hands them each step, and stops them."""

    def __init__(self, config, layout: Layout, num_blocks: int, max_len: int, kv_base: str | None,
                 remote: RemoteRanks | None = None):
        self.layout = layout
        self.size = layout.size
        self.shard = Shard(0, layout.tp, experts=expert_shard(layout, 0))
        self.groups = RankGroups()
        self.device = config.torch_device
        self.remote = remote
        far = set(remote.ranks) if remote else set()
        if far and layout.ep > 1:
            raise ValueError("--ep > 1 does not run with ranks on other hosts (--local-ranks)")
        if any(r < 1 or r >= self.size for r in far):
            raise ValueError(f"ranks on other hosts must be among 1..{self.size - 1} of {layout.describe()}")
        local = [r for r in range(1, self.size) if r not in far]
        check_devices(self.device, layout, 1 + len(local))
        self.host = remote.addr if remote else LOOPBACK
        self.on_lost: Callable[[str], None] | None = None  # a rank on another host was lost (its lifeline's thread)
        self._store = open_store(self.host, 0, self.size, master=True)
        self._procs: dict[int, subprocess.Popen] = {}
        self._links: dict[int, Lifeline] = {}  # every helper's lifeline, by rank
        self._agent_conns: dict[int, Connection] = {}  # each local helper's KV agent channel (none across hosts)
        self._paths = {r: f"{kv_base}.r{r}" for r in local} if kv_base else {}
        self._broken: str | None = None
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._links, self._paths, self._agent_conns)
        level = logging.getLogger().getEffectiveLevel() or logging.WARNING
        setup = RankSetup(config, layout, 0, self.host, self._store.port, num_blocks, max_len, None,
                          max(1, torch.get_num_threads() // (1 + len(local))), level)
        try:
            for r in local:
                self._spawn(replace(setup, rank=r, kv_path=self._paths.get(r)))
            if remote is not None:
                self._take_remote(remote, setup)
        except BaseException:
            self._finalizer()
            raise

    def _spawn(self, setup: RankSetup) -> None:
        ours, theirs = socket.socketpair()
        agent_ours, agent_theirs = socket.socketpair()  # its KV part's transfer agent (nixl_ranks)
        fds = [theirs.fileno(), agent_theirs.fileno()]
        try:
            proc = subprocess.Popen([sys.executable, "-m", "engine.parallel.rank", *map(str, fds)], pass_fds=fds,
                                    stdin=subprocess.DEVNULL)
        finally:
            theirs.close()  # the helper's end lives only in the helper: its death is our EOF
            agent_theirs.close()
        link = Lifeline(Connection(ours.detach()))
        self._procs[setup.rank] = proc
        self._links[setup.rank] = link
        self._agent_conns[setup.rank] = Connection(agent_ours.detach())
        link.send(setup)

    def _take_remote(self, remote: RemoteRanks, setup: RankSetup) -> None:
        """Wait for every rank on another host to join (``READY_TIMEOUT``), then set each up."""
        for rank, link in sorted(remote.wait(READY_TIMEOUT).items()):
            link.on_lost = lambda why, r=rank: self._lost(r, why)
            self._links[rank] = link
            if link.lost:
                raise ParallelGroupError(f"rank {rank} ({remote.host_of(rank)}) left before it started: {link.lost}")
            link.send(replace(setup, rank=rank))
        self._links = dict(sorted(self._links.items()))

    def join(self) -> list[KVCache | RemoteKVPart]:
        """Wait for every helper's KV part, then join the groups. The parts come back in rank
        order: mapped (CPU) or opened (CUDA IPC) in this process, each with its rank's transfer agent
        as its ``owner`` (the transports that act where the memory is: nixl), or, for a rank on
        another host, its spec alone; none from a rank that holds experts only."""
        from kvstore.transfer.nixl_ranks import RankAgentLink

        deadline = time.monotonic() + READY_TIMEOUT
        parts = [self._await_ready(r, deadline) for r in range(1, self.size)]
        for rank, part in enumerate(parts, start=1):
            if part is not None and rank in self._agent_conns:
                part.owner = RankAgentLink(self._agent_conns[rank], rank)
        self.groups = join_groups(self._store, self.layout, 0, self.device, self.host)
        self.shard.join(self.groups.tp, self.groups.ep)
        return [p for p in parts if p is not None]

    def _await_ready(self, rank: int, deadline: float) -> KVCache | RemoteKVPart | None:
        link, proc = self._links[rank], self._procs.get(rank)
        while not link.poll(0.2):
            if proc is not None and proc.poll() is not None:
                raise ParallelGroupError(f"rank {rank} exited with status {proc.returncode} while loading")
            if time.monotonic() > deadline:
                raise ParallelGroupError(f"rank {rank} not ready in {READY_TIMEOUT:.0f}s")
        try:
            spec_dict, where = link.recv()
        except EOFError:
            raise ParallelGroupError(f"rank {rank} failed while loading{self._where(rank)}") from None
        if spec_dict is None:  # a rank that holds experts only keeps no KV
            return None
        spec = KVCacheSpec.from_dict(spec_dict)
        if where is None:
            return RemoteKVPart(spec, rank)
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
        for rank, link in self._links.items():
            try:
                link.send_bytes(data)
            except OSError:
                self.abort(f"rank {rank} is gone{self._where(rank)}")
                raise ParallelGroupError(self._broken) from None

    def send_step(self, step, input_ids: torch.Tensor) -> None:
        """Tensor parallelism alone: the step, whole, to every helper; with rows whose token is
        in flight (overlapped scheduling), its ``input_ids`` from our device over the TP group."""
        fed = bool(step.feed)
        self.broadcast(StageStep.whole(replace(step, feed=[]), fed=fed))  # (a feed names our Sequences)
        if fed:
            share_ids(self.groups.tp, input_ids)

    def stats(self, reset: bool = False) -> list[StageStats]:
        """Every helper's ``StageStats``, in rank order (between steps)."""
        self.broadcast(StatsRequest(reset))
        out = []
        for rank, link in self._links.items():
            try:
                if not link.poll(STATS_TIMEOUT):
                    raise EOFError
                out.append(link.recv())
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

    def _lost(self, rank: int, why: str) -> None:
        """A rank on another host is gone (from its lifeline's thread, maybe while the engine thread
        waits on it in a collective): later steps fail, and ``on_lost`` tells the worker now. The
        ranks are stopped when the engine closes."""
        if self._broken:
            return
        self._broken = f"rank {rank} on {self.remote.host_of(rank)} is lost: {why}"
        log.error("rank group (%s): %s", self.layout.describe(), self._broken)
        if self.on_lost is not None:
            self.on_lost(self._broken)

    def _where(self, rank: int) -> str:
        if self.remote is None or rank not in self.remote.ranks:
            return ""
        link = self._links.get(rank)
        return f" (on {self.remote.host_of(rank)}{', ' + link.lost if link is not None and link.lost else ''})"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    def close(self) -> None:
        self._broken = self._broken or "the engine is closed"
        self._finalizer()
        if self.remote is not None:
            self.remote.close()


def _stop(procs: dict[int, subprocess.Popen], links: dict[int, Lifeline], paths: dict[int, str],
          agent_conns: dict[int, Connection]) -> None:
    for link in links.values():
        with contextlib.suppress(OSError):
            link.send(None)
        link.close()
    for proc in procs.values():
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in agent_conns.values():
        conn.close()
    for path in paths.values():
        Path(path).unlink(missing_ok=True)
