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

How it is held (issue 51: a decision at 1,000 workers with 1M blocks indexed): each worker has a
small integer, its *slot* (``Slots``), and each block hash one int, the mask of the slots that hold
it in any tier. The walk of a request's blocks is then one AND of masks per block, whatever the
number of holders (a system prompt every worker caches had cost a set test over all of them per
block). Tiers other than the device, the exception, sit beside it: per hash, the slots that hold
it anywhere but (only) on the device, with their tier bits.

    _any:  hash -> mask of holder slots        _off:  hash -> {slot: tier bits}  (bits != DEVICE)
    _below: hash -> mask of the slots whose bits have no DEVICE (what a walk looks at one by one)
    _blocks: worker -> its hashes (to drop a worker that leaves)
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mesh.protocol import KvEventBatch
from mesh.router.costs import DEVICE, DISK, HOST, PREDICTED, REAL, default_costs
from mesh.router.slots import Slots, slots_in

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


_PLAIN: dict[int, PrefixMatch] = {}  # depth -> the match of a run held wholly on the device (immutable: shared)


def plain_match(depth: int) -> PrefixMatch:
    m = _PLAIN.get(depth)
    if m is None:
        m = _PLAIN[depth] = PrefixMatch(depth)
    return m


class KvIndex:
    def __init__(self, weights: dict[str, float] | None = None, slots: Slots | None = None):
        self.weights = {**DEFAULT_WEIGHTS, **(weights or {})}
        self.slots = slots if slots is not None else Slots()
        self._owns_slots = slots is None  # else the router gives slots back when workers leave
        self._any: dict[int, int] = {}  # hash -> mask of the slots holding it (any tier)
        self._off: dict[int, dict[int, int]] = {}  # hash -> {slot: tier bits} where bits != DEVICE
        self._below: dict[int, int] = {}  # hash -> mask of the slots holding it only off the device
        self._blocks: dict[str, set[int]] = {}  # worker -> hashes it holds (any tier)
        self._seq: dict[str, int] = {}  # worker -> last applied batch
        self._predicted: dict[str, OrderedDict[int, float]] = {}  # worker -> hash -> expiry (oldest first)
        self._expiries: list[tuple[float, str]] = []  # heap: (a worker's earliest expiry, worker)
        self._queued: dict[str, float] = {}  # worker -> the expiry of its live heap entry
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
        pred = self._predicted.get(worker)
        if pred is None:
            pred = self._predicted[worker] = OrderedDict()
        was_empty = not pred
        exp = now + ttl
        slot = self.slots.slot(worker)
        wbit = self.slots.bits[slot]
        any_, off = self._any, self._off
        guessed = []
        for h in hashes:
            m = any_.get(h)
            if m is not None and m & wbit:
                o = off.get(h)
                if o is None or o.get(slot, DEVICE) & DEVICE:
                    # on its device already: a guess would add no credit, and the next event about
                    # the block (an eviction) would take the guess with it anyway
                    continue
            pred.pop(h, None)
            pred[h] = exp
            guessed.append(h)
        if was_empty and pred:
            self._queue_expiry(worker, next(iter(pred.values())))
        self._add(worker, guessed, TIERS["predicted"])

    def _queue_expiry(self, worker: str, at: float) -> None:
        """Keep one heap entry per worker with predictions, at or before its earliest expiry."""
        queued = self._queued.get(worker)
        if queued is None or at < queued:
            self._queued[worker] = at
            heapq.heappush(self._expiries, (at, worker))

    def _unpredict(self, worker: str, pred: OrderedDict[int, float], hashes: Iterable[int]) -> None:
        gone = [h for h in hashes if pred.pop(h, None) is not None]
        if gone:
            self._remove(worker, gone, TIERS["predicted"])

    def expire(self, now: float | None = None) -> int:
        """Forget predictions past their TTL; returns how many went. Only workers whose earliest
        prediction is due are looked at (a heap of them), not every worker per decision."""
        now = time.monotonic() if now is None else now
        gone = 0
        bit = TIERS["predicted"]
        heap = self._expiries
        while heap and heap[0][0] <= now:
            at, worker = heapq.heappop(heap)
            if self._queued.get(worker) != at:
                continue  # superseded by an earlier entry, or the worker was dropped
            del self._queued[worker]
            pred = self._predicted.get(worker)
            if not pred:
                continue
            stale = []
            while pred:
                h, exp = next(iter(pred.items()))
                if exp > now:
                    break
                pred.popitem(last=False)
                stale.append(h)
            self._remove(worker, stale, bit)
            gone += len(stale)
            if pred:
                self._queue_expiry(worker, next(iter(pred.values())))
        return gone

    def drop_worker(self, worker: str, keep_seq: bool = False) -> None:
        slot = self.slots.get(worker)
        hashes = self._blocks.pop(worker, ())
        if slot is not None and hashes:
            wbit = self.slots.bits[slot]
            any_, off = self._any, self._off
            for h in hashes:
                m = any_.get(h)
                if m is None or not m & wbit:
                    continue
                m ^= wbit
                if m:
                    any_[h] = m
                else:
                    del any_[h]
                o = off.get(h)
                if o is not None and o.pop(slot, None) is not None:
                    self._mark_below(h, slot, wbit, DEVICE)
                    if not o:
                        del off[h]
        self._predicted.pop(worker, None)
        self._queued.pop(worker, None)
        if not keep_seq:
            self._seq.pop(worker, None)
            if self._owns_slots:
                self.slots.release(worker)

    def _add(self, worker: str, hashes: Iterable[int], bit: int) -> None:
        slot = self.slots.slot(worker)
        wbit = self.slots.bits[slot]
        mine = self._blocks.get(worker)
        if mine is None:
            mine = self._blocks[worker] = set()
        any_, off = self._any, self._off
        for h in hashes:
            m = any_.get(h)
            if m is None or not m & wbit:  # a new holder
                any_[h] = wbit if m is None else m | wbit
                mine.add(h)
                if bit != DEVICE:
                    self._set_off(h, slot, wbit, bit)
                continue
            o = off.get(h)  # it holds it already: one more tier
            cur = DEVICE if o is None else o.get(slot, DEVICE)
            if cur | bit != cur:
                self._set_off(h, slot, wbit, cur | bit)

    def _set_off(self, h: int, slot: int, wbit: int, bits: int) -> None:
        """A holder's tier bits on ``h`` are now ``bits`` (held: bits != 0)."""
        o = self._off.get(h)
        if bits == DEVICE:
            if o is not None and o.pop(slot, None) is not None and not o:
                del self._off[h]
        elif o is None:
            self._off[h] = {slot: bits}
        else:
            o[slot] = bits
        self._mark_below(h, slot, wbit, bits)

    def _mark_below(self, h: int, slot: int, wbit: int, bits: int) -> None:
        """Keep ``_below``: the slot holds ``h`` only off the device (``bits`` 0: not at all)."""
        b = self._below.get(h, 0)
        if bits and not bits & DEVICE:
            if not b & wbit:
                self._below[h] = b | wbit
        elif b & wbit:
            b ^= wbit
            if b:
                self._below[h] = b
            else:
                del self._below[h]

    def _remove(self, worker: str, hashes: Iterable[int], bit: int) -> None:
        slot = self.slots.get(worker)
        if slot is None:
            return
        wbit = self.slots.bits[slot]
        mine = self._blocks.get(worker)
        any_, off = self._any, self._off
        for h in hashes:
            m = any_.get(h)
            if m is None or not m & wbit:
                continue
            o = off.get(h)
            cur = DEVICE if o is None else o.get(slot, DEVICE)
            left = cur & ~bit
            if left:
                if left != cur:
                    self._set_off(h, slot, wbit, left)
                continue
            m ^= wbit  # held in no tier any more
            if m:
                any_[h] = m
            else:
                del any_[h]
            if o is not None and o.pop(slot, None) is not None:
                self._mark_below(h, slot, wbit, 0)
                if not o:
                    del off[h]
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
        slot = self.slots.get(worker)
        if slot is None or not self._any.get(block_hash, 0) >> slot & 1:
            return set()
        o = self._off.get(block_hash)
        bits = DEVICE if o is None else o.get(slot, DEVICE)
        return {t for t, b in TIERS.items() if bits & b}

    def match_slots(self, hashes: Sequence[int]) -> tuple[list[tuple[int, int]], dict[int, list[tuple[int, int]]]]:
        """The leading runs of ``hashes`` by slot: ``runs``, (depth, mask of the slots whose run is
        that deep), and ``below``, per slot the (position, tier bits) of the blocks of its run it
        holds only off the device (host, disk, or predicted). One AND of masks per block; a loop
        over holders only on the few blocks some holder keeps off the device."""
        any_ = self._any
        alive = any_.get(hashes[0]) if hashes else None
        if not alive:
            return [], {}
        off, below_of = self._off, self._below
        runs: list[tuple[int, int]] = []
        below: dict[int, list[tuple[int, int]]] = {}
        n = 0
        for h in hashes:
            m = any_.get(h)
            if m is None:
                break
            kept = alive & m
            if kept != alive:
                runs.append((n, alive ^ kept))
                alive = kept
                if not alive:
                    break
            b = below_of.get(h)
            if b is not None and b & alive:
                o = off[h]
                for slot in slots_in(b & alive):
                    got = below.get(slot)
                    if got is None:
                        below[slot] = [(n, o[slot])]
                    else:
                        got.append((n, o[slot]))
            n += 1
        if alive:
            runs.append((n, alive))
        return runs, below

    def match(self, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """Per worker: its leading run of ``hashes`` and where it holds each block of it."""
        runs, below = self.match_slots(hashes)
        ids = self.slots.ids
        out: dict[str, PrefixMatch] = {}
        for depth, mask in runs:
            if not depth:
                continue
            for slot in slots_in(mask):
                b = below.get(slot)
                out[ids[slot]] = PrefixMatch(depth, tuple(b)) if b else plain_match(depth)
        return out

    def overlap(self, hashes: Sequence[int]) -> dict[str, float]:
        """Per worker: its leading run of ``hashes``, each block credited by its best tier."""
        credit_of = self._credit
        return {w: m.depth - sum(1.0 - credit_of[bits] for _, bits in m.below)
                for w, m in self.match(hashes).items()}

    def nbytes(self) -> int:
        """What the index holds in memory, roughly (its maps, sets, masks and hashes)."""
        import sys

        size = sys.getsizeof
        total = size(self._any) + size(self._off) + size(self._below) + size(self._blocks)
        total += sum(size(h) for h in self._any)
        shared_bits = {id(b) for b in self.slots.bits}
        total += sum(size(m) for m in self._any.values() if id(m) not in shared_bits)
        total += sum(size(o) for o in self._off.values())
        total += sum(size(s) for s in self._blocks.values())
        return total
