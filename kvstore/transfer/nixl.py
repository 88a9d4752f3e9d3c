"""``nixl``: any host, CPU (DRAM) or GPU (VRAM). The sender WRITEs its blocks straight into the
decode worker's KV pool over NIXL (UCX: TCP between hosts here, RDMA and GPUDirect in a
datacenter); a NIXL notification tells the receiver the bytes have landed. It carries the
job's PrefillDone (``send(..., done=)``): the decode worker goes on when the notification comes
(``on_done``), with no NATS hop after the write; the PrefillDone over NATS still follows (a
failure has only that one, and the second of the two is ignored).

Each worker registers its whole KV pool once (``NixlNode.register``); the pool is the
``[layers, planes, blocks, ...]`` tensor, so a run of consecutive blocks is one contiguous piece
per (layer, plane): one descriptor per plane and run (``pieces``). Planes are K and V, or one
latent plane for MLA models.

    params  {"agent", "host", "rev", "md", "begin",             the receiver's agent and handshake
             "addr", "size", "num_blocks", "layers",            its registered pool (flat values)
             "block_size", "heads", "head_dim", "dtype", "gen", the job's write generation
             "planes"}                                          (absent: 2, K and V)

Trust: the sender writes only into a region the receiver's agent itself lists in its metadata
(the params' ``addr``/``size`` must be exactly that region, every descriptor inside it, every
block id in range), and only after the receiver granted this job's generation (``NixlBegin``);
anything else is ``Refused`` (logged, counted: ``pdmesh_nixl_refused``; the prefill worker
counts it too and goes on serving).

Fence (the shm contract, ``fence.py``): a job is armed by ``params``; a grant moves it to
writing; ``revoke`` is True for a job never granted (no write will start: the grant is refused
from now on) or one whose notification came, False while a granted write may still land.

The grant is asked ahead (``prepare``: when the prefill worker takes the job, while it
computes), so the write pays no round trip for it. The receiver polls fast for
``GRANT_FAST_FOR`` after granting (a short prefill's write lands within it); a write that starts
later kicks it first (``NixlBegin`` with ``writing``, one way). A live writer ends every granted job with
its PrefillDone (ok or not), which frees the blocks; a writer that dies holding a grant is
seen by the registry (``writer_left``: its card gone or expired), which orphans its jobs.

Several ranks: pools of one rank only (one tensor per side). A TP > 1 worker registers one region
per rank (``parts``), and a head-range overlap of two shards is strided inside a block
(heads are the second-last dim), so each (plane, run, overlap) needs a descriptor per token
row: that is the work left for TP > 1; such workers use shm or nats (a pipeline stage's part is whole
layers: a descriptor per layer, plane and run, the easier half of the same work).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvstore.cache import KVCache, ShardedKVCache, block_runs
from kvstore.transfer import (
    TransferResult,
    TransferTarget,
    host_id,
    register_receiver,
    register_sender,
    run_to_end,
)
from kvstore.transfer.messenger import Messenger
from kvstore.transfer.nixl_agent import (
    Grants,
    NixlNode,
    Region,
    WriteJob,
    carrying,
    notif_key,
    refuse,
)
from kvstore.transfer.nixl_progress import GRANT_FAST_FOR

log = logging.getLogger(__name__)

GRANTS_KEPT = 1024  # grants asked ahead and not yet sent, at most
FINISH_TIMEOUT = 5.0  # seconds the receiver waits for a notification once the sender says it is done
KICK_MARGIN = 0.02  # seconds: a write this close to the end of the receiver's fast polls kicks them anew


@dataclass
class _Job(WriteJob):
    blocks: list[int] = field(default_factory=list)


def one_tensor(kv: KVCache | ShardedKVCache):
    """The pool as one contiguous tensor (one rank: TP 1, PP 1), or ValueError."""
    parts = kv.parts()
    if len(parts) != 1 or not parts[0].cache.tensor.is_contiguous():
        raise ValueError("the nixl transport serves KV pools of one rank (TP 1, PP 1) only")
    return parts[0].cache.tensor


def region_of(node: NixlNode, kind: str, tensor) -> Region:
    mem = "VRAM" if tensor.is_cuda else "DRAM"
    return node.register(kind, tensor.data_ptr(), tensor.numel() * tensor.element_size(), mem,
                         tensor.device.index or 0 if tensor.is_cuda else 0)


def pieces(base: int, num_blocks: int, planes: int, plane_block: int,
           runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(addr, len) of each (plane, run of ``(first block, count)``) of a ``[planes, blocks, ...]`` pool."""
    return [(base + (p * num_blocks + first) * plane_block, count * plane_block)
            for p in range(planes) for first, count in runs]


_INT = ("rev", "addr", "size", "num_blocks", "layers", "block_size", "heads", "head_dim", "gen")
_STR = ("agent", "host", "md", "begin", "dtype")


def check_params(params: dict) -> dict:
    """The params, checked flat and well formed; ``Refused`` otherwise."""
    try:
        bad = [k for k in _INT if type(params[k]) is not int or params[k] < 0] + \
              [k for k in _STR if not isinstance(params[k], str) or not params[k]]
    except (KeyError, TypeError):
        raise refuse("malformed", "nixl params lack a field") from None
    if bad:
        raise refuse("malformed", f"nixl params: bad {', '.join(bad)}")
    return params


@register_receiver("nixl")
class NixlReceiver:
    name = "nixl"

    def __init__(self, kv: KVCache | ShardedKVCache, bus: Messenger, model: str, worker_id: str, **_):
        self.tensor = one_tensor(kv)
        self.spec = kv.spec
        self.bus, self.model, self.worker_id = bus, model, worker_id
        self.node = NixlNode.for_worker(worker_id)
        self.region: Region | None = None
        self.grants: Grants[_Job] = Grants(self.node, "kv")
        s = bus.subjects
        self._static = {"agent": self.node.name, "host": host_id(), "md": s.nixl(model, worker_id, "md"),
                        "begin": s.nixl(model, worker_id, "begin"), "num_blocks": self.spec.num_blocks,
                        "layers": self.spec.num_layers, "block_size": self.spec.block_size,
                        "heads": self.spec.num_kv_heads, "head_dim": self.spec.head_dim,
                        "planes": self.spec.num_planes, "dtype": str(self.spec.dtype).removeprefix("torch.")}

    async def start(self) -> None:
        # registering a large pool can take a while: off the event loop
        self.region = await asyncio.to_thread(region_of, self.node, "kv", self.tensor)
        self._static.update(addr=self.region.addr, size=self.region.size)
        await self.node.serve(self.bus, self.model, self.worker_id)

    def card_params(self) -> dict:
        """What the worker card says: the agent (its metadata is asked on ``md``, once per peer)."""
        return {"agent": self.node.name, "host": host_id(), "md": self._static["md"]}

    def params(self, request_id: str, dest_blocks: list[int]) -> dict:
        gen = self.grants.next_gen()
        self.grants.jobs[request_id] = _Job(gen, blocks=list(dest_blocks))
        return {**self._static, "rev": self.node.rev, "gen": gen}

    async def finish(self, request_id: str) -> bool:
        job = self.grants.jobs.get(request_id)
        if job is None:
            return False
        if not await self.grants.wait(request_id, job, FINISH_TIMEOUT):
            log.warning("nixl: no completion of %s came (%s)", request_id, job.state.name)
            return False
        return True

    def revoke(self, request_id: str) -> bool:
        return self.grants.revoke(request_id)

    @property
    def on_done(self):
        return self.grants.on_done

    @on_done.setter
    def on_done(self, take) -> None:
        """``(request_id, payload)``: a sender's ``done`` came in the notification after its bytes."""
        self.grants.on_done = take

    def writer_left(self, worker_id: str) -> int:
        """The registry's "left" for worker ``worker_id``: its granted jobs write nothing more."""
        return self.grants.writer_left(worker_id)

    def forget(self, request_id: str) -> None:
        self.grants.jobs.pop(request_id, None)


@register_sender("nixl")
class NixlSender:
    """``copy_delay_s``: fault injection (tests, chaos runs): each write waits this long after its
    grant, so that it ends after the job's deadline."""

    name = "nixl"
    carries_done = True  # ``send(..., done=...)``: in the notification, after the bytes

    def __init__(self, bus: Messenger, worker_id: str = "", copy_delay_s: float = 0.0, **_):
        self.bus = bus
        self.node = NixlNode.for_worker(worker_id or f"sender-{os.getpid()}")
        self.copy_delay_s = copy_delay_s
        self.grants: OrderedDict[tuple[str, int], asyncio.Future] = OrderedDict()  # asked ahead, by (job, gen)

    def usable(self, params: dict) -> bool:
        check_params(params)
        peer = self.node.peers.get(params["agent"])
        if peer is not None and peer.rev >= params["rev"]:
            self._region(peer.regions, params)  # Refused now, before the job is taken
        return True

    @staticmethod
    def _region(regions: list[Region], params: dict) -> Region:
        for r in regions:
            if r.kind == "kv" and r.addr == params["addr"] and r.size == params["size"]:
                return r
        raise refuse("unregistered_memory", f"params name memory agent {params['agent']!r} never registered "
                                            f"({params['size']} bytes at {params['addr']:#x})")

    @staticmethod
    def _check(target: TransferTarget, p: dict, spec, dst: Region) -> None:
        """The job's destination is the decode worker's registered pool, of our layout, in range."""
        if (p["layers"], p.get("planes", 2), p["block_size"], p["heads"], p["head_dim"], p["dtype"]) != (
                spec.num_layers, spec.num_planes, spec.block_size, spec.num_kv_heads, spec.head_dim,
                str(spec.dtype).removeprefix("torch.")):
            raise ValueError("the decode worker's KV layout or dtype differs from ours")
        nb = p["num_blocks"]
        if nb * spec.block_bytes != dst.size:
            raise refuse("malformed", "blocks do not match the registered pool")
        if any(not 0 <= b < nb for b in target.dest_block_ids):
            raise refuse("block_range", "destination block out of range")

    def _plan(self, target: TransferTarget, p: dict, src, src_blocks: list[int], mine: Region, dst: Region):
        """The local and remote (addr, len) pieces of this job's blocks, every remote one inside ``dst``."""
        spec, nb = src.spec, p["num_blocks"]
        self._check(target, p, spec, dst)
        if len(target.dest_block_ids) != len(src_blocks):
            raise refuse("malformed", "blocks do not match the registered pool")
        planes = spec.num_planes * spec.num_layers  # (layer, plane) pairs, each [blocks, ...]
        plane_block = spec.block_bytes // planes
        runs = block_runs(src_blocks, target.dest_block_ids)
        local = pieces(mine.addr, spec.num_blocks, planes, plane_block, [(s, n) for s, _, n in runs])
        remote = pieces(dst.addr, nb, planes, plane_block, [(d, n) for _, d, n in runs])
        if not all(dst.holds(a, n) for a, n in remote):
            raise refuse("unregistered_memory", "a descriptor outside the registered pool")
        return local, remote

    def prepare(self, target: TransferTarget, params: dict, src: KVCache | ShardedKVCache) -> None:
        """The job is taken: ask its write grant now, while the prefill computes (``send`` awaits
        it). The same checks as ``send`` come first: nothing is granted to a job it would refuse."""
        key = (target.request_id, check_params(params)["gen"])
        if key not in self.grants:
            self.grants[key] = grant = asyncio.ensure_future(self._grant(target, params, src.spec))
            grant.add_done_callback(lambda f: f.cancelled() or f.exception())  # send raises it
            while len(self.grants) > GRANTS_KEPT:  # asked for jobs that never sent (failed first)
                self.grants.popitem(last=False)[1].cancel()

    async def _grant(self, target: TransferTarget, p: dict, spec) -> float:
        """The job's write grant; when it came (monotonic)."""
        peer = await self.node.peer(self.bus, p["md"], p["agent"], p["rev"])
        self._check(target, p, spec, self._region(peer.regions, p))
        await self.node.ask_grant(self.bus, p["begin"], "kv", target.request_id, p["gen"])
        return time.monotonic()

    async def send(self, target: TransferTarget, params: dict, src: KVCache | ShardedKVCache,
                   src_blocks: list[int], done: bytes = b"") -> TransferResult:
        """Write the blocks; ``done`` (the job's encoded PrefillDone) rides in the notification."""
        p = check_params(params)
        t0 = time.perf_counter()
        tensor = one_tensor(src)
        mine = self.node.registered(tensor.data_ptr(), tensor.numel() * tensor.element_size()) or \
            await asyncio.to_thread(region_of, self.node, "kv", tensor)  # once: registering takes a while
        peer = await self.node.peer(self.bus, p["md"], p["agent"], p["rev"])
        dst = self._region(peer.regions, p)
        local, remote = self._plan(target, p, src, src_blocks, mine, dst)
        grant = self.grants.pop((target.request_id, p["gen"]), None)
        if grant is None or grant.cancelled():  # not asked ahead (or dropped unsent)
            await self.node.ask_grant(self.bus, p["begin"], "kv", target.request_id, p["gen"])
        elif time.monotonic() - await grant > GRANT_FAST_FOR - KICK_MARGIN:
            # the receiver's fast polls after its grant are over (a long prefill): poll fast now.
            # Within them the kick is left out: it cost the send 0.4-0.7 ms (a publish, a loop turn)
            await self.node.writing(self.bus, p["begin"], "kv", target.request_id, p["gen"])
        # Granted: from here the write runs to its end even if this task is cancelled (a timeout),
        # so that the PrefillDone sent after it means nothing writes the blocks any more.
        notif = carrying(notif_key("kv", target.request_id, p["gen"]), done)
        if self.copy_delay_s:  # fault injection: a write that ends after the deadline
            await run_to_end(self._late_write(peer, mine, local, dst, remote, notif))
        else:  # the post comes before the first yield; the wait is shielded (``NixlNode.write``)
            await self.node.write(peer, mine, local, dst, remote, notif)
        nbytes = len(src_blocks) * src.spec.block_bytes
        return TransferResult(self.name, nbytes, time.perf_counter() - t0, len(local))

    async def _late_write(self, peer, mine: Region, local, dst: Region, remote, notif: bytes) -> None:
        await asyncio.sleep(self.copy_delay_s)
        await self.node.write(peer, mine, local, dst, remote, notif)
