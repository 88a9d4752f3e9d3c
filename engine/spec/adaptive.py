"""How many tokens a row drafts next: K adapts per row to its acceptance.

A verification step costs more than a plain decode step wherever the forward pass is not bound by
reading the weights (a CPU; a GPU at large batch): drafts that keep being rejected must stop.
A row starts at the length ``AcceptancePrior.start`` gives (below); a step that accepts none of the
row's drafts halves its length (..., 1, 0); a step that accepts any puts it to K. A row at 0 drafts
one token after ``PROBE_EVERY`` steps, then after twice as many each time that probe is rejected
(up to ``PROBE_MAX``), so it starts again when its drafts would be accepted again (the text turned
repetitive) at a vanishing cost where they never are. Between probes a row at 0 is a plain decode
row: no drafted positions, and (``due``) no reason to keep its token off an overlapped step.

Where a new row starts (``AcceptancePrior``): the method's acceptance over the engine's recent
verifications. Where drafts were mostly accepted, at K; where they were almost all rejected, at 0
(probing), so a batch of new rows on traffic the drafter never guesses runs as plain decode from
its first step. With no history, or a middling one, the batch decides: a verified position costs
little in a small batch (the step reads the weights once for all its positions) and about what a
decoded token costs in a large one, so new rows start at K in batches of up to ``SMALL_BATCH``
rows and with fewer drafts in larger ones (K * SMALL_BATCH / batch, rounded down: at 0 in the
largest, where the row's probes find out whether drafting pays). A row that starts at 0 first
probes after ``PROBE_EVERY`` steps times batch / ``SMALL_BATCH`` (at most ``PROBE_MAX``): in a
large batch every row probing at once is a step of twice the positions.

Fixed K (``--no-speculative-adaptive``; vLLM's and SGLang's behaviour): every row drafts K tokens
at every decoding step, whatever was accepted before (``AcceptancePrior(adaptive=False)``). For
drafters known to pay at the batch sizes served, and for tests whose drafter is always wrong (a
random EAGLE-3 head), where adaptation would leave almost nothing verified.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 16
PROBE_MAX = 256
PRIOR_WEIGHT = 0.05  # the weight of one verified row in the recent acceptance (about 20 rows' memory)
PRIOR_LOW = 0.1  # recent acceptance below this: new rows start at 0 (probing)
PRIOR_HIGH = 0.5  # at or above this: new rows start at K
SMALL_BATCH = 4  # running rows up to which a new row with no telling history starts at K (a CPU's;
# a GPU's weights-bound decode would allow more: not yet measured)


@dataclass(slots=True)
class DraftLength:
    k: int  # the row's next draft length (before the step's budget and max_tokens cut it)
    idle: int = 0  # steps since a row at 0 last drafted
    probe_every: int = PROBE_EVERY  # steps between a row's probes while it is at 0
    adaptive: bool = True  # False: ``k`` stays as it started (fixed K)

    def next(self) -> int:
        if self.k > 0:
            return self.k
        self.idle += 1
        if self.idle >= self.probe_every:
            self.idle = 0
            return 1
        return 0

    def due(self) -> bool:
        """Whether the next ``next()`` drafts (without counting a step)."""
        return self.k > 0 or self.idle + 1 >= self.probe_every

    def update(self, drafted: int, accepted: int, max_k: int) -> None:
        if not drafted or not self.adaptive:
            return
        if accepted:
            self.k, self.probe_every = max_k, PROBE_EVERY
        elif self.k:
            self.k //= 2
        else:  # a probe rejected
            self.probe_every = min(2 * self.probe_every, PROBE_MAX)


class AcceptancePrior:
    """The drafter's acceptance over the engine's recent verifications: where new rows start."""

    __slots__ = ("adaptive", "rate")

    def __init__(self, adaptive: bool = True) -> None:
        self.adaptive = adaptive  # False: every row at K, always (fixed K)
        self.rate: float | None = None  # None: nothing verified yet

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            r = accepted / drafted
            self.rate = r if self.rate is None else self.rate + PRIOR_WEIGHT * (r - self.rate)

    def start(self, max_k: int, batch: int) -> DraftLength:
        """A new row's draft length in a batch of ``batch`` running rows."""
        if not self.adaptive:
            return DraftLength(max_k, adaptive=False)
        if self.rate is not None and self.rate >= PRIOR_HIGH:
            return DraftLength(max_k)
        k = min(max_k, max_k * SMALL_BATCH // max(1, batch)) if self.rate is None or self.rate >= PRIOR_LOW else 0
        if k:
            return DraftLength(k)
        return DraftLength(0, probe_every=min(PROBE_MAX, PROBE_EVERY * max(1, batch // SMALL_BATCH)))
