"""The drafter interface, which rows draft, and the counters of what drafting did.

A drafter (registered by name in ``engine.spec.registry``) proposes up to ``k`` tokens that follow
a sequence's tokens (prompt and output so far); the scheduler reserves their positions, the runner computes the target's logits at each,
and ``engine.spec.verify`` keeps the longest prefix the target agrees with. A drafter never
changes the output: a wrong draft only costs a wasted position.

Which rows draft (``can_draft``): every row not opted out (``SamplingParams.speculate``). What
reads each token as it is sampled (a grammar, penalties, ``min_tokens``, logprobs) is applied at
each drafted position as if the drafts before it were taken (``engine.verification``); a grammar
also cuts the drafts at the first token it refuses (``GrammarState.draft_prefix``). Greedy rows
accept the longest prefix the target's argmax agrees with; sampled rows use rejection sampling
(``engine.spec.verify``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.sampling import SamplingParams


class DraftedSequence(Protocol):
    """What a drafter reads of a sequence (``engine.sequence.Sequence`` is one; not imported here:
    the sequence holds its ``engine.spec.adaptive.DraftLength``)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams

    @property
    def token_ids(self) -> list[int]: ...


class Drafter(Protocol):
    name: str  # the method, as counters and logs name it

    def propose(self, seq: DraftedSequence, k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``seq``'s tokens ([] : none worth trying)."""
        ...


def can_draft(seq: DraftedSequence) -> bool:
    """Whether ``seq``'s next tokens may be drafted (and verified)."""
    return seq.params.speculate


@dataclass
class SpecCounters:
    """Totals since the engine started: tokens drafted, drafts accepted, tokens emitted by drafting rows."""

    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    steps: int = 0  # drafting rows verified (one per row per step)

    def count(self, drafted: int, accepted: int, emitted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.steps += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting row emits per step (accepted drafts plus the target's own)."""
        return self.emitted / self.steps if self.steps else 0.0
