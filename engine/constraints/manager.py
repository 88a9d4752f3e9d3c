"""The engine's grammars: one backend (built on first use), one compiled-grammar cache, the step masks.

    prepare(constraint)   any thread: compile into the cache (a worker warms it before adding)
    attach(seq)           before a sequence is added (a worker: in a thread, so that the compile and
                          the replay stall neither the engine nor the event loop), else when it is
                          added: its GrammarState, replaying the tokens it already generated
                          (migrated, disaggregated or rebuilt requests)
    begin_step(seqs)      engine thread, before the forward pass: starts the mask fill, in the grammar
                          process (replica.py; ``GrammarConfig.process``, llguidance) or in a thread
    the sampler           applies the masks (StepMasks.apply); the scheduler advances the states
    draft_masks(rows)     speculative decoding, engine thread: the masks of drafting rows' positions
                          (each drafted position under the state after the drafts before it)

The grammar process is the default where the backend allows it: a fill thread in this process
costs the engine thread GIL hand-overs that slowed the 0.2M-parameter model's batch-32 decoding by
~25% (docs/benchmarks.md, "structured"); the process costs a small message per step. The
engine's own matchers check only the tokens it did not sample under its masks (replayed ones, a
prefill worker's first token); the process's replicas check the rest, and their verdict (complete,
or broken) comes back with the next step's masks (state.py).

Building the backend reads the whole vocabulary (seconds for 128k tokens), so it
happens on the first constraint, not when a worker starts; ``prepare`` from a
thread keeps that off the engine thread too.
"""

from __future__ import annotations

import itertools
import operator
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from engine.constraints.backend import (
    PROCESS_BACKENDS,
    GrammarBackend,
    bitmask_words,
    create_backend,
)
from engine.constraints.cache import GrammarCache
from engine.constraints.masks import FILL_TIMEOUT, StepMasks
from engine.constraints.replica import GrammarProcess
from engine.constraints.state import GrammarState
from engine.sampling import SamplingParams
from mesh.constraints.spec import Constraint, ConstraintError


class ConstrainedSeq(Protocol):
    """What the manager reads and writes of a sequence. ``engine.sequence.Sequence`` is one; it
    holds its ``GrammarState``, so this package names it by this Protocol, not by an import."""

    params: SamplingParams  # its constraint
    grammar: GrammarState | None

    @property
    def generated_token_ids(self) -> list[int]: ...

    @property
    def is_finished(self) -> bool: ...


@dataclass(frozen=True)
class GrammarConfig:
    backend: str = "llguidance"
    threads: int = 0  # mask-fill threads of the backend; 0: its default
    cache_size: int = 256  # compiled grammars kept
    process: bool = True  # fill masks in a grammar process where the backend can (PROCESS_BACKENDS)
    # how long the grammar process polls for the next step before it sleeps (replica._Frames): a
    # sleeping process costs each step's message a cross-core wake-up; 0: it always sleeps
    spin_seconds: float = 0.003


@dataclass
class MaskStats:
    steps: int = 0  # steps with at least one constrained row
    rows: int = 0
    fill_seconds: float = 0.0  # in the mask thread or the grammar process
    wait_seconds: float = 0.0  # the sampler waiting for a fill: the part not hidden behind the model


class GrammarManager:
    def __init__(self, tokenizer_file: str | Path | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 config: GrammarConfig | None = None, pin_memory: bool = False):
        self.config = config or GrammarConfig()
        self.tokenizer_file = Path(tokenizer_file) if tokenizer_file else None
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.pin_memory = pin_memory
        self.cache = GrammarCache(self._compile, self.config.cache_size)
        self.masks = MaskStats()
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None
        self._process: GrammarProcess | None = None
        if self.config.process and self.config.backend in PROCESS_BACKENDS and self.tokenizer_file is not None:
            self._process = GrammarProcess(self.tokenizer_file, vocab_size, eos_token_ids, self.config.backend,
                                           self.config.threads, self.config.cache_size, self.config.spin_seconds)
        self._keys = itertools.count(1)
        self._gone: deque[int] = deque()  # replicas to drop: their engine-side states were collected
        self._predicted: tuple[int, list[ConstrainedSeq]] | None = None  # (step number, batch): tokens_taken

    # -- compile ---------------------------------------------------------------------------
    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                if self.tokenizer_file is None or not self.tokenizer_file.is_file():
                    raise ConstraintError("this model has no tokenizer.json: constrained output needs one")
                self._backend = create_backend(self.config.backend, self.tokenizer_file.read_text(),
                                               self.vocab_size, self.eos_token_ids, self.config.threads)
            return self._backend

    def _compile(self, c: Constraint) -> object:
        return self.backend.compile(c)

    def prepare(self, c: Constraint) -> None:
        """Compile ``c`` into the cache (raises ``ConstraintError``); from any thread."""
        self.cache.get(c)
        if self._process is not None:
            self._process.compile(c)  # and the grammar process's (it starts it)

    # -- sequences -------------------------------------------------------------------------
    def attach(self, seq: ConstrainedSeq) -> None:
        """Give ``seq`` its grammar state, caught up with every token it generated so far."""
        c = seq.params.constraint
        if c is None or seq.grammar is not None:
            return
        if c.start_after is not None and c.start_after >= self.vocab_size:
            raise ConstraintError(f"start_after {c.start_after} is outside the vocabulary (size {self.vocab_size})")
        state = GrammarState(self.backend.matcher(self.cache.get(c)), c.start_after)
        if not state.replay(seq.generated_token_ids):
            raise ConstraintError(f"the tokens generated so far do not match the constraint: {state.error}")
        if state.is_done:  # they complete it (a stream cut between its last token and its end): it ends
            state.settle_late("")  # at its first step, without a token
        if self._process is not None:
            state.key = next(self._keys)
            weakref.finalize(state, self._gone.append, state.key)
        seq.grammar = state

    # -- steps -----------------------------------------------------------------------------
    def begin_step(self, seqs: list[ConstrainedSeq]) -> StepMasks | None:
        """Start filling the masks of the constrained rows of ``seqs`` (the rows that sample this step)."""
        rows = _masked_rows(seqs)
        if not rows:
            return None
        if self._process is not None:
            return self._begin_in_process(seqs, rows)
        bitmask = self._buffer(len(seqs))[: len(rows)]
        backend = self.backend
        # the Python side of the fill happens here: the mask thread only runs the backend's native
        # call, which releases the GIL, so it never competes with the engine thread for it
        fill = backend.prepare_fill([(state.matcher, j) for j, (_, state) in enumerate(rows)], bitmask)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        self.masks.steps += 1
        self.masks.rows += len(rows)
        done = self._pool.submit(self._fill, fill)
        return StepMasks(partial(done.result, timeout=FILL_TIMEOUT), [i for i, _ in rows], bitmask, None, self.masks)

    def _begin_in_process(self, seqs: list[ConstrainedSeq], rows: list[tuple[int, GrammarState]]) -> StepMasks:
        """The masks ``tokens_taken`` started for this very batch (most decode steps: nothing to send),
        or a step message with this batch's rows (their keys, the tokens the process has not seen)."""
        predicted = self._predicted
        self._predicted = None
        if predicted is not None and len(predicted[1]) == len(seqs) and all(map(operator.is_, predicted[1], seqs)):
            step_no = predicted[0]
        else:
            step_no = self._send_step(seqs, rows, self._process.start())
        return self._masks(step_no, seqs, [i for i, _ in rows])

    def draft_masks(self, rows: list[tuple[GrammarState | None, list[int] | tuple[int, ...]]]
                    ) -> tuple[torch.Tensor, list[int]] | None:
        """Speculative decoding: the masks of drafting rows' positions (each row's last real position,
        then each drafted one), filled in this thread. ``rows``: per drafting row its grammar state
        (None: free) and drafts. The bitmask of the constrained positions and which positions they
        are (over every row's positions, in order); None where no position is constrained."""
        masked, at, positions = [], 0, []
        for state, drafts in rows:
            if state is not None and state.needs_mask:
                positions.extend(range(at, at + len(drafts) + 1))
                masked.append((state, drafts))
            at += len(drafts) + 1
        if not positions:
            return None
        bitmask = torch.empty((len(positions), bitmask_words(self.vocab_size)), dtype=torch.int32)
        fill = self.backend.fill
        row = 0
        for state, drafts in masked:
            state.fill_drafted(fill, list(drafts), bitmask, row)
            row += len(drafts) + 1
        return bitmask, positions

    def tokens_taken(self, seqs: list[ConstrainedSeq]) -> None:
        """After a step's tokens were taken: the grammar process gets those of the constrained
        sequences that go on and fills their masks for a next step of the sequences that go on, in
        this order, while this thread finishes the step and schedules the next one. ``begin_step``
        uses them if the next step is that batch (a new or preempted sequence changes it: then the
        process only rearranges the rows)."""
        proc = self._process
        if proc is None or proc.pid is None or all(s.grammar is None for s in seqs):
            return
        going = [s for s in seqs if not s.is_finished]
        rows = _masked_rows(going)
        if rows:
            self._predicted = (self._send_step(going, rows, proc.epoch), going)

    def _send_step(self, seqs: list[ConstrainedSeq], rows: list[tuple[int, GrammarState]], epoch: int) -> int:
        """One step message to the grammar process for the batch ``seqs``; its step number."""
        keys, counts, tokens, new, gone = self._unsent(seqs, rows, epoch)
        return self._process.step(len(seqs), [i for i, _ in rows], keys, counts, tokens, new, gone)

    def _masks(self, step_no: int, seqs: list[ConstrainedSeq], rows: list[int]) -> StepMasks:
        proc = self._process
        self.masks.steps += 1
        self.masks.rows += len(rows)
        batch = len(seqs)
        out = torch.from_numpy(proc.view)  # the buffer the process writes this step into
        wait = partial(self._wait_process, step_no, seqs)
        if proc.layout == "bias":
            return StepMasks(wait, rows, None, out[:batch, : self.vocab_size], self.masks)
        return StepMasks(wait, rows, out[: len(rows)], None, self.masks)

    def _unsent(self, seqs: list[ConstrainedSeq], rows: list[tuple[int, GrammarState]], epoch: int) -> tuple:
        """For the grammar process: the rows' keys, the tokens each took since it was last sent
        (flat, with counts), the replicas to make (a state new to this process: all its tokens) and
        those to drop."""
        keys, counts, tokens, new = [], [], [], []
        for i, state in rows:
            seq = seqs[i]
            if state.epoch != epoch:
                c = seq.params.constraint
                new.append((state.key, c.kind.value, c.source, c.start_after))
                state.epoch, state.sent = epoch, 0  # the replica checks the tokens from here on
            generated = seq.generated_token_ids
            n = len(generated) - state.sent
            if n:
                tokens.extend(generated[state.sent:])
                state.sent += n
            keys.append(state.key)
            counts.append(n)
        gone = []
        while self._gone:
            gone.append(self._gone.popleft())
        return keys, counts, tokens, new, gone

    def _wait_process(self, step_no: int, seqs: list[ConstrainedSeq]) -> None:
        proc = self._process
        before = proc.fill_seconds
        try:
            verdicts = proc.wait(step_no, FILL_TIMEOUT)
        finally:
            self.masks.fill_seconds += proc.fill_seconds - before
        for row, error in verdicts:  # rows whose grammar is complete, or broke: they end this step
            seqs[row].grammar.settle_late(error)

    def _fill(self, fill) -> None:
        t0 = time.perf_counter()
        fill()
        self.masks.fill_seconds += time.perf_counter() - t0

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            shape = (max(rows, 8), bitmask_words(self.vocab_size))
            self._bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin_memory)
        return self._bitmask

    def stats(self) -> dict[str, float]:
        s, m = self.cache.stats, self.masks
        return {
            "grammars_cached": len(self.cache), "compile_hits": s.hits, "compile_misses": s.misses,
            "compile_seconds": s.compile_seconds, "mask_steps": m.steps, "mask_rows": m.rows,
            "mask_fill_seconds": m.fill_seconds, "mask_wait_seconds": m.wait_seconds,
            "process_replicas": self._process.replicas if self._process is not None else 0,
        }

    @property
    def process_pid(self) -> int | None:
        """The grammar process's pid while one runs (tests)."""
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _masked_rows(seqs: list[ConstrainedSeq]) -> list[tuple[int, GrammarState]]:
    """(row, state) of the sequences whose next token is constrained."""
    return [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.needs_mask]
