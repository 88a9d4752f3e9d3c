"""A step over pipeline stages: cut into micro-batches, each run stage after stage.

Rank 0 cuts the step's rows into micro-batches (``split_step``) and hands every rank the
same ``StageStep``. Each rank runs its stage's layers over each micro-batch in order
(``StageRunner``): the first stage from the embeddings, the others from the activations the
stage before sent; then it sends them on, and the last stage sends the rows that need logits
(the sampled and verified rows, no others) back to rank 0. While a later stage runs
micro-batch i, the stages before it already run i + 1, so the stages work at the same time:

    stage 0 (rank 0)  | mb0 | mb1 |     logits of each as it comes back, sample
    stage 1           |     | mb0 | mb1 |

A micro-batch may cut a sequence's chunk (a long prefill): its piece attends to the KV the
pieces before it wrote on the same stage, which every stage runs first, so the cut is
invisible to the result. Every rank of a stage's TP group runs the same micro-batches (their
all-reduces meet); rank (s, t) sends to rank (s + 1, t).

Rank 0 may start a step (``StageRunner.start``: its stage's compute, the sends and the receives
of the rows that come back posted) and start others before it ``finish``es the first (steps in
flight: ``engine.inflight``); the other ranks run each step whole, in the order rank 0 handed
them out.

With one stage (TP alone) a ``StageStep`` is the whole step, run by the helper ranks with rank 0.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import AttentionBatch
from engine.hostcopy import array_to_device
from engine.parallel.comm import RankGroups, share_ids
from engine.parallel.layout import Layout
from engine.runner import StepInputs

MIN_ROWS_PER_MICROBATCH = 4  # fewer rows per micro-batch cost more in per-op overhead than they overlap


@dataclass
class StageStep:
    """One step as every rank of the group runs it: its rows cut into ``microbatches`` (in row
    order), and per micro-batch the rows (numbered within it) whose hidden states go back to
    rank 0 for logits."""

    microbatches: list[StepInputs]
    returned: list[list[int]]
    # rows whose token is in flight (overlapped scheduling): the first stage's ranks take the
    # step's ids from rank 0 over their TP group (``share_ids``), not from ``input_ids``
    fed: bool = False
    # the tag of micro-batch i on the links is tag_base + i: steps in flight together (rank 0's
    # ``Pipeline.launch``) never share one
    tag_base: int = 0

    @classmethod
    def whole(cls, step: StepInputs, fed: bool = False) -> StageStep:
        """The step as one micro-batch, nothing returned (tensor parallelism alone)."""
        return cls([step], [[]], fed)


@dataclass
class StageRun:
    """A step this rank started (``StageRunner.start``): what ``finish`` waits for."""

    back: list  # rank 0: (receive, buffer) per micro-batch that returns rows
    sends: list  # (send, tensor) per micro-batch: the tensor must live until its send ends


@dataclass
class StageStats:
    """What one rank's stage did since the last reset: seconds computing (not waiting for
    activations or for a send to be taken), micro-batches and steps."""

    rank: int
    stage: int
    busy_s: float = 0.0
    microbatches: int = 0
    steps: int = 0


def microbatch_count(rows: int, most: int) -> int:
    """How many micro-batches a step of ``rows`` rows is cut into: ``most``, fewer when the
    micro-batches would hold under ``MIN_ROWS_PER_MICROBATCH`` rows each."""
    return max(1, min(most, rows // MIN_ROWS_PER_MICROBATCH))


def split_step(step: StepInputs, wanted: list[int], count: int) -> StageStep:
    """``step`` cut into ``count`` micro-batches of about as many rows each; ``wanted``: the
    step's rows whose hidden states rank 0 needs back (any order)."""
    total = len(step.input_ids)
    bounds = sorted({round(k * total / count) for k in range(count + 1)})
    rows = sorted(wanted)
    microbatches, returned = [], []
    for lo, hi in itertools.pairwise(bounds):
        microbatches.append(_rows_of(step, lo, hi))
        returned.append([r - lo for r in rows[bisect.bisect_left(rows, lo):bisect.bisect_left(rows, hi)]])
    return StageStep(microbatches, returned, fed=bool(step.feed))


def _rows_of(step: StepInputs, lo: int, hi: int) -> StepInputs:
    """Rows ``[lo, hi)`` of ``step``: each sequence's piece in them, its context ending at the
    piece's last row."""
    query_lens, context_lens, tables, loras = [], [], [], []
    end = 0
    for i, qlen in enumerate(step.query_lens):
        start, end = end, end + qlen
        a, b = max(start, lo), min(end, hi)
        if a >= b:
            continue
        query_lens.append(b - a)
        context_lens.append(step.context_lens[i] - (end - b))
        tables.append(step.block_tables[i])
        if step.lora_slots is not None:
            loras.append(step.lora_slots[i])
    return StepInputs(step.input_ids[lo:hi], step.positions[lo:hi], step.slot_mapping[lo:hi], query_lens,
                      context_lens, tables, lora_slots=loras if step.lora_slots is not None else None)


class LayerWindow:
    """A stage's KV cache (its layers only) seen through the model's layer numbers, for the
    attention backend: ``layer(i)`` is model layer ``i``."""

    def __init__(self, kv, first: int):
        self.kv, self.first = kv, first
        self.spec, self.device = kv.spec, kv.device

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.layer(i - self.first)

    def __getattr__(self, name: str):
        return getattr(self.kv, name)


class StageRunner:
    """Runs one rank's stage of every ``StageStep`` (see the module doc). On rank 0 it also
    takes the rows the last stage sends back; everywhere it counts the seconds it computes."""

    def __init__(self, model, attention, layout: Layout, rank: int, groups: RankGroups,
                 device: torch.device, dtype: torch.dtype):
        place = layout.place(rank)
        self.model, self.attention, self.groups = model, attention, groups
        self.layers = layout.layers(place.stage) if layout.stage_layers else range(len(model.layers))
        self.embeds = place.stage == 0  # the others take the activations of the stage before
        self.returns = layout.pp > 1 and rank == layout.returning_rank  # sends rows back to rank 0
        self.collects = layout.pp > 1 and rank == 0
        self.device, self.dtype = device, dtype
        self.hidden_size = model.cfg.hidden_size
        self.stats = StageStats(rank, place.stage)

    def run(self, step: StageStep, input_ids: torch.Tensor | None = None,
            on_rows: Callable[[torch.Tensor], None] | None = None) -> None:
        """Run ``step`` on this stage. ``input_ids``: the step's ids on the device, where the caller
        has them (rank 0); ``on_rows``: rank 0's, called with each micro-batch's returned hidden
        states (``[rows, hidden]``, in row order) as they arrive, while later ones still run."""
        self.finish(self.start(step, input_ids), on_rows)

    @torch.inference_mode()
    def start(self, step: StageStep, input_ids: torch.Tensor | None = None) -> StageRun:
        """This stage's compute of every micro-batch of ``step``, its sends posted (and on rank 0
        the receives of the rows that come back): the step goes on in the later stages while the
        caller (rank 0) starts another (``finish`` takes its rows)."""
        t0 = time.perf_counter()
        waited = 0.0
        if self.embeds and step.fed and self.groups.tp is not None:
            input_ids = self._share_ids(step, input_ids)
        inbox = None if self.embeds else self._post_receives(step)
        back = self._post_returns(step) if self.collects else []
        sends, row = [], 0
        for i, mb in enumerate(step.microbatches):
            n = len(mb.positions)
            tag = step.tag_base + i
            self.attention.plan(AttentionBatch(mb.query_lens, mb.context_lens, mb.block_tables,
                                               array_to_device(mb.slot_mapping, self.device)))
            positions = array_to_device(mb.positions, self.device)
            if self.embeds:
                ids = input_ids[row:row + n] if input_ids is not None else array_to_device(mb.input_ids, self.device)
                x, residual = self.model.embed_tokens(ids), None
            else:
                w0 = time.perf_counter()
                work, buf = inbox[i]
                work.wait()
                waited += time.perf_counter() - w0
                x, residual = buf[0], buf[1]
            x, residual = self.model.forward_layers(x, residual, positions, self.attention, self.layers)
            if self.groups.to_next is not None:
                out = torch.stack([x, residual])
                sends.append((self.groups.to_next.send(out, tag), out))  # the tensor lives until its send ends
            elif self.returns and step.returned[i]:
                rows = torch.as_tensor(step.returned[i], dtype=torch.long).to(self.device)
                out = residual.index_select(0, rows) + x.index_select(0, rows)
                sends.append((self.groups.back.send(out, tag), out))
            row += n
        self.stats.busy_s += time.perf_counter() - t0 - waited
        self.stats.microbatches += len(step.microbatches)
        return StageRun(back, sends)

    @torch.inference_mode()
    def finish(self, run: StageRun, on_rows: Callable[[torch.Tensor], None] | None = None) -> None:
        """Wait for a started step's returned rows (rank 0: ``on_rows`` with each micro-batch's, in
        row order) and for its sends to be taken."""
        t0 = time.perf_counter()
        waited = 0.0
        for work, buf in run.back:
            w0 = time.perf_counter()
            work.wait()
            waited += time.perf_counter() - w0
            if on_rows is not None:
                on_rows(buf)
        w0 = time.perf_counter()
        for work, _ in run.sends:
            work.wait()
        waited += time.perf_counter() - w0
        self.stats.busy_s += time.perf_counter() - t0 - waited
        self.stats.steps += 1

    def _share_ids(self, step: StageStep, input_ids: torch.Tensor | None) -> torch.Tensor:
        """The step's ids, rank 0's (sent to the stage's other ranks), or received from it."""
        if input_ids is None:
            rows = sum(len(mb.input_ids) for mb in step.microbatches)
            input_ids = torch.empty(rows, dtype=torch.long, device=self.device)
        return share_ids(self.groups.tp, input_ids)

    def _post_receives(self, step: StageStep) -> list:
        """A receive posted for every micro-batch's activations, before the first is needed."""
        out = []
        for i, mb in enumerate(step.microbatches):
            buf = torch.empty(2, len(mb.positions), self.hidden_size, dtype=self.dtype, device=self.device)
            out.append((self.groups.from_prev.recv(buf, step.tag_base + i), buf))
        return out

    def _post_returns(self, step: StageStep) -> list:
        out = []
        for i, rows in enumerate(step.returned):
            if rows:
                buf = torch.empty(len(rows), self.hidden_size, dtype=self.dtype, device=self.device)
                out.append((self.groups.back.recv(buf, step.tag_base + i), buf))
        return out

    def take_stats(self, reset: bool = False) -> StageStats:
        stats = StageStats(**vars(self.stats))
        if reset:
            self.stats = StageStats(self.stats.rank, self.stats.stage)
        return stats
