"""Executes one ``SchedulerOutput``: builds the flat batch, runs the model, samples.

``StepInputs`` is the flat batch as plain arrays: under tensor parallelism rank 0
builds it, hands it to the other ranks (``broadcast``), and every rank runs
``forward`` on it; only rank 0 computes logits and samples. A row whose token is
still in flight (overlapped scheduling) has it on rank 0's device only: the other
ranks take the step's ids from rank 0 over their TP group. Over pipeline
stages (``pipeline``, ``engine.parallel.pipeline``) the step runs stage after
stage in micro-batches, and only the rows that need logits come back to rank 0.

``launch`` returns as soon as the step is queued on the device (a ``PendingStep``);
``PendingStep.result()`` waits for its tokens. ``execute`` is both at once. With
overlapped scheduling (``engine.overlap``) a step is launched before the
previous one's tokens reached the host: a row whose input token is still in
flight reads it from the previous step's sampled ids on the device
(``StepInputs.feed``), so the host never waits for them to schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionBatch
from engine.constraints.manager import GrammarManager
from engine.cuda_graphs import DecodeGraphs
from engine.hostcopy import array_to_device, to_device
from engine.model import CausalLM
from engine.sampler import SampledBatch, Sampler
from engine.scheduler import SchedulerOutput
from engine.sequence import SampledToken, Sequence
from engine.verification import Verification

IN_FLIGHT = -1  # input id of a row whose token an earlier step is still sampling (never reaches the model)


@dataclass
class StepInputs:
    """One step's tokens in scheduling order: sequence i owns ``query_lens[i]`` consecutive rows."""

    input_ids: np.ndarray  # [T]; IN_FLIGHT where the token is on the device only
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] block * block_size + offset
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    feed: list[tuple[int, Sequence]] = field(default_factory=list)  # (row, whose in-flight token)
    lora_slots: list[int] | None = None  # per sequence: its LoRA adapter's slot, -1 for the base model


@dataclass
class PendingStep:
    """A launched step: its sampled ids on the device, on their way to the host."""

    samples: SampledBatch | None
    index: dict[Sequence, int]  # which row of samples.tokens is whose token
    verification: Verification | None = None  # speculative decoding: the step's drafting rows

    def result(self) -> list[SampledToken]:
        """The tokens, in ``sampling_chunks`` order (waits for the device); a drafting row's
        token carries the tokens its accepted drafts let it emit too (``SampledToken.then``)."""
        tokens = self.samples.to_host() if self.samples is not None else []
        return tokens if self.verification is None else self.verification.emit(tokens)


class StartedStep:
    """A step whose first stage ran and whose later ones may still run (``ModelRunner.start``):
    ``result()`` waits for its rows, samples them and waits for the tokens."""

    def __init__(self, sample: Callable[[], PendingStep]):
        self._sample = sample

    def result(self) -> list[SampledToken]:
        with torch.inference_mode():
            pending = self._sample()
        return pending.result()


class ModelRunner:
    def __init__(self, model: CausalLM, attention: AttentionBackend, sampler: Sampler | None, block_size: int,
                 broadcast: Callable[[StepInputs, torch.Tensor], None] | None = None,
                 graphs: DecodeGraphs | None = None,
                 lora=None, grammar: GrammarManager | None = None, pipeline=None):
        self.model = model
        self.lora = lora  # a LoraManager: brings each step's adapters into its slots, plans their rows
        self.grammar = grammar  # constrained rows: their masks are filled while the model runs
        self.graphs = graphs  # CUDA: pure decode steps replay from graphs
        self.attention = attention
        self.sampler = sampler
        self.block_size = block_size
        self.broadcast = broadcast  # tensor parallel: hands each step (and its token ids) to the other ranks
        self.pipeline = pipeline  # pipeline stages: a Pipeline runs each step and gives the rows' logits
        self.device = next(model.parameters()).device
        # Tests and debugging: keep the logits of every row of the last step.
        self.capture_logits = False
        self.last_logits: torch.Tensor | None = None
        # CUDA: recorded once a step's inputs and attention plan left their host buffers, which the
        # next step refills (pinned buffers of ours and FlashInfer's); the next launch waits for it.
        self._inputs_sent: torch.cuda.Event | None = None
        configure = getattr(attention, "configure", None)
        if configure is not None:  # the backend can plan whole steps up front (before the first layer)
            layer = model.layers[0].self_attn
            configure(layer.num_heads, model.embed_tokens.weight.dtype)

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: PendingStep | None = None) -> PendingStep:
        """Queue the step on the device; ``prev``: the step whose tokens some rows take as input."""
        seqs = [c.seq for c in out.sampling_chunks]
        # masks are filled while the inputs are built and the model runs; constrained rows never have
        # a token in flight here (EngineCore.needs_resolved_tokens)
        masks = self.grammar.begin_step(seqs) if self.grammar is not None and seqs else None
        step, sample_rows = self.inputs(out)
        draft_rows, drafting = _drafted_rows(out)
        logits = self._logits(step, prev, sample_rows + draft_rows if sample_rows else [])
        return self._sample(logits, seqs, len(sample_rows), drafting, masks)

    @torch.inference_mode()
    def start(self, out: SchedulerOutput, microbatches: int | None = None) -> StartedStep:
        """Pipeline stages: run rank 0's stage of the step and return while the later stages work
        on it (``engine.inflight``); ``StartedStep.result()`` samples. No row takes an in-flight
        token, none is constrained (those steps run whole: ``launch``); ``microbatches``: at most
        this many for the step."""
        seqs = [c.seq for c in out.sampling_chunks]
        step, sample_rows = self.inputs(out)
        draft_rows, drafting = _drafted_rows(out)
        rows = sample_rows + draft_rows if sample_rows else []
        started = self.pipeline.launch(step, array_to_device(step.input_ids, self.device), rows, microbatches)
        return StartedStep(lambda: self._sample(started.logits(), seqs, len(sample_rows), drafting, None))

    def _sample(self, logits: torch.Tensor | None, seqs: list[Sequence], n: int, drafting, masks) -> PendingStep:
        """Sample the step's ``n`` sampled rows (the first ``n`` of ``logits``; the drafted rows follow)."""
        if not n:
            return PendingStep(None, {})
        verification = None
        if drafting:  # before the sampler masks the sampled rows in place
            verification = Verification.launch(self.sampler, self.grammar, logits, n, drafting, seqs, masks)
        samples = self.sampler.sample(logits[:n] if drafting else logits, seqs, masks)
        return PendingStep(samples, {s: i for i, s in enumerate(seqs)}, verification)

    def _logits(self, step: StepInputs, prev: PendingStep | None, rows: list[int]) -> torch.Tensor | None:
        """Run the step; the logits of ``rows`` (None for none). ``capture_logits``: every row's
        are kept in ``last_logits`` too."""
        want = list(range(len(step.input_ids))) if self.capture_logits else rows
        if self.pipeline is not None:
            logits = self.pipeline.logits(step, self._input_ids(step, prev), want)
            if not self.capture_logits:
                return logits
        else:
            ids = self._input_ids(step, prev)
            if self.broadcast is not None:  # in-flight tokens are on our device only: the ids go too
                self.broadcast(step, ids)
            if self._inputs_sent is not None:
                self._inputs_sent.synchronize()  # microseconds: the GPU finished the step before the last
            hidden = self.forward(step, ids)
            if not self.capture_logits:
                return self.model.logits(hidden.index_select(0, to_device(rows, torch.long, self.device))) if rows else None
            logits = self.model.logits(hidden)
        self.last_logits = logits
        return logits.index_select(0, to_device(rows, torch.long, self.device)) if rows else None

    def inputs(self, out: SchedulerOutput) -> tuple[StepInputs, list[int]]:
        """The flat batch of a step, and the rows to sample from."""
        if all(c.num_tokens == 1 for c in out.chunks):
            step, sample_rows = self._decode_inputs(out)
            if self.lora is not None:
                step.lora_slots = self.lora.activate([c.seq.lora for c in out.chunks])
            return step, sample_rows
        bs = self.block_size
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        step = StepInputs(np.empty(0), np.empty(0), np.empty(0), [], [], [])
        sample_rows: list[int] = []
        row = 0
        for c in out.chunks:
            seq = c.seq
            p = np.arange(c.start, c.end, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            known = min(c.end, seq.num_tokens)
            chunk_ids = np.asarray(seq.tokens_between(c.start, known), dtype=np.int64)
            if c.drafts:  # the last token, then the drafts after it
                chunk_ids = np.asarray([seq.token_at(c.start), *c.drafts], dtype=np.int64)
            elif known < c.end:  # its last position's token is being sampled by the step in flight
                assert c.end - known == 1, "at most one token of a sequence is ever in flight"
                chunk_ids = np.append(chunk_ids, IN_FLIGHT)
                step.feed.append((row + c.num_tokens - 1, seq))
            ids.append(chunk_ids)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            step.query_lens.append(c.num_tokens)
            step.context_lens.append(c.end)
            step.block_tables.append(seq.block_table)
            row += c.num_tokens
            if c.samples:  # its last row, or a drafting row's first (the drafted rows verify)
                sample_rows.append(row - c.num_tokens if c.drafts else row - 1)
        step.input_ids, step.positions, step.slot_mapping = map(np.concatenate, (ids, pos, slots))
        if self.lora is not None:
            step.lora_slots = self.lora.activate([c.seq.lora for c in out.chunks])
        return step, sample_rows

    def _decode_inputs(self, out: SchedulerOutput) -> tuple[StepInputs, list[int]]:
        """``inputs`` of a step of one token per sequence (most steps): plain lists, one array each."""
        bs = self.block_size
        ids, pos, slots, tables, feed, sample_rows = [], [], [], [], [], []
        for row, c in enumerate(out.chunks):
            seq, p = c.seq, c.start
            table = seq.block_table
            if p < seq.num_tokens:
                ids.append(seq.token_at(p))
            else:  # being sampled by the step in flight
                ids.append(IN_FLIGHT)
                feed.append((row, seq))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            tables.append(table)
            if c.samples:
                sample_rows.append(row)
        n = len(ids)
        step = StepInputs(np.array(ids, dtype=np.int64), np.array(pos, dtype=np.int64),
                          np.array(slots, dtype=np.int64), [1] * n, [p + 1 for p in pos], tables, feed)
        return step, sample_rows

    def _input_ids(self, step: StepInputs, prev: PendingStep | None) -> torch.Tensor:
        """The step's token ids on the device, in-flight ones gathered from ``prev``'s samples."""
        ids = array_to_device(step.input_ids, self.device)
        if not step.feed:
            return ids
        if prev is None or prev.samples is None or any(seq not in prev.index for _, seq in step.feed):
            raise RuntimeError("a step takes an in-flight token from a step other than the one before it")
        dst = to_device([r for r, _ in step.feed], torch.long, self.device)
        src = to_device([prev.index[seq] for _, seq in step.feed], torch.long, self.device)
        if self.device.type != "cuda":
            ids = ids.clone()  # shares the numpy array's memory on CPU
        ids.index_copy_(0, dst, prev.samples.tokens.index_select(0, src))
        return ids

    @torch.inference_mode()
    def forward(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step's tokens; writes their KV. ``input_ids``: the
        step's ids on the device when the caller has them (else ``step.input_ids``)."""
        if input_ids is None:
            input_ids = array_to_device(step.input_ids, self.device)
        lora_rows = self.lora is not None and self.lora.plan(step.query_lens, step.lora_slots)
        if self.graphs is not None and not lora_rows and len(step.input_ids) == len(step.query_lens):  # decode
            size = self.graphs.prepare(input_ids, step.positions, step.slot_mapping,
                                       step.context_lens, step.block_tables)
            if size is not None:
                self._mark_inputs_sent()
                return self.graphs.replay(size, len(step.query_lens))
        batch = AttentionBatch(step.query_lens, step.context_lens, step.block_tables,
                               array_to_device(step.slot_mapping, self.device))
        self.attention.plan(batch)
        positions = array_to_device(step.positions, self.device)
        self._mark_inputs_sent()
        return self.model(input_ids, positions, self.attention)

    def _mark_inputs_sent(self) -> None:
        if self.device.type == "cuda":
            if self._inputs_sent is None:
                self._inputs_sent = torch.cuda.Event()
            self._inputs_sent.record()


def _drafted_rows(out: SchedulerOutput) -> tuple[list[int], list[tuple[int, list[int] | tuple[int, ...]]]]:
    """The step's rows at drafted positions (in order), and per drafting row its index among the
    sampled rows and its drafts."""
    rows: list[int] = []
    drafting = []
    row = sampled = 0
    for c in out.chunks:
        if c.drafts:
            rows.extend(range(row + 1, row + c.num_tokens))
            drafting.append((sampled, c.drafts))
        row += c.num_tokens
        sampled += c.samples
    return rows, drafting
