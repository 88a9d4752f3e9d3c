"""The one block-hash function of pdmesh.

Engine, kvstore, router and KV events all name a block by its chained hash:

    h[0] = xxh3_64(le_u32(tokens of block 0), seed)
    h[i] = xxh3_64(le_u64(h[i-1]) + le_u32(tokens of block i), seed)

so ``h[i]`` names the whole prefix up to and including block ``i`` and prefix
overlap is a walk until the first miss. Only full blocks are hashed. The seed
is derived from the model name, and from the LoRA adapter's name for a request
that runs one: the same tokens under adapter A, adapter B and the base model are
different blocks (their KV differs), so a prefix never hits across them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache

import xxhash

_SEED_OF_SEEDS = 1337
assert array("I").itemsize == 4, "block hashing packs token ids as 32-bit unsigned ints"


@lru_cache(maxsize=1024)
def model_seed(model: str, salt: str = "", lora: str | None = None) -> int:
    """The hash seed for a model (and optional salt), under LoRA adapter ``lora`` (None: the
    base model, whose seed is unchanged by this argument): stable across processes and hosts."""
    key = f"{model}\x00{salt}" if lora is None else f"{model}\x00{salt}\x00lora\x00{lora}"
    return xxhash.xxh3_64_intdigest(key.encode(), seed=_SEED_OF_SEEDS)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: int,
    parent: int | None = None,
    start_block: int = 0,
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` from ``start_block`` on.

    ``parent`` is the hash of block ``start_block - 1`` (None when starting at
    block 0), so a sequence that grows can hash only its new blocks.
    """
    n_full = len(token_ids) // block_size
    if start_block >= n_full:
        return []
    words = array("I", token_ids[start_block * block_size : n_full * block_size])
    if sys.byteorder != "little":
        words.byteswap()
    buf = words.tobytes()
    step = 4 * block_size
    out: list[int] = []
    prev = parent
    hasher = xxhash.xxh3_64_intdigest
    for off in range(0, len(buf), step):
        chunk = buf[off : off + step]
        prev = hasher(chunk if prev is None else prev.to_bytes(8, "little") + chunk, seed=seed)
        out.append(prev)
    return out
