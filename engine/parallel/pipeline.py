"""Rank 0's side of a pipeline: each step cut into micro-batches, handed to every rank, rank 0's
own stage run, and the logits of the rows that come back from the last stage.

The runner (``engine.runner``) calls ``logits`` in place of its own forward when the layout
has more than one stage; everything else of a step (inputs, sampling, verification, grammar
masks) stays as at one rank.
"""

from __future__ import annotations

import torch

from engine.parallel.group import RankGroup
from engine.parallel.stage import StageRunner, StageStats, microbatch_count, split_step
from engine.runner import StepInputs


class Pipeline:
    def __init__(self, ranks: RankGroup, stage: StageRunner, model, microbatches: int):
        self.ranks, self.stage, self.model = ranks, stage, model
        self.microbatches = microbatches  # at most this many per step (1: micro-batching off)

    def logits(self, step: StepInputs, input_ids: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """The step through every stage; the logits of ``rows`` (in that order; None for none)."""
        if step.feed:
            raise RuntimeError("a pipeline step takes no in-flight tokens (--async-scheduling is refused at --pp > 1)")
        plan = split_step(step, rows, microbatch_count(len(step.input_ids), self.microbatches))
        self.ranks.broadcast(plan)
        chunks: list[torch.Tensor] = []
        self.stage.run(plan, input_ids, on_rows=lambda hidden: chunks.append(self.model.logits(hidden)))
        if not rows:
            return None
        logits = torch.cat(chunks) if len(chunks) > 1 else chunks[0]  # in row order
        ordered = sorted(rows)
        if ordered == rows:
            return logits
        at = {r: i for i, r in enumerate(ordered)}
        return logits.index_select(0, torch.as_tensor([at[r] for r in rows], dtype=torch.long).to(logits.device))

    def stats(self, reset: bool = False) -> list[StageStats]:
        """Every rank's ``StageStats`` (rank 0's first), between steps."""
        return [self.stage.take_stats(reset), *self.ranks.stats(reset)]
