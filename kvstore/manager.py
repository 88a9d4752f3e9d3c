"""Per-sequence block tables on top of the block pool: prefix hits, growth, caching, release.

Who frees a sequence's blocks:

    admit (prefix hit) --touch--> block_table <--allocate-- grow
    admit (hit below device) --allocate + onboard--^
                                      |
              finish / abort / preempt --> free() (tail first, so shared prefixes stay cached longest)

With tiers (``kvstore.tiers``), a prefix match walks device, host, disk block by
block; blocks found below the device are onboarded into fresh device blocks in
``admit``, so the sequence starts with all of them computed.

The manager works on anything shaped like ``engine.sequence.Sequence``
(``block_table``, ``num_cached_blocks``, ``num_computed_tokens``, ``block_hashes()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvstore.pool import BlockPool

if TYPE_CHECKING:
    from kvstore.tiers import TieredCache


class PagedSequence(Protocol):
    block_table: list[int]
    num_cached_blocks: int
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    def block_hashes(self, num_blocks: int | None = None) -> list[int]: ...


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A sequence's cached leading blocks: per block its device id, or None where a lower tier holds it."""

    hashes: list[int]
    blocks: list[int | None]

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def device(self) -> list[int]:
        return [b for b in self.blocks if b is not None]

    @property
    def num_below(self) -> int:
        return sum(1 for b in self.blocks if b is None)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, tiers: TieredCache | None = None):
        self.pool = pool
        self.block_size = block_size
        self.tiers = tiers
        self.device_hit_blocks = 0  # blocks admitted from the device prefix cache (tiers count their own)

    def match_prefix(self, seq: PagedSequence) -> PrefixHit:
        """Cached blocks for the sequence's leading full blocks, in any tier.

        At most ``(num_tokens - 1) // block_size`` blocks match, so at least one
        token is always left to compute (its logits give the next token).
        """
        limit = (seq.num_tokens - 1) // self.block_size
        if limit <= 0:
            return PrefixHit([], [])
        hashes = seq.block_hashes(limit)
        below = self.tiers.holds if self.tiers is not None else None
        blocks = self.pool.match_prefix(hashes, below)
        return PrefixHit(hashes[: len(blocks)], blocks)

    def can_admit(self, seq: PagedSequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Room for the hit plus ``num_new_tokens``: onboarded blocks need fresh device blocks."""
        device = hit.device
        need = blocks_for(len(hit) * self.block_size + num_new_tokens, self.block_size) - len(device)
        # cached hits sitting in the free queue stop being free once taken
        reclaimed = sum(1 for b in device if self.pool.ref_count(b) == 0)
        return need <= self.pool.num_free - reclaimed

    def admit(self, seq: PagedSequence, hit: PrefixHit) -> None:
        """Give a new sequence its prefix-hit blocks, onboarding those below the device
        (the caller checked ``can_admit``). A block that cannot be read (a bad disk
        file) ends the hit there: check ``num_computed_tokens`` afterwards."""
        assert not seq.block_table, "admit() on a sequence that already has blocks"
        blocks = list(hit.blocks)
        staged = None
        if hit.num_below:
            # Read first: the allocation below may offload blocks and evict the host slots we read.
            staged = self.tiers.load([h for h, b in zip(hit.hashes, blocks, strict=True) if b is None])
            if len(staged) < hit.num_below:
                blocks = blocks[: _index_of_nth_none(blocks, len(staged))]
        device = [b for b in blocks if b is not None]
        self.pool.touch(device)
        self.device_hit_blocks += len(device)
        if staged is not None and len(staged):
            fresh = self.pool.allocate(len(staged))
            self.tiers.onboard(staged, fresh)
            it = iter(zip(fresh, staged.hits, strict=True))
            for i, b in enumerate(blocks):
                if b is None:
                    blocks[i], hits = next(it)
                    parent = hit.hashes[i - 1] if i > 0 else None
                    self.pool.cache(blocks[i], hit.hashes[i], parent, hits=hits + 1)
        seq.block_table = blocks
        seq.num_cached_blocks = len(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size

    def grow(self, seq: PagedSequence, num_new_tokens: int) -> bool:
        """Make the block table cover ``num_computed_tokens + num_new_tokens``; False if out of blocks."""
        need = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        extra = need - len(seq.block_table)
        if extra <= 0:
            return True
        if extra > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(extra))
        return True

    def cache_computed(self, seq: PagedSequence) -> None:
        """Name every block whose tokens are all computed by its chained hash."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = seq.block_hashes(full)
        prompt = seq.num_prompt_tokens
        bs = self.block_size
        for i in range(seq.num_cached_blocks, len(hashes)):
            parent = hashes[i - 1] if i > 0 else None
            self.pool.cache(seq.block_table[i], hashes[i], parent, generated=(i + 1) * bs > prompt)
        seq.num_cached_blocks = len(hashes)

    def shrink(self, seq: PagedSequence, num_tokens: int) -> None:
        """Free the blocks past the first ``num_tokens`` tokens' (positions a rejected speculative
        draft took); they were never named, as only computed blocks of real tokens are."""
        keep = max(blocks_for(num_tokens, self.block_size), seq.num_cached_blocks)
        if len(seq.block_table) > keep:
            extra = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.pool.free(reversed(extra))

    def free(self, seq: PagedSequence) -> None:
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0


def _index_of_nth_none(blocks: list[int | None], n: int) -> int:
    """The position of the ``n``-th None (0-based) in ``blocks``: where a hit cut after ``n`` onboarded blocks ends."""
    seen = 0
    for i, b in enumerate(blocks):
        if b is None:
            if seen == n:
                return i
            seen += 1
    return len(blocks)
