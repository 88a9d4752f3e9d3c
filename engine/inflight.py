"""Steps in flight over pipeline stages: up to one step per stage at once, each of its own
sequences, so that every stage has work while rank 0 samples and schedules (vLLM's virtual
engines, SGLang's pipeline event loop).

With S stages and one step at a time, a step fills the pipeline and drains it, then the later
stages wait while rank 0 samples and schedules the next: at best M / (M + S - 1) of the stages'
time is used with M micro-batches, and each micro-batch reads the stage's weights again. Here
the running sequences are split into S groups, one step each:

    stage 0 (rank 0)  | A | B |sample A, schedule A| A' | B' ...
    stage 1           |   | A | B               |    | A' ...

One ``step()`` call: schedule a step of the sequences in no step in flight (about running / S
of them, so the groups stay even; admissions and prefill chunks join any step), start it (rank
0 runs its stage and returns), and once S steps are in flight, resolve the oldest (wait for its
rows from the last stage, sample, stops, outputs). A sequence is never in two steps in flight, so
no step takes a token another has not sampled yet (unlike ``engine.overlap``). Every stage runs
the steps in the order they started: a block that a resolved step freed (a finished, aborted or
preempted sequence's, or rejected drafts') and a later step reuses is written by that step after
the earlier one is done with it, on every stage. Writers outside the steps (a prefill worker
writing the KV of a request whose blocks it got) are kept off blocks a step in flight writes: an
aborted sequence's blocks are held until its step in flight has resolved (``fence``), and when
the next step may have to preempt (too few free blocks for the sequences it would grow, or a
waiting sequence outranking a running one) the steps in flight are resolved first. Should a
sequence be preempted while its step is in flight all the same (that estimate is short), its
blocks are held as an aborted one's (``Scheduler.before_preempt``), and it keeps that step's
token and is re-admitted once it is known, as under ``engine.overlap``.

Steps that run whole, alone, as with one step at a time (every step in flight is resolved first,
and the step is cut into micro-batches): steps with constrained rows (a grammar's masks are one
step's at a time, and its next mask follows the token), and every step while the runner keeps
each step's logits (``capture_logits``: tests compare them step by step). Speculative decoding,
penalties and prefix-cache hits run in flight: the drafter and the sampler read tokens that are
all resolved. A decode step in flight is one micro-batch (a step per stage already keeps the
stages busy; more would read the weights again); a step with prefill chunks is cut into
micro-batches as usual.

The engine supplies ``start(out) -> Pending`` (a step in flight: ``Pending.result()`` waits for
its tokens), ``run_step(out)`` (a step run whole and taken) and ``runs_whole(seqs)`` (whether a
step of these sequences runs whole); no torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.scheduler import Scheduler, SchedulerOutput, StepOutput
from engine.sequence import Sequence
from kvstore.pool import BlockPool


@dataclass
class Inflight:
    out: SchedulerOutput
    pending: Any  # the engine's handle: .result() -> list[SampledToken]
    held: list[int] = field(default_factory=list)  # blocks of sequences aborted meanwhile (``fence``)


class Starter(Protocol):
    """What steps in flight need of an engine (``Engine`` is one)."""

    scheduler: Scheduler
    pool: BlockPool
    num_steps: int

    def start(self, out: SchedulerOutput) -> Any: ...

    def run_step(self, out: SchedulerOutput) -> list[StepOutput]: ...

    def runs_whole(self, seqs: Iterable[Sequence]) -> bool: ...


class StepsInFlight:
    def __init__(self, core: Starter, depth: int):
        self.core = core
        self.depth = depth  # steps in flight at most (the stages)
        self.steps: deque[Inflight] = deque()  # oldest first
        self.whole = 0  # steps run whole (the fallback), for tests and logs
        core.scheduler.before_preempt = self.fence  # a victim's step in flight still writes its blocks

    @property
    def inflight(self) -> Inflight | None:
        """The oldest step in flight (None: none), as ``OverlappedSteps.inflight``."""
        return self.steps[0] if self.steps else None

    def step(self) -> list[StepOutput]:
        core, scheduler = self.core, self.core.scheduler
        try:
            if core.runs_whole(scheduler.running):
                return self._whole(self.finish())
            busy = {c.seq for f in self.steps for c in f.out.chunks}
            results = self.finish() if busy and self._may_preempt(busy) else []
            out = scheduler.schedule(busy if self.steps else (), most=-(-len(scheduler.running) // self.depth))
            if not out.chunks:
                return results + self._resolve_oldest()
            if core.runs_whole(c.seq for c in out.chunks):  # a constrained sequence admitted
                return self._whole(results + self.finish(), out)
            pending = core.start(out)
            scheduler.advance(out)
            self.steps.append(Inflight(out, pending))
            core.num_steps += 1
            return results + self._resolve_oldest() if len(self.steps) >= self.depth else results
        except BaseException:
            # The steps' tokens are lost. The engine loop fails the running requests; preempted
            # ones in the queue must not wait for a token that will never come.
            for lost in self.steps:
                for chunk in lost.out.sampling_chunks:
                    chunk.seq.num_placeholders = 0
            self.steps.clear()
            raise

    def _may_preempt(self, busy: set[Sequence]) -> bool:
        """Whether the next step may have to preempt (the running sequences in no step in flight
        want more blocks than are free, or a waiting one outranks a running one): then the steps
        in flight are resolved first, so that no victim's blocks go back while a step writes them."""
        scheduler = self.core.scheduler
        waiting, running = scheduler.waiting, scheduler.running
        if waiting and running and waiting[0].priority > running[-1].priority:
            return True
        bs, budget = scheduler.kv.block_size, scheduler.config.max_num_batched_tokens
        need = 0
        for seq in running:
            if seq not in busy:
                end = seq.num_computed_tokens + min(seq.num_tokens - seq.num_computed_tokens, budget)
                need += max(0, -(-end // bs) - len(seq.block_table))
        return need > self.core.pool.num_free

    def _whole(self, results: list[StepOutput], out: SchedulerOutput | None = None) -> list[StepOutput]:
        """A step run whole, with no step in flight (``out``, or one scheduled now)."""
        out = out or self.core.scheduler.schedule()
        if out.chunks:
            results += self.core.run_step(out)
            self.whole += 1
        return results

    def fence(self, seq: Sequence) -> None:
        """``seq`` is about to be aborted or preempted: its blocks stay out of the free queues until its step in
        flight (if any) has run on every stage, so that no writer outside the steps (a prefill
        worker writing the KV of a request whose blocks it got) writes them before that step."""
        for f in self.steps:
            if any(c.seq is seq for c in f.out.chunks):
                blocks = list(seq.block_table)
                self.core.pool.hold(blocks)
                f.held += blocks
                return

    def finish(self) -> list[StepOutput]:
        """Resolve every step in flight, oldest first, without scheduling another."""
        results: list[StepOutput] = []
        while self.steps:
            results += self._resolve_oldest()
        return results

    def _resolve_oldest(self) -> list[StepOutput]:
        if not self.steps:
            return []
        step = self.steps[0]
        tokens = step.pending.result()
        self.steps.popleft()
        if step.held:
            self.core.pool.free(step.held)
        return self.core.scheduler.resolve(step.out, tokens)
