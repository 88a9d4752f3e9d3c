"""Overlapped scheduling: the host schedules step N+1 and processes step N's outputs while the
device runs step N (vLLM v1's async scheduling, SGLang's overlap scheduler).

One ``step()`` call:

    schedule N+1             the scheduler sees N's samples as placeholders (Sequence.num_placeholders)
    launch N+1               rows whose input is N's token read it on the device; returns at once
    advance N+1              positions computed, N+1's samples become placeholders
    resolve N                wait for N's tokens (one device-to-host copy), then stops, finishes, outputs

so the device always has the next step queued while the host works, and outputs come one
step later than without overlap, in order per request. Tokens are the same as without overlap:

* a sequence that stops on step N's token (EOS, a stop id) was already in step N+1: that
  row's token is dropped when N+1 resolves (one wasted row, never an extra token);
* a sequence whose in-flight token is its last by length (``max_tokens``, context) is not
  scheduled again (``Scheduler._stops_by_length``);
* a sequence preempted at step N+1 keeps step N's token (it goes back to the queue with
  it in flight and is re-admitted once it is known); an aborted one drops it;
* after a step that sampled rows with penalties (they read every earlier token on the host) or
  a grammar (its next mask follows the token), the host resolves that step before scheduling
  the next: those steps run without overlap.

Who frees what: ``resolve`` retires finished sequences as before. Their blocks may still be
written by the step in flight (the dropped row): anything that reuses them is queued after
it on the same stream, or, for offload copies, waits for the compute stream first.

The engine supplies ``launch(out, prev) -> Pending`` (``Pending.result()`` waits for the
tokens) and ``needs_resolved_tokens(inflight_out)``; no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from engine.scheduler import Scheduler, SchedulerOutput, StepOutput


@dataclass
class Inflight:
    out: SchedulerOutput
    pending: Any  # the engine's handle: .result() -> list[SampledToken]


class Launcher(Protocol):
    """What overlapped steps need of an engine (``EngineCore`` is one): its scheduler, a step
    counter, and the two operations above."""

    scheduler: Scheduler
    num_steps: int

    def launch(self, out: SchedulerOutput, prev: Any = None) -> Any: ...

    def needs_resolved_tokens(self, out: SchedulerOutput) -> bool: ...


class OverlappedSteps:
    def __init__(self, core: Launcher):
        self.core = core
        self.inflight: Inflight | None = None

    def step(self) -> list[StepOutput]:
        core, scheduler = self.core, self.core.scheduler
        prev, self.inflight = self.inflight, None
        try:
            results: list[StepOutput] = []
            if prev is not None and core.needs_resolved_tokens(prev.out):
                # before scheduling: resolving may finish a sequence (and free its blocks), which
                # must then not be in the step about to launch
                results, prev = self._resolve(prev), None
            out = scheduler.schedule()
            if prev is not None and not out.chunks:
                results, prev = self._resolve(prev), None
            if not out.chunks:
                return results
            pending = core.launch(out, prev.pending if prev is not None else None)
            scheduler.advance(out)
            self.inflight = Inflight(out, pending)
            core.num_steps += 1
            return self._resolve(prev) if prev is not None else results
        except BaseException:
            # The failed steps' tokens are lost. The engine loop fails the running requests;
            # preempted ones in the queue must not wait for a token that will never come.
            for lost in (prev, self.inflight):
                if lost is not None:
                    for chunk in lost.out.sampling_chunks:
                        chunk.seq.num_placeholders = 0
            self.inflight = None
            raise

    def finish(self) -> list[StepOutput]:
        """Resolve the step in flight, if any, without scheduling another."""
        prev, self.inflight = self.inflight, None
        return self._resolve(prev) if prev is not None else []

    def _resolve(self, step: Inflight) -> list[StepOutput]:
        return self.core.scheduler.resolve(step.out, step.pending.result())
