"""Rank 0's side of a pipeline: each step cut into micro-batches, handed to every rank, rank 0's
own stage run, and the logits of the rows that come back from the last stage.

The runner (``engine.runner``) calls ``logits`` in place of its own forward when the layout
has more than one stage; everything else of a step (inputs, sampling, verification, grammar
masks) stays as at one rank.

Steps in flight (``launch``, the engine's ``engine.inflight``): rank 0 runs its stage of a step
and returns at once, the later stages still working on it, so that it can schedule and start
the next step, of other sequences, while they do; ``PipelineStep.logits`` then waits for the
step's rows. Every rank runs the steps in the order rank 0 hands them out, so the activations
and rows of steps in flight together meet in order; their tags differ all the same.
"""

from __future__ import annotations

import torch

from engine.parallel.group import RankGroup
from engine.parallel.stage import StageRun, StageRunner, StageStats, microbatch_count, split_step
from engine.runner import StepInputs

TAG_CYCLE = 64  # step tags repeat after this many steps (far more than can be in flight at once)


class PipelineStep:
    """A step rank 0 started over the stages: ``logits`` waits for the rows it asked for."""

    def __init__(self, pipeline: Pipeline, run: StageRun, rows: list[int]):
        self.pipeline, self.run, self.rows = pipeline, run, rows

    def logits(self) -> torch.Tensor | None:
        """The logits of the step's ``rows`` (in that order; None for none)."""
        pipe = self.pipeline
        chunks: list[torch.Tensor] = []
        try:
            pipe.stage.finish(self.run, on_rows=lambda hidden: chunks.append(pipe.model.logits(hidden)))
        finally:
            pipe.in_flight -= 1
        rows = self.rows
        if not rows:
            return None
        logits = torch.cat(chunks) if len(chunks) > 1 else chunks[0]  # in row order
        ordered = sorted(rows)
        if ordered == rows:
            return logits
        at = {r: i for i, r in enumerate(ordered)}
        return logits.index_select(0, torch.as_tensor([at[r] for r in rows], dtype=torch.long).to(logits.device))


class Pipeline:
    def __init__(self, ranks: RankGroup, stage: StageRunner, model, microbatches: int):
        self.ranks, self.stage, self.model = ranks, stage, model
        self.microbatches = microbatches  # at most this many per step (1: micro-batching off)
        self.launched = 0  # steps handed out (their tags follow from it)
        self.in_flight = 0  # started, their rows not taken yet
        self.most_in_flight = 0  # the most steps ever in flight at once (tests: the mode really ran)

    def logits(self, step: StepInputs, input_ids: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """The step through every stage; the logits of ``rows`` (in that order; None for none)."""
        return self.launch(step, input_ids, rows).logits()

    def launch(self, step: StepInputs, input_ids: torch.Tensor, rows: list[int],
               microbatches: int | None = None) -> PipelineStep:
        """Hand the step to every rank and run this stage of it; its later stages go on meanwhile.
        ``microbatches``: at most this many for this step (default: the pipeline's)."""
        most = self.microbatches if microbatches is None else min(microbatches, self.microbatches)
        plan = split_step(step, rows, microbatch_count(len(step.input_ids), most))
        plan.tag_base = (self.launched % TAG_CYCLE) * self.microbatches
        self.launched += 1
        self.ranks.broadcast(plan)
        run = self.stage.start(plan, input_ids)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return PipelineStep(self, run, rows)

    def stats(self, reset: bool = False) -> list[StageStats]:
        """Every rank's ``StageStats`` (rank 0's first), between steps."""
        return [self.stage.take_stats(reset), *self.ranks.stats(reset)]
