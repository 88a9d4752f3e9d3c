"""Which drafted tokens a row accepts.

Greedy: the target's argmax at the row's last real position and at each drafted position
(``targets``, ``len(drafts) + 1`` of them). Draft ``i`` is accepted while it equals the target's
token before it; the row emits the accepted drafts and the target's token after the last of
them (a correction where a draft was rejected, a bonus token where all were accepted), so every
emitted token is the target's own greedy choice.
"""

from __future__ import annotations


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens the row emits: ``targets[:a + 1]`` where the first ``a`` drafts match."""
    assert len(targets) == len(drafts) + 1
    a = 0
    for d, t in zip(drafts, targets, strict=False):
        if d != t:
            break
        a += 1
    return targets[: a + 1]
