"""The holder's side of a peer fetch: a run of cached blocks pinned by hash while a peer reads it.

A peer that lacks a prefix this worker holds asks for its blocks by chained hash.
``KvPins.pin`` walks the hashes through every tier (device, then host, then disk)
and pins the leading run it finds, so that nothing evicts those blocks while
they are being sent:

    device block   a reference is taken (``BlockPool.touch``): ref_cnt > 0 is never evicted
    host entry     ``HostTier.pin``: its slot is skipped when the tier needs room
    disk block     the disk tier's ``pin``: its file is skipped when the tier is over its cap

``read`` copies the pinned run's bytes, in order and from whichever tier holds
each block, into one host tensor (what a transport sends). Who frees the pins:
``release`` (the send finished or failed), or ``expire`` once the lease has run
out (the sender died or hung): every pin has a deadline, so a lost fetch costs
cache capacity for at most its lease. ``pin``, ``release`` and ``expire`` run where
the pool runs (the engine thread, between steps), like every other change to the
pool. ``read`` changes nothing and reads only pinned blocks (never reused while
pinned), so it may run on another thread while the engine steps: the decode
worker's peer fetch (``decode/peerfetch.py``) reads there, off the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.pool import BlockPool
from kvstore.tiers import DeviceBlock, TieredCache

if TYPE_CHECKING:
    from kvstore.tiers import BlockCopier


@dataclass
class PinnedRun:
    """The leading run of a fetch's hashes this worker holds, pinned until released."""

    fetch_id: str
    hashes: list[int]
    tiers: list[str]  # per block: where it is read from (device | host | disk)
    device_blocks: list[int]  # block ids holding a reference (in run order, device blocks only)
    expires: float
    tier_counts: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.hashes)


class KvPins:
    """Pinned runs by fetch id, over one pool and its lower tiers."""

    def __init__(self, pool: BlockPool, tiers: TieredCache | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.tiers = tiers
        self.clock = clock
        self._runs: dict[str, PinnedRun] = {}
        # counters
        self.pinned_runs = 0
        self.pinned_blocks = 0
        self.expired_runs = 0

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, fetch_id: str) -> bool:
        return fetch_id in self._runs

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(r) for r in self._runs.values())

    @property
    def serving_device(self) -> bool:
        """Some pinned run reads device blocks (a transfer out of device memory is under way)."""
        return any(r.device_blocks for r in self._runs.values())

    def pin(self, fetch_id: str, hashes: Sequence[int], lease_s: float) -> PinnedRun:
        """Pin the leading run of ``hashes`` held in any tier (it may be empty) for ``lease_s``."""
        if lease_s <= 0:
            raise ValueError(f"a pin needs a positive lease, got {lease_s}")
        if fetch_id in self._runs:
            raise ValueError(f"fetch {fetch_id!r} already holds pins")
        self.expire()
        host = self.tiers.host if self.tiers is not None else None
        disk = self.tiers.disk if self.tiers is not None else None
        run = PinnedRun(fetch_id, [], [], [], self.clock() + lease_s)
        for h in hashes:
            bid = self.pool.lookup(h)
            if bid is not None:
                self.pool.touch([bid])
                run.device_blocks.append(bid)
                tier = "device"
            elif host is not None and host.pin(h):
                tier = "host"
            elif disk is not None and disk.pin(h):
                tier = "disk"
            else:
                break
            run.hashes.append(h)
            run.tiers.append(tier)
            run.tier_counts[tier] = run.tier_counts.get(tier, 0) + 1
        self._runs[fetch_id] = run
        self.pinned_runs += 1
        self.pinned_blocks += len(run)
        return run

    def read(self, fetch_id: str, copier: BlockCopier, out=None) -> tuple[object, int]:
        """The pinned run's bytes as one host tensor ``[n, *spec.block_shape]`` (``out``,
        when given, with room for the run), and ``n``: the blocks read, a leading part of the run (a
        disk file that fails its check ends it)."""
        sources = self.sources(fetch_id)
        return copier.stage(sources, out), len(sources)

    def sources(self, fetch_id: str) -> list:
        """Where each block of the pinned run is, for ``BlockCopier.stage``: device blocks, host
        slots, disk payloads (read here: file I/O, so off the engine thread); a disk file that
        fails its check ends the list."""
        run = self._runs[fetch_id]
        sources: list = []
        host = self.tiers.host if self.tiers is not None else None
        disk = self.tiers.disk if self.tiers is not None else None
        devices = iter(run.device_blocks)
        for h, tier in zip(run.hashes, run.tiers, strict=True):
            if tier == "device":
                sources.append(DeviceBlock(next(devices)))
            elif tier == "host":
                sources.append(host.get(h).slot)
            else:
                payload = disk.read(h)  # no bookkeeping: this may run off the engine thread
                if payload is None:
                    break
                sources.append(payload)
        return sources

    def release(self, fetch_id: str) -> bool:
        """Unpin a run (the send is over, however it ended); False if it was not pinned (expired)."""
        run = self._runs.pop(fetch_id, None)
        if run is None:
            return False
        self._unpin(run)
        return True

    def expire(self, now: float | None = None) -> int:
        """Release every run past its lease; returns how many."""
        now = self.clock() if now is None else now
        stale = [fid for fid, r in self._runs.items() if r.expires <= now]
        for fid in stale:
            self._unpin(self._runs.pop(fid))
        self.expired_runs += len(stale)
        return len(stale)

    def _unpin(self, run: PinnedRun) -> None:
        if run.device_blocks:
            self.pool.free(reversed(run.device_blocks))
        host = self.tiers.host if self.tiers is not None else None
        disk = self.tiers.disk if self.tiers is not None else None
        for h, tier in zip(run.hashes, run.tiers, strict=True):
            if tier == "host":
                host.unpin(h)
            elif tier == "disk":
                disk.unpin(h)

    def counters(self) -> dict[str, int]:
        return {"fetch_pinned_runs": self.pinned_runs, "fetch_pinned_blocks": self.pinned_blocks,
                "fetch_pins_expired": self.expired_runs, "fetch_pinned_now": self.num_pinned_blocks}
