"""``oracle`` (python -m bench speculative): proposes the target's own greedy continuation of each
request, known from a run without speculation, each token replaced at rate ``1 - alpha`` by a
wrong one. It sets the acceptance rate, so decode speed can be measured against it."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.spec.drafter import DraftedSequence


class OracleDrafter:
    name = "oracle"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], alpha: float, vocab_size: int,
                 seed: int = 0):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.continuations = continuations  # prompt tokens -> the target's greedy output tokens
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, seq: DraftedSequence, k: int) -> list[int]:
        ref = self.continuations.get(tuple(seq.prompt_token_ids))
        if ref is None:
            return []
        done = len(seq.output_token_ids)
        out = []
        for t in ref[done:done + k]:
            if self.rng.random() >= self.alpha:
                t = (t + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size  # never the right one
            out.append(t)
        return out
