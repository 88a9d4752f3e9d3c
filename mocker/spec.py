"""The mocker's speculative decoding: an acceptance rate sets the tokens per step.

With ``--speculative METHOD`` a mock worker drafts through the real scheduler (K reserved
positions per row, adaptive K, rollback of rejected positions and their blocks, the counters
under METHOD's name), but its drafter is simulated: it proposes the mock target's own next tokens
(``next_token``), each replaced by a wrong one with probability ``1 - acceptance``
(``--mock-spec-acceptance``). The mock target verifies them as a greedy row does: it emits the
drafts up to the first wrong one, then its own token. A row drafting K tokens at acceptance a
emits ``(1 - a^(K+1)) / (1 - a)`` tokens per step on average; the timing model charges each
verified draft ``decode_ms_per_draft_token``. Router, planner and trace-replay benchmarks on
mock workers see speculation's tokens per step and its cost.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.spec.drafter import DraftedSequence


def next_token(last: int, length: int, vocab_size: int) -> int:
    """The mock target's token after ``last`` in a sequence of ``length`` tokens (a fixed function)."""
    return (last * 31 + length * 17 + 7) % vocab_size


class MockDrafter:
    def __init__(self, name: str, acceptance: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"--mock-spec-acceptance must be in [0, 1], got {acceptance}")
        self.name = name  # the method the mock worker reports (its --speculative)
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, seq: DraftedSequence, k: int) -> list[int]:
        outs = seq.output_token_ids
        last = outs[-1] if outs else seq.prompt_token_ids[-1]
        length = len(seq.prompt_token_ids) + len(outs)
        drafts = []
        for i in range(k):
            t = next_token(last, length + i, self.vocab_size)
            if self.rng.random() >= self.acceptance:
                t = (t + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size  # never the right one
            drafts.append(t)
            last = t
        return drafts


def verify(last: int, length: int, drafts, vocab_size: int) -> list[int]:
    """The tokens a greedy row of the mock target emits after ``last`` (the sequence's ``length``-th
    token): the drafts up to the first the target would not have chosen, then its own token."""
    out = []
    for d in drafts:
        t = next_token(last, length, vocab_size)
        out.append(t)
        if d != t:
            return out
        last, length = t, length + 1
    out.append(next_token(last, length, vocab_size))
    return out
