"""The block pool: block ids, reference counts, and the prefix cache over them.

A block is in exactly one of three states:

    in use      ref_cnt > 0; owned by one or more sequences' block tables
    cached      ref_cnt == 0, has a hash; in the free queue, reusable by a prefix hit
    empty       ref_cnt == 0, no hash; in the free queue

The free blocks wait in three queues, taken in this order when blocks are allocated
(the front of each first):

    empty       reusing one evicts nothing
    probation   cached blocks never hit since they were computed: seen once
    protected   cached blocks that served a prefix hit: seen again, far likelier to be
                asked for once more; at most ``protected_share`` of the pool, beyond that
                the least recent go back to probation

A cached block keeps its contents until the moment it is handed out again. Within a
queue the least recently freed go first, and ``free()`` takes a block table in
reverse so that a chain's last blocks are evicted before its first (a prefix is only
as useful as its leading blocks). Blocks holding generated tokens (past the prompt)
join probation at the front: no request asked for them yet, so they are the first
cached blocks to go. This is segmented LRU; on the Mooncake trace with 8 workers it
keeps ~3 points more of the prompt tokens cached than plain LRU (``python -m bench cache-policy``).

Who frees what:

    allocate()/touch()  --> ref_cnt += 1 --> the caller's block table owns a reference
    free()              --> ref_cnt -= 1 --> at 0 the block joins the free queue (still cached)
    allocate() on a cached free block    --> its hash is evicted (a "removed" event), and the
                                             evicted blocks of the call go to ``on_evict`` in one
                                             batch before ``allocate`` returns, i.e. before the
                                             caller can overwrite them (the offload to a lower tier)

Only blocks with ``ref_cnt == 0`` are ever evicted: a block in use is never handed
to ``on_evict`` and never reused.

The pool never looks at tensors: it hands out ids, the KV cache holds the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kvstore.events import BlockRemoved, BlockStored, KvEventLog


class EvictedBlock(NamedTuple):
    """A cached block whose device slot is about to be reused: what a lower tier needs to keep it."""

    block_id: int
    block_hash: int
    parent: int | None
    hits: int  # prefix hits it served so far (the disk tier keeps only reused blocks)


class NoFreeBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


PROTECTED_SHARE = 0.5

_EMPTY, _PROBATION, _PROTECTED = range(3)  # the free queues, in the order allocate() takes from them
_IN_USE = -1


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        tier: str = "device",
        on_evict: Callable[[list[EvictedBlock]], None] | None = None,
        protected_share: float = PROTECTED_SHARE,
    ):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.tier = tier
        # Called once per allocate() with every cached block it evicted, before their slots are reused.
        self.on_evict = on_evict
        self._ref_cnt = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._parent: list[int | None] = [None] * num_blocks
        self._hits = [0] * num_blocks
        self._generated = [False] * num_blocks
        self._where = [_EMPTY] * num_blocks
        # the free blocks, by queue; allocation takes from the first non-empty one, front first
        self._queues: tuple[OrderedDict[int, None], ...] = (
            OrderedDict((i, None) for i in range(num_blocks)), OrderedDict(), OrderedDict())
        self._max_protected = int(protected_share * num_blocks)
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.events = KvEventLog()
        # counters: prefix-cache queries and hits, in blocks
        self.queried_blocks = 0
        self.hit_blocks = 0

    # -- queries -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return sum(len(q) for q in self._queues)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def eviction_order(self) -> list[int]:
        """The free blocks in the order ``allocate`` would hand them out."""
        return [b for q in self._queues for b in q]

    def match_prefix(self, hashes: Sequence[int], below: Callable[[int], bool] | None = None) -> list:
        """Block ids of the longest cached prefix of ``hashes`` (no references taken).

        With ``below`` (does a lower tier hold this hash?), the walk goes on through
        blocks held there; those come back as None, to be onboarded.
        """
        out: list[int | None] = []
        if not self.enable_caching:
            return out
        on_device = 0
        for h in hashes:
            bid = self._cached.get(h)
            if bid is None and not (below is not None and below(h)):
                break
            out.append(bid)
            on_device += bid is not None
        self.queried_blocks += len(hashes)
        self.hit_blocks += on_device
        return out

    # -- mutations -----------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (empty, then probation, then protected), each with one reference."""
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        out = []
        evicted: list[EvictedBlock] = []
        for _ in range(n):
            queue = next(q for q in self._queues if q)
            bid, _ = queue.popitem(last=False)
            self._where[bid] = _IN_USE
            h = self._hash[bid]
            if h is not None:
                evicted.append(EvictedBlock(bid, h, self._parent[bid], self._hits[bid]))
                self._evict(bid)
            self._ref_cnt[bid] = 1
            out.append(bid)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found by a prefix hit (pulls cached ones off the free queues)."""
        for bid in block_ids:
            if self._ref_cnt[bid] == 0:
                del self._queues[self._where[bid]][bid]
                self._where[bid] = _IN_USE
            self._ref_cnt[bid] += 1
            self._hits[bid] += 1

    def hold(self, block_ids: Iterable[int]) -> None:
        """One more reference on blocks in use, no hit counted: a fence keeps them out of the
        free queues while a late writer may still write them (``free`` them when it has stopped)."""
        for bid in block_ids:
            if self._ref_cnt[bid] <= 0:
                raise RuntimeError(f"block {bid} is not in use")
            self._ref_cnt[bid] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block; give the ids in the order they should be evicted."""
        first_out: list[int] = []
        for bid in block_ids:
            rc = self._ref_cnt[bid]
            if rc <= 0:
                raise RuntimeError(f"block {bid} freed more often than taken")
            self._ref_cnt[bid] = rc - 1
            if rc > 1:
                continue
            if self._hash[bid] is None:
                self._enqueue(bid, _EMPTY)
            elif self._hits[bid] > 0:
                self._enqueue(bid, _PROTECTED)
            elif self._generated[bid]:
                first_out.append(bid)
            else:
                self._enqueue(bid, _PROBATION)
        probation = self._queues[_PROBATION]
        for bid in reversed(first_out):  # the first given ends at the very front
            self._enqueue(bid, _PROBATION)
            probation.move_to_end(bid, last=False)
        protected = self._queues[_PROTECTED]
        while len(protected) > self._max_protected:
            bid, _ = protected.popitem(last=False)
            self._enqueue(bid, _PROBATION)

    def _enqueue(self, bid: int, where: int) -> None:
        self._queues[where][bid] = None
        self._where[bid] = where

    def cache(self, block_id: int, block_hash: int, parent: int | None, hits: int = 0,
              generated: bool = False) -> bool:
        """Name a fully computed (or onboarded) block by its chained hash. False if another block has it.

        ``hits``: prefix hits the block served before (an onboarded block keeps its count).
        ``generated``: the block holds tokens past the prompt (no request asked for them yet).
        """
        if not self.enable_caching or self._hash[block_id] is not None:
            return False
        if block_hash in self._cached:
            return False
        self._hash[block_id] = block_hash
        self._parent[block_id] = parent
        self._hits[block_id] = hits
        self._generated[block_id] = generated
        self._cached[block_hash] = block_id
        self.events.append(BlockStored(block_hash, parent, self.tier))
        return True

    def evict_all_cached(self) -> None:
        """Forget every cached block that is not in use (e.g. after the model is reloaded).

        Nothing goes to ``on_evict``: stale KV must not be offloaded.
        """
        for where in (_PROBATION, _PROTECTED):
            queue = self._queues[where]
            while queue:
                bid, _ = queue.popitem(last=False)
                self._evict(bid)
                self._enqueue(bid, _EMPTY)

    def _evict(self, bid: int) -> None:
        h = self._hash[bid]
        if h is not None:
            self._hash[bid] = None
            self._generated[bid] = False
            del self._cached[h]
            self.events.append(BlockRemoved(h, self.tier))
