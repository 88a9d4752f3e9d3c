"""``nixl``: any host, CPU (DRAM) or GPU (VRAM). The sender WRITEs its blocks straight into the
decode worker's KV pool over NIXL (UCX: TCP between hosts here, RDMA and GPUDirect in a
datacenter); a NIXL notification tells the receiver the bytes have landed. It carries the
job's PrefillDone (``send(..., done=)``): the decode worker goes on when the notification comes
(``on_done``), with no NATS hop after the write; the PrefillDone over NATS still follows (a
failure has only that one, and the second of the two is ignored).

Each worker registers its whole KV pool once (``NixlNode.register``); the pool is the
``[layers, planes, blocks, ...]`` tensor, so a run of consecutive blocks is one contiguous piece
per (layer, plane): one descriptor per plane and run (``nixl_parts``). Planes are K and V, or one
latent plane for MLA models.

    params  {"agent", "host", "rev", "md", "begin",             the receiver's agent and handshake
             "addr", "size", "num_blocks", "layers",            its registered pool (flat values;
             "block_size", "heads", "head_dim", "dtype", "gen", its rank 0's part at several ranks),
             "planes",                                          (absent: 2, K and V)
             "parts"}                                           (several ranks: every part, ``nixl_parts``)

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

Several ranks (TP x PP): every rank runs its own agent and registers its own part
(``nixl_ranks``); the receiver's params list its parts, and each part of the sender's writes
what it holds straight into the receiving parts that hold the same layers and heads, one
transfer per pair, each ending with its own notification (``nixl_parts``). Rank 0 of the
receiver gathers them; the job is done once every pair's came.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from kvstore.cache import KVCache, KVCacheSpec, ShardedKVCache, block_runs
from kvstore.transfer import (
    TransferResult,
    TransferTarget,
    host_id,
    register_receiver,
    register_sender,
    run_to_end,
)
from kvstore.transfer.messenger import Messenger
from kvstore.transfer.nixl_agent import NixlNode, Peer, Region, carrying, notif_key, refuse
from kvstore.transfer.nixl_grants import Grants, WriteJob
from kvstore.transfer.nixl_parts import (
    Geometry,
    PairWrite,
    PartPlace,
    check_tiling,
    inside,
    part_key,
    parts_of_params,
    plan_pairs,
)
from kvstore.transfer.nixl_progress import GRANT_FAST_FOR
from kvstore.transfer.nixl_ranks import LocalPart, RankPart, part_agents

log = logging.getLogger(__name__)

GRANTS_KEPT = 1024  # grants asked ahead and not yet sent, at most
FINISH_TIMEOUT = 5.0  # seconds the receiver waits for a notification once the sender says it is done
KICK_MARGIN = 0.02  # seconds: a write this close to the end of the receiver's fast polls kicks them anew


@dataclass
class _Job(WriteJob):
    blocks: list[int] = field(default_factory=list)


def geometry(spec: KVCacheSpec) -> Geometry:
    """The whole pool's layers and heads, and one head's bytes per token row."""
    rows = spec.num_layers * spec.num_planes * spec.block_size * spec.num_kv_heads
    return Geometry(spec.num_layers, spec.num_kv_heads, spec.num_planes, spec.block_size, spec.block_bytes // rows)


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
        self.spec = kv.spec
        self.bus, self.model, self.worker_id = bus, model, worker_id
        self.node = NixlNode.for_worker(worker_id)
        self.kv_parts = kv.parts()  # rank 0's own first
        self.parts = part_agents(self.node, kv, worker_id)
        self.region: Region | None = None  # rank 0's part
        self.grants: Grants[_Job] = Grants(self.node, "kv")
        s = bus.subjects
        self._static = {"agent": self.node.name, "host": host_id(), "md": s.nixl(model, worker_id, "md"),
                        "begin": s.nixl(model, worker_id, "begin"), "num_blocks": self.spec.num_blocks,
                        "layers": self.spec.num_layers, "block_size": self.spec.block_size,
                        "heads": self.spec.num_kv_heads, "head_dim": self.spec.head_dim,
                        "planes": self.spec.num_planes, "dtype": str(self.spec.dtype).removeprefix("torch.")}

    async def start(self) -> None:
        for part in self.parts:  # registering a large pool can take a while: off the event loop
            await part.start()
            if isinstance(part, RankPart):  # a helper rank's agent: we answer for it, it tells us what came
                self.node.proxies[part.name] = part.metadata()
                part.link.on_notifs = self.node._deliver
                self.node.relays.append(part)
        self.region = self.parts[0].region
        self._static.update(addr=self.region.addr, size=self.region.size)
        await self.node.serve(self.bus, self.model, self.worker_id)

    def card_params(self) -> dict:
        """What the worker card says: the agent (its metadata is asked on ``md``, once per peer)."""
        return {"agent": self.node.name, "host": host_id(), "md": self._static["md"]}

    def params(self, request_id: str, dest_blocks: list[int]) -> dict:
        gen = self.grants.next_gen()
        self.grants.jobs[request_id] = _Job(gen, blocks=list(dest_blocks))
        out = {**self._static, "rev": self.node.rev, "gen": gen}
        if len(self.parts) > 1:
            out["parts"] = [PartPlace(a.name, a.rev, a.region.addr, a.region.size, p.layers, p.heads).to_param()
                            for a, p in zip(self.parts, self.kv_parts, strict=True)]
        return out

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


Destination = tuple[PartPlace, Peer, Region]  # a receiving part: where, its agent, its registered region


@register_sender("nixl")
class NixlSender:
    """``copy_delay_s``: fault injection (tests, chaos runs): each write waits this long after its
    grant, so that it ends after the job's deadline."""

    name = "nixl"
    carries_done = True  # ``send(..., done=...)``: in the notification, after the bytes

    def __init__(self, bus: Messenger, worker_id: str = "", copy_delay_s: float = 0.0, **_):
        self.bus = bus
        self.worker_id = worker_id or f"sender-{os.getpid()}"
        self.node = NixlNode.for_worker(self.worker_id)
        self.copy_delay_s = copy_delay_s
        self.grants: OrderedDict[tuple[str, int], asyncio.Future] = OrderedDict()  # asked ahead, by (job, gen)
        self._sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a pool -> its parts' agents
        self._starting = asyncio.Lock()

    def usable(self, params: dict) -> bool:
        p = check_params(params)
        for place in self._places(p):
            peer = self.node.peers.get(place.agent)
            if peer is not None and peer.rev >= place.rev:
                self._region(peer.regions, place)  # Refused now, before the job is taken
        return True

    @staticmethod
    def _places(p: dict) -> list[PartPlace]:
        """The receiving parts the params name: their ``parts``, or the flat fields' one."""
        whole = PartPlace(p["agent"], p["rev"], p["addr"], p["size"], (0, p["layers"]), (0, p["heads"]))
        try:
            places = parts_of_params(p, whole)
            check_tiling(places, Geometry(p["layers"], p["heads"], 1, 1, 1))
        except ValueError as e:
            raise refuse("malformed", str(e)) from None
        return places

    @staticmethod
    def _region(regions: list[Region], place: PartPlace) -> Region:
        for r in regions:
            if r.kind == "kv" and r.addr == place.addr and r.size == place.size:
                return r
        raise refuse("unregistered_memory", f"params name memory agent {place.agent!r} never registered "
                                            f"({place.size} bytes at {place.addr:#x})")

    @staticmethod
    def _check(target: TransferTarget, p: dict, spec: KVCacheSpec, places: list[PartPlace]) -> None:
        """The job's destination is the decode worker's registered pool, of our layout, in range."""
        if (p["layers"], p.get("planes", 2), p["block_size"], p["heads"], p["head_dim"], p["dtype"]) != (
                spec.num_layers, spec.num_planes, spec.block_size, spec.num_kv_heads, spec.head_dim,
                str(spec.dtype).removeprefix("torch.")):
            raise ValueError("the decode worker's KV layout or dtype differs from ours")
        nb, geo = p["num_blocks"], geometry(spec)
        if any(nb * geo.part_block_bytes(place) != place.size for place in places):
            raise refuse("malformed", "blocks do not match the registered pool")
        if any(not 0 <= b < nb for b in target.dest_block_ids):
            raise refuse("block_range", "destination block out of range")

    async def _destination(self, target: TransferTarget, p: dict, spec: KVCacheSpec) -> list[Destination]:
        """Every receiving part, checked against what its agent registered (``Refused`` otherwise)."""
        places = self._places(p)
        self._check(target, p, spec, places)
        out = []
        for place in places:
            peer = await self.node.peer(self.bus, p["md"], place.agent, place.rev)
            out.append((place, peer, self._region(peer.regions, place)))
        return out

    async def _source(self, src: KVCache | ShardedKVCache) -> list[LocalPart | RankPart]:
        """Our pool's parts, each registered by its rank's agent (once: registering takes a while)."""
        async with self._starting:
            agents = self._sources.get(src)
            if agents is None:
                agents = part_agents(self.node, src, self.worker_id)
                for agent in agents:
                    await agent.start()
                self._sources[src] = agents
        return agents

    def _plan(self, target: TransferTarget, src: KVCache | ShardedKVCache, src_blocks: list[int],
              agents: list[LocalPart | RankPart], dest: list[Destination], dst_blocks: int) -> list[PairWrite]:
        """Each (our part, their part) pair's local and remote pieces, every remote one inside its region."""
        if len(target.dest_block_ids) != len(src_blocks):
            raise refuse("malformed", "blocks do not match the registered pool")
        mine = [PartPlace(a.name, a.rev, a.region.addr, a.region.size, part.layers, part.heads)
                for a, part in zip(agents, src.parts(), strict=True)]
        pairs = plan_pairs(mine, src.spec.num_blocks, [place for place, _, _ in dest], dst_blocks,
                           geometry(src.spec), block_runs(src_blocks, target.dest_block_ids))
        if not all(inside(pw.remote, dest[pw.dst][2].addr, dest[pw.dst][2].size) for pw in pairs):
            raise refuse("unregistered_memory", "a descriptor outside the registered pool")
        return pairs

    def prepare(self, target: TransferTarget, params: dict, src: KVCache | ShardedKVCache) -> None:
        """The job is taken: ask its write grant now, while the prefill computes (``send`` awaits
        it). The same checks as ``send`` come first: nothing is granted to a job it would refuse."""
        key = (target.request_id, check_params(params)["gen"])
        if key not in self.grants:
            self.grants[key] = grant = asyncio.ensure_future(self._grant(target, params, src.spec))
            grant.add_done_callback(lambda f: f.cancelled() or f.exception())  # send raises it
            while len(self.grants) > GRANTS_KEPT:  # asked for jobs that never sent (failed first)
                self.grants.popitem(last=False)[1].cancel()

    async def _grant(self, target: TransferTarget, p: dict, spec: KVCacheSpec) -> float:
        """The job's write grant; when it came (monotonic)."""
        await self._destination(target, p, spec)
        await self.node.ask_grant(self.bus, p["begin"], "kv", target.request_id, p["gen"])
        return time.monotonic()

    async def send(self, target: TransferTarget, params: dict, src: KVCache | ShardedKVCache,
                   src_blocks: list[int], done: bytes = b"") -> TransferResult:
        """Write the blocks, from each of our parts into each of theirs that holds the same layers
        and heads; ``done`` (the job's encoded PrefillDone) rides in the first pair's notification."""
        p = check_params(params)
        t0 = time.perf_counter()
        agents = await self._source(src)
        dest = await self._destination(target, p, src.spec)
        pairs = self._plan(target, src, src_blocks, agents, dest, p["num_blocks"])
        for pw in pairs:  # the receiving rank's agent, known to the sending rank's
            await agents[pw.src].ensure_peer(dest[pw.dst][1])
        grant = self.grants.pop((target.request_id, p["gen"]), None)
        if grant is None or grant.cancelled():  # not asked ahead (or dropped unsent)
            await self.node.ask_grant(self.bus, p["begin"], "kv", target.request_id, p["gen"])
        elif time.monotonic() - await grant > GRANT_FAST_FOR - KICK_MARGIN:
            # the receiver's fast polls after its grant are over (a long prefill): poll fast now.
            # Within them the kick is left out: it cost the send 0.4-0.7 ms (a publish, a loop turn)
            await self.node.writing(self.bus, p["begin"], "kv", target.request_id, p["gen"])
        # Granted: from here the writes run to their end even if this task is cancelled (a timeout),
        # so that the PrefillDone sent after them means nothing writes the blocks any more.
        key = notif_key("kv", target.request_id, p["gen"])
        writes = [agents[pw.src].write(dest[pw.dst][1], pw.local, dest[pw.dst][2], pw.remote,
                                       carrying(part_key(key, i, len(pairs)), done if i == 0 else b""))
                  for i, pw in enumerate(pairs)]
        if self.copy_delay_s:  # fault injection: a write that ends after the deadline
            await run_to_end(self._late(writes))
        elif len(writes) == 1:  # the post comes before the first yield; the wait is shielded (``NixlNode.write``)
            await writes[0]
        else:
            await run_to_end(_every(writes))
        nbytes = len(src_blocks) * src.spec.block_bytes
        return TransferResult(self.name, nbytes, time.perf_counter() - t0, sum(len(pw.local) for pw in pairs))

    async def _late(self, writes: list) -> None:
        await asyncio.sleep(self.copy_delay_s)
        await _every(writes)


async def _every(writes: list) -> None:
    """Run every write to its end; then the first failure, if any (all have ended by then)."""
    results = await asyncio.gather(*writes, return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
