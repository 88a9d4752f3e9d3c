"""KV tiers below the device pool: host memory, then optionally disk.

    device pool (BlockPool)        host tier (HostTier)                disk tier (DiskTier)
    -----------------------        --------------------                --------------------
    ref_cnt 0, cached, LRU front
        | allocate() reuses the slot
        v
    on_evict(batch) ----copy----> a slot (or a touch: already held)
                                      | host full: its coldest entry goes
                                      v
                                  reused >= disk_min_hits? --write--> a file (tmp + rename)
                                  then its slot takes the new block      | over the cap: coldest unlinked
                                                                         | fails its check: unlinked, a miss
    a prefix hit below the device (KVCacheManager.admit):
        load()     host slots / verified files --copy--> staging, before anything can be evicted
        allocate() fresh device blocks (which may offload others, as above)
        onboard()  staging --copy--> the fresh blocks, named again (BlockStored device)

Who frees what: device blocks, the pool (refcounts); only ``ref_cnt == 0`` blocks are
offloaded, and their slots are reused only after the copy is issued. Host slots: only
``HostTier.store`` reuses them, coldest first; a block being onboarded was copied to
staging before. Disk files: only ``DiskTier`` (its cap, or a failed check).

The tiers are inclusive: onboarding copies a block up and leaves the lower copy in
place, so a block that goes back and forth between device and host is copied down once.

Peer fetch: blocks a worker fetched from a peer wait in ``PeerStage`` (not a cache
tier: no events, no snapshot) until the admission they were fetched for onboards
them like any hit below the device; each entry is used once, or dropped after a
TTL. On the holder, ``kvstore.pins`` pins the blocks it sends (``HostTier.pin``,
the disk tiers' ``pin``): a pinned block is never the one a tier evicts.

Events: device -> host is BlockRemoved(device) (the pool) + BlockStored(host); a host
eviction is BlockRemoved(host) (+ BlockStored(disk) when written); onboarding is
BlockStored(device). All go to the pool's event log, drained once per step.

``HostTier`` and ``TieredCache`` are bookkeeping, torch-free: the mocker runs them with
no bytes at all (a "virtual" host tier, and ``kvstore.disk.VirtualDiskTier``, that still
model hit rates). ``BlockCopier`` moves the bytes (torch, imported when one is built).
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvstore.disk import PinCounts
from kvstore.events import BlockRemoved, BlockStored, KvEventLog
from kvstore.peer import PeerStage
from kvstore.pool import EvictedBlock

if TYPE_CHECKING:
    import torch

    from kvstore.cache import KVCache
    from kvstore.disk import DiskTier, VirtualDiskTier

TIERS = ("device", "host", "disk")
HIT_SOURCES = ("device", "host", "disk", "peer")  # where a prefix hit's blocks came from


class LowerTier(Protocol):
    """A KV tier below the device pool (``HostTier``, ``DiskTier``).

    Contract: it names blocks by their chained hash; ``in`` is what a prefix walk asks,
    ``hashes()`` what a snapshot lists (under ``tier``), ``touch`` marks a block recently
    used in its own LRU. Every change to its set of blocks is a KV event with ``tier`` in
    the log it was given, and it frees only its own storage, coldest first. How bytes go
    in and out differs per tier (slots for the host, files for the disk): ``TieredCache``
    knows both.
    """

    tier: str

    def __contains__(self, block_hash: int) -> bool: ...

    def __len__(self) -> int: ...

    def hashes(self) -> list[int]: ...

    def touch(self, block_hash: int) -> None: ...

    def counters(self) -> dict[str, int]: ...


class DeviceBlock(NamedTuple):
    """A device block to read (``BlockCopier.stage``): what a peer fetch sends from the device pool."""

    block_id: int


@dataclass(slots=True)
class HostEntry:
    slot: int
    parent: int | None
    hits: int


class HostTier:
    """``num_slots`` block slots in host memory: hash -> slot, LRU (front = coldest)."""

    tier = "host"

    def __init__(self, num_slots: int, events: KvEventLog | None = None):
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.events = events if events is not None else KvEventLog(enabled=False)
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins = PinCounts()
        self.stored = 0
        self.evicted = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, block_hash: int) -> HostEntry | None:
        return self._entries.get(block_hash)

    def hashes(self) -> list[int]:
        return list(self._entries)

    def touch(self, block_hash: int) -> None:
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)

    def counters(self) -> dict[str, int]:
        return {"host_blocks": len(self._entries), "host_capacity_blocks": self.num_slots,
                "host_stored_blocks": self.stored, "host_evicted_blocks": self.evicted}

    def pin(self, block_hash: int) -> bool:
        """Keep a held block (and its slot) until ``unpin``: a peer fetch is reading it. False if not held."""
        return block_hash in self._entries and self._pins.add(block_hash)

    def unpin(self, block_hash: int) -> None:
        self._pins.remove(block_hash)

    def store(self, blocks: Sequence[EvictedBlock]) -> tuple[list[tuple[EvictedBlock, int]], list[tuple[int, HostEntry]]]:
        """Give each block not held yet a slot, evicting the coldest entries when full.

        Returns ``(stored, dropped)``: the new blocks with their slots, and the evicted
        ``(hash, entry)`` whose slots they take (read a dropped slot before writing it).
        Blocks already held are only marked recently used. ``blocks`` come coldest first;
        of a batch larger than the tier, the hottest end is kept. Pinned entries are never
        evicted: when only pinned ones are left, the remaining new blocks are not kept.
        """
        new: list[EvictedBlock] = []
        for b in blocks:
            held = self._entries.get(b.block_hash)
            if held is None:
                new.append(b)
            else:
                held.hits = max(held.hits, b.hits)
                self._entries.move_to_end(b.block_hash)
        stored: list[tuple[EvictedBlock, int]] = []
        dropped: list[tuple[int, HostEntry]] = []
        for b in new[-self.num_slots :]:
            if self._free:
                slot = self._free.pop()
            else:
                h = self._pins.coldest_unpinned(self._entries)
                if h is None:
                    break
                old = self._entries.pop(h)
                dropped.append((h, old))
                slot = old.slot
                self.evicted += 1
                self.events.append(BlockRemoved(h, self.tier))
            self._entries[b.block_hash] = HostEntry(slot, b.parent, b.hits)
            stored.append((b, slot))
            self.stored += 1
            self.events.append(BlockStored(b.block_hash, b.parent, self.tier))
        return stored, dropped


@dataclass
class Staged:
    """Blocks read from lower tiers for one admission, waiting for their device blocks."""

    hashes: list[int]
    tiers: list[str]  # where each came from
    hits: list[int]
    data: Any = None  # [n, *spec.block_shape] on the host; None without bytes

    def __len__(self) -> int:
        return len(self.hashes)


class TieredCache:
    """The policy over the lower tiers: offload what the device evicts, find and onboard prefix hits.

    ``host`` may be None (no offload: the cache then only onboards what a peer fetch staged).
    """

    def __init__(self, host: HostTier | None, disk: DiskTier | VirtualDiskTier | None = None,
                 copier: BlockCopier | None = None, disk_min_hits: int = 2):
        if disk is not None and disk.stores_bytes and copier is None:
            raise ValueError("a disk tier that stores bytes needs a block copier")
        if disk is not None and host is None:
            raise ValueError("the disk tier is fed by the host tier")
        if disk is not None and not disk.stores_bytes and copier is not None:
            raise ValueError("a virtual disk tier holds no bytes: it cannot back an engine with a block copier")
        self.host = host
        self.disk = disk
        self.lower: list[LowerTier] = [t for t in (host, disk) if t is not None]  # walk order
        self.peer = PeerStage()
        self.copier = copier
        self.disk_min_hits = disk_min_hits
        self.hit_blocks = dict.fromkeys(HIT_SOURCES[1:], 0)  # blocks onboarded from each tier

    # -- device evictions (the pool's on_evict hook) -----------------------------------------
    def offload(self, evicted: list[EvictedBlock]) -> None:
        if self.host is None:
            return
        stored, dropped = self.host.store(evicted)
        if dropped and self.disk is not None:
            self._spill(dropped)  # before the new blocks overwrite the dropped slots
        if stored and self.copier is not None:
            self.copier.offload([b.block_id for b, _ in stored], [slot for _, slot in stored])

    def _spill(self, dropped: list[tuple[int, HostEntry]]) -> None:
        """Host evictions worth keeping go to disk: blocks reused at least ``disk_min_hits`` times."""
        disk, copier = self.disk, self.copier
        keep = []
        for h, e in dropped:
            if h in disk:
                disk.touch(h)
            elif e.hits >= self.disk_min_hits:
                keep.append((h, e))
        if not disk.stores_bytes:
            for h, e in keep:
                disk.put(h, e.parent)
            return
        if keep:
            copier.sync()  # CUDA: an earlier offload may still be writing these slots
        for h, e in keep:
            disk.put(h, e.parent, copier.slot_bytes(e.slot))

    # -- prefix hits --------------------------------------------------------------------------
    def holds(self, block_hash: int) -> bool:
        return any(block_hash in t for t in self.lower) or block_hash in self.peer

    def stage_peer(self, hashes: Sequence[int], payloads: Sequence[Any] | None = None) -> None:
        """Blocks a peer sent for an admission about to happen (bytes-like payloads, in order)."""
        if payloads is None and self.copier is not None:
            raise ValueError("this engine holds KV bytes: peer blocks need their payloads")
        self.peer.put(hashes, payloads)

    def load(self, hashes: Sequence[int]) -> Staged:
        """Copy the blocks of ``hashes`` to staging: host first, then disk, then blocks a peer
        sent; stops at the first block it cannot read (a bad disk file ends the hit there)."""
        sources: list[int | memoryview] = []
        tiers: list[str] = []
        hits: list[int] = []
        host, disk, peer = self.host, self.disk, self.peer
        for h in hashes:
            entry = host.get(h) if host is not None else None
            if entry is not None:
                host.touch(h)
                sources.append(entry.slot)
                tiers.append("host")
                hits.append(entry.hits)
                continue
            payload = disk.get(h) if disk is not None else None
            if payload is not None:
                sources.append(payload)
                tiers.append("disk")
                hits.append(self.disk_min_hits)
                continue
            payload = peer.take(h)
            if payload is None:
                break
            sources.append(payload)
            tiers.append("peer")
            hits.append(1)  # it served a hit on the peer
        data = self.copier.stage(sources) if self.copier is not None and sources else None
        return Staged(list(hashes[: len(sources)]), tiers, hits, data)

    def onboard(self, staged: Staged, block_ids: list[int]) -> None:
        """Copy staged blocks into fresh device blocks (the caller names them)."""
        if self.copier is not None and staged.data is not None:
            self.copier.onboard(block_ids, staged.data)
        for t in staged.tiers:
            self.hit_blocks[t] += 1

    # -- the step and the outside world -------------------------------------------------------
    def before_step(self) -> None:
        if self.copier is not None:
            self.copier.before_step()

    def sync(self) -> None:
        if self.copier is not None:
            self.copier.sync()

    def snapshot(self) -> dict[str, list[int]]:
        return {t.tier: t.hashes() for t in self.lower}

    def counters(self) -> dict[str, int]:
        out = {f"hit_blocks_{t}": n for t, n in self.hit_blocks.items()}
        for t in self.lower:
            out.update(t.counters())
        out["peer_staged_blocks"] = self.peer.staged
        out["peer_expired_blocks"] = self.peer.expired
        return out


def gather_blocks(out: torch.Tensor, sources: Sequence, pool: torch.Tensor | None, slots: torch.Tensor | None) -> None:
    """``out[i]`` (block-major, ``[n, *spec.block_shape]``) <- block ``i`` of
    ``sources``: a ``DeviceBlock`` of ``pool`` (a KV pool, layer-major), an ``int`` slot of
    ``slots`` (block-major), or a bytes-like payload. One copy per block, straight into place:
    the holder's staging (``BlockCopier.stage``) and a requester reading a lent run out of the
    holder's files (``kvstore.transfer.fetch``) both copy this way."""
    import torch

    for i, src in enumerate(sources):
        if isinstance(src, DeviceBlock):
            out[i].copy_(pool[:, :, src.block_id])
        elif isinstance(src, int):
            out[i].copy_(slots[src])
        else:
            out[i].copy_(torch.frombuffer(src, dtype=torch.uint8).view(out.dtype).view(out.shape[1:]))


class BlockCopier:
    """Moves whole blocks between the device KV cache and the host tier's slots.

    Host slots are ``[num_slots, *spec.block_shape]``: each block one
    contiguous piece (what a disk file holds). On CPU every copy is a memcpy, done when
    the call returns. On CUDA the slots are pinned and the copies run on a stream of
    their own, ordered after the work already queued on the compute stream; the next
    step waits for them on the GPU (``before_step``) and CPU reads of the slots wait
    for them on the host (``sync``).
    """

    def __init__(self, kv: KVCache, num_slots: int, shm_path: str | None = None):
        import torch

        self._torch = torch
        self.kv = kv
        spec = kv.spec
        self.block_shape = spec.block_shape
        self.dtype = spec.dtype
        self.cuda = kv.device.type == "cuda"
        self.shm_path = shm_path  # CPU: the slots in a shared-memory file (a peer reads lent blocks there)
        self._mmap = None
        if shm_path is not None:
            if self.cuda:
                raise ValueError("host-tier slots in shared memory are for CPU workers")
            from kvstore.cache import map_file

            self._mmap = map_file(shm_path, num_slots * spec.block_bytes, create=True)
            self.slots = torch.frombuffer(self._mmap, dtype=self.dtype).view(num_slots, *self.block_shape)
        else:
            self.slots = torch.empty((num_slots, *self.block_shape), dtype=self.dtype, pin_memory=self.cuda)
        self.block_bytes = self.slots[0].numel() * self.slots.element_size()
        self.stream = torch.cuda.Stream(kv.device) if self.cuda else None
        self._done = None  # CUDA event after the last queued copy

    def offload(self, block_ids: list[int], slots: list[int]) -> None:
        """Device blocks -> host slots."""
        from kvstore.cache import block_runs

        cache = self.kv.tensor
        with self._side_stream():
            for b0, s0, n in block_runs(block_ids, slots):
                blocks = cache[:, :, b0 : b0 + n].permute(2, 0, 1, 3, 4, 5)
                if self.cuda:
                    blocks = blocks.contiguous()  # gathered on the GPU: the copy to pinned memory is one DMA
                self.slots[s0 : s0 + n].copy_(blocks, non_blocking=True)

    def stage(self, sources: list, out: torch.Tensor | None = None) -> torch.Tensor:
        """Host slots (ints), device blocks (``DeviceBlock``) and disk or peer payloads (bytes-like)
        -> one host tensor, in order (``out``: into its leading rows, e.g. a peer's mapped buffer)."""
        torch = self._torch
        if out is None:
            out = torch.empty((len(sources), *self.block_shape), dtype=self.dtype, pin_memory=self.cuda)
        self.sync()
        gather_blocks(out, sources, self.kv.tensor, self.slots)
        return out

    def onboard(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Staged blocks -> device blocks."""
        from kvstore.cache import block_runs

        cache = self.kv.tensor
        with self._side_stream():
            data = data.to(cache.device, non_blocking=True)  # CUDA: one DMA from pinned staging
            for d0, b0, n in block_runs(list(range(len(block_ids))), block_ids):
                cache[:, :, b0 : b0 + n].copy_(data[d0 : d0 + n].permute(1, 2, 0, 3, 4, 5))

    def slot_bytes(self, slot: int) -> memoryview:
        """A host slot's bytes (call ``sync`` first on CUDA)."""
        return memoryview(self.slots[slot].reshape(-1).view(self._torch.uint8).numpy())

    def close(self) -> None:
        """Drop the slots (and their shared-memory file)."""
        self.slots = self._torch.empty(0)
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a view may still be alive: unmapped when it goes
                self._mmap.close()
            self._mmap = None
        if self.shm_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.shm_path)

    def before_step(self) -> None:
        """The compute stream waits for the copies queued so far (no host wait)."""
        if self._done is not None:
            self._torch.cuda.current_stream(self.kv.device).wait_event(self._done)

    def sync(self) -> None:
        """The host waits for the copies queued so far."""
        if self._done is not None:
            self._done.synchronize()

    @contextlib.contextmanager
    def _side_stream(self):
        if not self.cuda:
            yield
            return
        torch = self._torch
        # The blocks were last written (or read) by work on the compute stream.
        self.stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(self.stream):
            yield
            self._done = torch.cuda.Event()
            self._done.record(self.stream)
