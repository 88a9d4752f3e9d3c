"""Which drafted tokens a row accepts.

Sampled rows (``rejection_sample``): the drafters here propose tokens, not distributions (a point
mass q at each draft). Draft ``i`` is accepted with probability p(d_i), the target's probability
(after temperature, top-k, top-p, min-p) at the position before it; at the first rejection the row
emits a token drawn from the residual max(p - q, 0) renormalized (p without the draft), and where
every draft was accepted, one drawn from p at the last position. Every emitted token is then
distributed exactly as the target's sampling would draw it (Leviathan et al., 2023).

Greedy: the target's argmax at the row's last real position and at each drafted position
(``targets``, ``len(drafts) + 1`` of them). Draft ``i`` is accepted while it equals the target's
token before it; the row emits the accepted drafts and the target's token after the last of
them (a correction where a draft was rejected, a bonus token where all were accepted), so every
emitted token is the target's own greedy choice.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens the row emits: ``targets[:a + 1]`` where the first ``a`` drafts match."""
    assert len(targets) == len(drafts) + 1
    a = 0
    for d, t in zip(drafts, targets, strict=False):
        if d != t:
            break
        a += 1
    return targets[: a + 1]


def rejection_sample(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """The tokens a sampled row emits. ``probs [len(drafts) + 1, V]``: the target's filtered
    distributions at the row's last real position and at each drafted one. Draws ``len(drafts)``
    uniforms, then one token, from ``generator`` (a seeded row's generator makes it deterministic)."""
    k = len(drafts)
    if k:
        d = torch.tensor(drafts, dtype=torch.long, device=probs.device)
        p_draft = probs[:k].gather(1, d.unsqueeze(1)).squeeze(1)
        u = torch.rand(k, generator=generator, device=probs.device)
        accepted = (u < p_draft).tolist()
        a = accepted.index(False) if False in accepted else k
    else:
        a = 0
    p = probs[a]
    if a < k:
        residual = p.clone()
        residual[drafts[a]] = 0.0
        if residual.sum() > 0:  # 0 only where p put all its mass on the (rejected) draft: float rounding
            p = residual
    last = int(torch.multinomial(p, 1, generator=generator)[0])
    return [*drafts[:a], last]
