"""``ngram``: prompt lookup. The last ``n`` tokens (``max_n`` down to ``min_n``) are matched
against the sequence's earlier tokens; the tokens that followed the latest match are the draft."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.spec.drafter import DraftedSequence


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1, window: int = 4096):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self.window = window  # only the last this many tokens are searched (bounded host time per row)

    @classmethod
    def from_arg(cls, arg: str) -> NgramDrafter:
        """``ngram`` or ``ngram:N`` (match up to N tokens)."""
        return cls(max_n=int(arg)) if arg else cls()

    def propose(self, seq: DraftedSequence, k: int) -> list[int]:
        return lookup(seq.token_ids[-self.window:], k, self.max_n, self.min_n)


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The ``k`` tokens after the latest earlier occurrence of the longest matching suffix."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        first = suffix[0]
        # latest start i < size - n whose n tokens equal the suffix
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []
