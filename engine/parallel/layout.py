"""A worker's layout: how its model is cut over ranks, as one value validated once.

Two dimensions today, tensor (``tp``) and pipeline (``pp``); expert parallelism would be a
third, inside a stage as TP is. Ranks are numbered stage-major, so rank 0 (the worker: the
scheduler, the block pool, sampling) is the first rank of the first stage:

    rank = stage * tp + tp_rank            tp 2 x pp 2:   stage 0: ranks 0 1   (layers 0..k-1)
                                                          stage 1: ranks 2 3   (layers k..L-1)

Within a stage the ``tp`` ranks split every layer's heads and MLP columns (``engine.tp``) and
sum partial outputs in an all-reduce among themselves (the stage's TP group). Between stages the
activations go point to point, rank (s, t) to rank (s + 1, t): each rank of a stage holds the
whole residual stream after its all-reduces, so each hands it to its counterpart. The last stage's
rows that need logits go back to rank 0 from its TP rank 0 alone.

Torch-free: the flag parser, the mocker and the worker's card read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in its layout."""

    stage: int
    tp_rank: int


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    # decoder layers per stage, in stage order (``for_model`` fills it in); () before a model is known
    stage_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"--tp and --pp must be >= 1, got --tp {self.tp} --pp {self.pp}")
        if self.stage_layers and (len(self.stage_layers) != self.pp or min(self.stage_layers) < 1):
            raise ValueError(f"a layout of {self.pp} stages needs {self.pp} layer counts of at least 1 each, "
                             f"got {','.join(map(str, self.stage_layers))}")

    @classmethod
    def for_model(cls, tp: int, pp: int, num_layers: int, pp_layers: tuple[int, ...] = ()) -> Layout:
        """The layout of ``tp`` x ``pp`` ranks over a model of ``num_layers`` decoder layers: the
        stages split the layers as ``pp_layers`` says, else evenly (ValueError in one line)."""
        if pp > num_layers:
            raise ValueError(f"--pp {pp} is more stages than the model's {num_layers} layers")
        if pp_layers:
            if len(pp_layers) != pp:
                raise ValueError(f"--pp-layers names {len(pp_layers)} stages, --pp is {pp}")
            if sum(pp_layers) != num_layers:
                raise ValueError(f"--pp-layers {','.join(map(str, pp_layers))} sums to {sum(pp_layers)}, "
                                 f"the model has {num_layers} layers")
            return cls(tp, pp, tuple(pp_layers))
        return cls(tp, pp, even_split(num_layers, pp))

    # -- ranks ----------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.tp * self.pp

    @property
    def last_stage(self) -> int:
        return self.pp - 1

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def place(self, rank: int) -> RankPlace:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a layout of {self.size} ranks")
        return RankPlace(rank // self.tp, rank % self.tp)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The TP group of ``stage``, in TP-rank order."""
        return tuple(self.rank(stage, t) for t in range(self.tp))

    def next_rank(self, rank: int) -> int | None:
        """Where ``rank`` sends its activations (None: the last stage)."""
        p = self.place(rank)
        return None if p.stage == self.last_stage else self.rank(p.stage + 1, p.tp_rank)

    def prev_rank(self, rank: int) -> int | None:
        """Where ``rank`` receives its activations from (None: the first stage, which embeds)."""
        p = self.place(rank)
        return None if p.stage == 0 else self.rank(p.stage - 1, p.tp_rank)

    @property
    def returning_rank(self) -> int:
        """The rank that hands the last stage's rows back to rank 0 for sampling."""
        return self.rank(self.last_stage, 0)

    # -- layers ---------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    def layers(self, stage: int) -> range:
        """The decoder layers ``stage`` holds (model-wide numbers)."""
        if not self.stage_layers:
            raise ValueError("this layout has no layer split yet (Layout.for_model)")
        first = sum(self.stage_layers[:stage])
        return range(first, first + self.stage_layers[stage])

    def describe(self) -> str:
        """``tp 2 x pp 2 (layers 3,2)``; ``tp 1`` for one rank."""
        parts = [f"tp {self.tp}"] + ([f"pp {self.pp}"] if self.pp > 1 else [])
        split = f" (layers {','.join(map(str, self.stage_layers))})" if self.pp > 1 and self.stage_layers else ""
        return " x ".join(parts) + split


def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """``num_layers`` over ``stages`` as evenly as they go; the later stages take the remainder
    (the first stage is rank 0's, which also schedules, embeds and samples)."""
    base, extra = divmod(num_layers, stages)
    return tuple(base + (1 if s >= stages - extra else 0) for s in range(stages))


def parse_stage_layers(text: str) -> tuple[int, ...]:
    """``--pp-layers 3,2`` (ValueError in one line)."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--pp-layers takes layer counts per stage, comma-separated (3,2), got {text!r}") from None
    if any(n < 1 for n in counts):
        raise ValueError(f"--pp-layers: every stage needs at least one layer, got {text}")
    return counts
