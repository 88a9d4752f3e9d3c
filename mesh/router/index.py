"""Which workers hold which blocks, per tier: the router's view of every cache.

Built from the workers' KV events (``apply``) and snapshots (``load_snapshot``);
``match`` answers, for a request's chained block hashes, how many leading blocks
each worker holds and which of them it holds only below the device (host, disk,
or predicted), which is what the router costs; ``overlap`` is the same credited
by fixed tier weights (one number per worker, for figures). Blocks of
workers that publish no events are *predicted* from the router's own decisions
and forgotten after a TTL (approximate mode); so are the blocks a routed request
will leave on a worker that does publish events, until the events about them
arrive (an event on a hash replaces its prediction) or a short TTL passes.

Sequence numbers: ``apply`` refuses a batch that does not follow the last one
seen from its worker (a gap), and the router resyncs that worker from a snapshot.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mesh.protocol import KvEventBatch
from mesh.router.costs import DEVICE, DISK, HOST, PREDICTED, REAL, default_costs

TIERS = {"device": DEVICE, "host": HOST, "disk": DISK, "predicted": PREDICTED}
DEFAULT_WEIGHTS = default_costs().credits()  # from the reference costs (mesh/router/costs.py)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A worker's leading run of a request's blocks: ``depth`` blocks held in any tier (or
    predicted), of which ``below`` lists the ``(position, tier bits)`` of those not on device."""

    depth: int
    below: tuple[tuple[int, int], ...] = ()

    def fetchable(self) -> int:
        """The leading blocks it holds for sure (a predicted block is still being computed)."""
        for pos, bits in self.below:
            if not bits & REAL:
                return pos
        return self.depth

    def tier_counts(self, start: int = 0, end: int | None = None) -> dict[str, int]:
        """Blocks in ``[start, end)`` of the run by their best tier."""
        end = self.depth if end is None else min(end, self.depth)
        out = {"device": max(end - start, 0)}
        for pos, bits in self.below:
            if start <= pos < end:
                tier = "host" if bits & HOST else "disk" if bits & DISK else "predicted"
                out[tier] = out.get(tier, 0) + 1
                out["device"] -= 1
        return out


class KvIndex:
    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = {**DEFAULT_WEIGHTS, **(weights or {})}
        self._holders: dict[int, dict[str, int]] = {}  # hash -> {worker: tier bits}
        self._blocks: dict[str, set[int]] = {}  # worker -> hashes it holds (any tier)
        self._seq: dict[str, int] = {}  # worker -> last applied batch
        self._predicted: dict[str, OrderedDict[int, float]] = {}  # worker -> hash -> expiry
        self._partial: set[int] = set()  # hashes some holder keeps off the device (may be stale)
        self.events_applied = 0
        # credit of a tier-bit combination: the best tier's weight
        self._credit = [0.0] * 16
        for bits in range(1, 16):
            self._credit[bits] = max(w for t, w in self.weights.items() if bits & TIERS[t])

    # -- updates ----------------------------------------------------------------------
    def apply(self, batch: KvEventBatch) -> bool:
        """Apply a worker's batch; False (and nothing applied) if it does not follow the last one."""
        w = batch.worker_id
        last = self._seq.get(w)
        if last is None or batch.seq != last + 1:
            return False
        self._seq[w] = batch.seq
        pred = self._predicted.get(w)
        for ev in batch.events:
            bit = TIERS.get(ev.tier, 1)
            if ev.kind == "stored":
                self._add(w, ev.hashes, bit)
            elif ev.kind == "removed":
                self._remove(w, ev.hashes, bit)
            elif ev.kind == "cleared":
                self.drop_worker(w, keep_seq=True)
                pred = None
            if pred:
                self._unpredict(w, pred, ev.hashes)  # the worker's word replaces the guess
            self.events_applied += len(ev.hashes)
        return True

    def load_snapshot(self, worker: str, seq: int, blocks: dict[str, Iterable[int]]) -> None:
        """Replace everything known about ``worker`` with its snapshot as of batch ``seq``."""
        self.drop_worker(worker)
        for tier, hashes in blocks.items():
            self._add(worker, hashes, TIERS.get(tier, 1))
        self._seq[worker] = seq

    def add_snapshot_page(self, worker: str, blocks: dict[str, Iterable[int]]) -> None:
        for tier, hashes in blocks.items():
            self._add(worker, hashes, TIERS.get(tier, 1))

    def predict(self, worker: str, hashes: Sequence[int], ttl: float, now: float | None = None) -> None:
        """Approximate mode: assume ``worker`` now holds these blocks, for ``ttl`` seconds."""
        now = time.monotonic() if now is None else now
        pred = self._predicted.setdefault(worker, OrderedDict())
        for h in hashes:
            pred.pop(h, None)
            pred[h] = now + ttl
        self._add(worker, hashes, TIERS["predicted"])

    def _unpredict(self, worker: str, pred: OrderedDict[int, float], hashes: Iterable[int]) -> None:
        gone = [h for h in hashes if pred.pop(h, None) is not None]
        if gone:
            self._remove(worker, gone, TIERS["predicted"])

    def expire(self, now: float | None = None) -> int:
        """Forget predictions past their TTL; returns how many went."""
        now = time.monotonic() if now is None else now
        gone = 0
        bit = TIERS["predicted"]
        for worker, pred in self._predicted.items():
            stale = []
            while pred:
                h, exp = next(iter(pred.items()))
                if exp > now:
                    break
                pred.popitem(last=False)
                stale.append(h)
            self._remove(worker, stale, bit)
            gone += len(stale)
        return gone

    def drop_worker(self, worker: str, keep_seq: bool = False) -> None:
        for h in self._blocks.pop(worker, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(worker, None)
                if not holders:
                    del self._holders[h]
                    self._partial.discard(h)
        self._predicted.pop(worker, None)
        if not keep_seq:
            self._seq.pop(worker, None)

    def _add(self, worker: str, hashes: Iterable[int], bit: int) -> None:
        mine = self._blocks.setdefault(worker, set())
        holders_of = self._holders
        partial = bit != DEVICE
        for h in hashes:
            holders = holders_of.get(h)
            if holders is None:
                holders_of[h] = {worker: bit}
            else:
                holders[worker] = holders.get(worker, 0) | bit
            mine.add(h)
            if partial:
                self._partial.add(h)

    def _remove(self, worker: str, hashes: Iterable[int], bit: int) -> None:
        mine = self._blocks.get(worker)
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None or worker not in holders:
                continue
            left = holders[worker] & ~bit
            if left:
                holders[worker] = left
                if not left & DEVICE:
                    self._partial.add(h)
                continue
            del holders[worker]
            if not holders:
                del self._holders[h]
                self._partial.discard(h)
            if mine is not None:
                mine.discard(h)

    # -- queries ----------------------------------------------------------------------
    def seq(self, worker: str) -> int | None:
        return self._seq.get(worker)

    def workers(self) -> list[str]:
        return list(self._blocks)

    def num_blocks(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    def tiers_of(self, worker: str, block_hash: int) -> set[str]:
        bits = self._holders.get(block_hash, {}).get(worker, 0)
        return {t for t, b in TIERS.items() if bits & b}

    def match(self, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """Per worker: its leading run of ``hashes`` and where it holds each block of it.

        Walks the blocks while any worker still matches; the work per block is a set test
        (C speed), plus a per-holder loop only on the few blocks some holder keeps off the
        device (host or disk tier, or predicted).
        """
        first = self._holders.get(hashes[0]) if hashes else None
        if not first:
            return {}
        alive = set(first)
        depth: dict[str, int] = {}
        below: dict[str, list[tuple[int, int]]] = {}
        n = 0
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                break
            keys = holders.keys()
            if not alive <= keys:
                for w in alive - keys:
                    depth[w] = n
                alive &= keys
                if not alive:
                    break
            if h in self._partial:
                for w in alive:
                    bits = holders[w]
                    if not bits & DEVICE:
                        below.setdefault(w, []).append((n, bits))
            n += 1
        for w in alive:
            depth[w] = n
        return {w: PrefixMatch(d, tuple(below.get(w, ()))) for w, d in depth.items()}

    def overlap(self, hashes: Sequence[int]) -> dict[str, float]:
        """Per worker: its leading run of ``hashes``, each block credited by its best tier."""
        credit_of = self._credit
        return {w: m.depth - sum(1.0 - credit_of[bits] for _, bits in m.below)
                for w, m in self.match(hashes).items()}
