"""Per-sequence block tables on top of the block pool: prefix hits, growth, caching, release.

Who frees a sequence's blocks:

    admit (prefix hit) --touch--> block_table <--allocate-- grow
                                      |
              finish / abort / preempt --> free() (tail first, so shared prefixes stay cached longest)

The manager works on anything shaped like ``mesh.engine.sequence.Sequence``
(``block_table``, ``num_cached_blocks``, ``num_computed_tokens``, ``block_hashes()``).
"""

from __future__ import annotations

from typing import Protocol

from kvstore.pool import BlockPool


class PagedSequence(Protocol):
    block_table: list[int]
    num_cached_blocks: int
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    def block_hashes(self, num_blocks: int | None = None) -> list[int]: ...


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size

    def match_prefix(self, seq: PagedSequence) -> list[int]:
        """Cached blocks for the sequence's leading full blocks.

        At most ``(num_tokens - 1) // block_size`` blocks match, so at least one
        token is always left to compute (its logits give the next token).
        """
        limit = (seq.num_tokens - 1) // self.block_size
        if limit <= 0:
            return []
        return self.pool.match_prefix(seq.block_hashes(limit))

    def can_admit(self, seq: PagedSequence, hits: list[int], num_new_tokens: int) -> bool:
        need = blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size) - len(hits)
        # cached hits sitting in the free queue stop being free once taken
        reclaimed = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        return need <= self.pool.num_free - reclaimed

    def admit(self, seq: PagedSequence, hits: list[int]) -> None:
        """Give a new sequence its prefix-hit blocks (the caller checked ``can_admit``)."""
        assert not seq.block_table, "admit() on a sequence that already has blocks"
        self.pool.touch(hits)
        seq.block_table = list(hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size

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
        for i in range(seq.num_cached_blocks, len(hashes)):
            parent = hashes[i - 1] if i > 0 else None
            self.pool.cache(seq.block_table[i], hashes[i], parent)
        seq.num_cached_blocks = len(hashes)

    def free(self, seq: PagedSequence) -> None:
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0
