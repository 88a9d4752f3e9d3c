"""Executes one ``SchedulerOutput``: builds the flat batch, runs the model, samples.

``StepInputs`` is the flat batch as plain arrays: under tensor parallelism rank 0
builds it, hands it to the other ranks (``broadcast``), and every rank runs
``forward`` on it; only rank 0 computes logits and samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mesh.engine.attention import AttentionBackend, AttentionBatch
from mesh.engine.constraints.manager import GrammarManager
from mesh.engine.cuda_graphs import DecodeGraphs
from mesh.engine.model import CausalLM
from mesh.engine.sampler import Sampler
from mesh.engine.scheduler import SchedulerOutput
from mesh.engine.sequence import SampledToken


@dataclass
class StepInputs:
    """One step's tokens in scheduling order: sequence i owns ``query_lens[i]`` consecutive rows."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] block * block_size + offset
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    lora_slots: list[int] | None = None  # per sequence: its LoRA adapter's slot, -1 for the base model


class ModelRunner:
    def __init__(self, model: CausalLM, attention: AttentionBackend, sampler: Sampler | None, block_size: int,
                 broadcast: Callable[[StepInputs], None] | None = None, graphs: DecodeGraphs | None = None,
                 lora=None, grammar: GrammarManager | None = None):
        self.model = model
        self.lora = lora  # a LoraManager: brings each step's adapters into its slots, plans their rows
        self.grammar = grammar  # constrained rows: their masks are filled while the model runs
        self.graphs = graphs  # CUDA: pure decode steps replay from graphs
        self.attention = attention
        self.sampler = sampler
        self.block_size = block_size
        self.broadcast = broadcast  # tensor parallel: hands each step to the other ranks
        self.device = next(model.parameters()).device
        # Tests and debugging: keep the logits of every row of the last step.
        self.capture_logits = False
        self.last_logits: torch.Tensor | None = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        step, sample_rows = self.inputs(out)
        if self.broadcast is not None:
            self.broadcast(step)
        seqs = [c.seq for c in out.sampling_chunks]
        masks = self.grammar.begin_step(seqs) if self.grammar is not None and seqs else None
        hidden = self.forward(step)
        if self.capture_logits:
            self.last_logits = self.model.logits(hidden)
        if not sample_rows:
            return []
        rows = torch.as_tensor(sample_rows, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows))
        return self.sampler(logits, seqs, masks)

    def inputs(self, out: SchedulerOutput) -> tuple[StepInputs, list[int]]:
        """The flat batch of a step, and the rows to sample from."""
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
            ids.append(np.asarray(seq.tokens_between(c.start, c.end), dtype=np.int64))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            step.query_lens.append(c.num_tokens)
            step.context_lens.append(c.end)
            step.block_tables.append(seq.block_table)
            row += c.num_tokens
            if c.samples:
                sample_rows.append(row - 1)
        step.input_ids, step.positions, step.slot_mapping = map(np.concatenate, (ids, pos, slots))
        if self.lora is not None:
            step.lora_slots = self.lora.activate([c.seq.lora for c in out.chunks])
        return step, sample_rows

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step's tokens; writes their KV."""
        lora_rows = self.lora is not None and self.lora.plan(step.query_lens, step.lora_slots)
        if self.graphs is not None and not lora_rows and len(step.input_ids) == len(step.query_lens):  # decode
            hidden = self.graphs.run(step.input_ids, step.positions, step.slot_mapping,
                                     step.context_lens, step.block_tables)
            if hidden is not None:
                return hidden
        batch = AttentionBatch(step.query_lens, step.context_lens, step.block_tables,
                               self._to_device(step.slot_mapping))
        self.attention.plan(batch)
        return self.model(self._to_device(step.input_ids), self._to_device(step.positions), self.attention)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t
