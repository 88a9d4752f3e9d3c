"""How many tokens a row drafts next: K adapts per row to its acceptance.

A verification step costs more than a plain decode step wherever the forward pass is not bound by
reading the weights (a CPU; a GPU at large batch): drafts that keep being rejected must stop.
A row starts at K. A step that accepts none of the row's drafts halves its length (K, K/2, ..., 0);
a step that accepts any puts it back to K. A row at 0 drafts one token after ``PROBE_EVERY`` steps,
then after twice as many each time that probe is rejected (up to ``PROBE_MAX``), so it starts
again when its drafts would be accepted again (the text turned repetitive) at a vanishing cost
where they never are.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 16
PROBE_MAX = 256


@dataclass(slots=True)
class DraftLength:
    k: int  # the row's next draft length (before the step's budget and max_tokens cut it)
    idle: int = 0  # steps since a row at 0 last drafted
    probe_every: int = PROBE_EVERY  # steps between a row's probes while it is at 0

    def next(self) -> int:
        if self.k > 0:
            return self.k
        self.idle += 1
        if self.idle >= self.probe_every:
            self.idle = 0
            return 1
        return 0

    def update(self, drafted: int, accepted: int, max_k: int) -> None:
        if not drafted:
            return
        if accepted:
            self.k, self.probe_every = max_k, PROBE_EVERY
        elif self.k:
            self.k //= 2
        else:  # a probe rejected
            self.probe_every = min(2 * self.probe_every, PROBE_MAX)
